"""One rank's :class:`ShardedState` for any new layout, from a universal checkpoint or any ShardSource.

Both are :func:`~zeroshard.checkpoint.loader.load_state`, the loader of every kind of
checkpoint; these are its entry points for a universal checkpoint and for an opened source.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from ...layout import Layout
from ...state import ShardedState
from ..coordinator import Coordinator
from ..attest.attested import load_from
from ..loader import load_state
from .read import UniversalCheckpoint
from .source import UniversalSource


def load_universal(
    path: str | os.PathLike[str] | UniversalCheckpoint,
    layout: Layout,
    rank: int,
    *,
    load_optimizer_states: bool = True,
    load_module_only: bool = False,
    strict: bool = True,
    module_state: Mapping[str, torch.Tensor] | None = None,
    base: ShardedState | None = None,
    coordinator: Coordinator | None = None,
) -> ShardedState:
    """This rank's state under ``layout`` (the new run's), read from a universal checkpoint.

    The fp32 master partition is read exactly; ``model_state`` is the full module
    state_dict: each trained parameter's fp32 master cast to its dtype in ``layout`` (a run
    may change precision), plus buffers, frozen parameters and tied names. So every rank
    reads all fp32 masters once, and of the optimizer states only its own fragments.
    Options as for :func:`~zeroshard.checkpoint.loader.load_state`. Collective when given a
    ``coordinator``: the ranks load and attest together, as
    :func:`~zeroshard.checkpoint.native.load.load_sharded`; without one the rank loads alone.

    Raises:
        CheckpointDamagedError: a file is missing, truncated or corrupted, or the attestation
            fails (AttestationError); with a coordinator, on every rank.
        FileNotFoundError: alone, when the checkpoint or its manifest is missing (with a
            coordinator, a ValueError on every rank).
        ValueError: the checkpoint does not fit the run, or its manifest is not one this
            zeroshard reads; with a coordinator, on every rank.
    """
    return load_from(
        lambda: UniversalSource(path),
        str(getattr(path, "directory", path)),
        layout,
        rank,
        coordinator,
        load_optimizer_states=load_optimizer_states,
        load_module_only=load_module_only,
        strict=strict,
        module_state=module_state,
        base=base,
    )

load_from_source = load_state
"""This rank's state under a layout, read range by range from any opened ShardSource (a
DeepSpeed checkpoint, a native or universal one): the one loader,
:func:`~zeroshard.checkpoint.loader.load_state`, under its older name."""
