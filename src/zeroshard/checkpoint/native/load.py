"""Load one rank's share of a native checkpoint into any layout: another world size, policy or bucket size.

What is verified when (docs/FORMAT.md has the table):

* opening: manifest format and version, the Layout (offsets re-derived), the file list
  against the world size, and every file's presence and size (one ``stat`` each, so every
  rank fails the same way on a missing or truncated file);
* before any data is read: the run's parameters against the checkpoint's (names, shapes,
  dtypes; also frozen parameters and buffers when ``module_state`` is given); before a
  file's first byte of data, its safetensors header against the manifest;
* while reading: the CRC-32 of every checksum block this rank reads: of model.safetensors
  the blocks under its tensors, of rank files only the blocks under the needed ranges.

The reading is :func:`~zeroshard.checkpoint.loader.load_state`'s, the loader of every kind
of checkpoint; this is its native entry point.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from ...layout import Layout
from ...state import ShardedState
from ..coordinator import Coordinator
from .handle import Checkpoint
from ..attest.attested import load_from
from .source import NativeSource
from ...io.safetensors_io import ReadStats


def load_sharded(
    checkpoint: str | os.PathLike[str] | Checkpoint,
    layout: Layout,
    rank: int,
    *,
    load_optimizer_states: bool = True,
    load_module_only: bool = False,
    strict: bool = True,
    module_state: Mapping[str, torch.Tensor] | None = None,
    base: ShardedState | None = None,
    stats: ReadStats | None = None,
    coordinator: Coordinator | None = None,
) -> ShardedState:
    """This rank's ShardedState for ``layout`` (the new run's), read from the native
    ``checkpoint`` (a tag directory, a root with ``latest``, or an opened Checkpoint).
    Collective when given a ``coordinator``; without one the rank loads alone.

    Args:
        load_optimizer_states: False leaves optimizer state empty and rebuilds the fp32
            master from the checkpoint's model weights.
        load_module_only: the module's weights only; fp32 master rebuilt from them; no
            optimizer class, param groups or ``extra``.
        strict: the checkpoint's parameters must be the run's (ValueError listing all that
            differ); False loads those both have, with the same shape, and warns.
        module_state: the run's ``module.state_dict()``, to check frozen parameters and
            buffers too before anything is returned.
        base: the run's current state on this rank; what the checkpoint does not provide
            (with strict=False) keeps its values from here instead of zeros.
        stats: counts the bytes read per file (with a ``coordinator``, also what each rank read).
        coordinator: the ranks loading together (collective): every rank's state is attested
            with the others' and every rank raises the same error, or none does. Without one,
            the rank attests alone what it holds whole (all of it in a world of one).

    Raises:
        CheckpointDamagedError: a file is missing, truncated or corrupted, or the attestation
            fails (AttestationError); with a coordinator, on every rank.
        FileNotFoundError: alone, when the checkpoint or its manifest is missing (with a
            coordinator, a ValueError on every rank).
        ValueError: the checkpoint does not fit the run (parameters, shapes, dtypes, a rank
            outside ``layout``), or the ranks' loads differ; with a coordinator, on every rank.
    """
    return load_from(
        lambda: NativeSource(checkpoint, stats=stats),
        str(getattr(checkpoint, "directory", checkpoint)),
        layout,
        rank,
        coordinator,
        load_optimizer_states=load_optimizer_states,
        load_module_only=load_module_only,
        strict=strict,
        module_state=module_state,
        base=base,
        stats=stats,
    )
