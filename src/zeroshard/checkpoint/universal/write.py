"""Convert any saved run (a :class:`ShardSource`) to a universal checkpoint, streaming.

The shards are planned up front from the shapes; then each tensor is assembled from the
ranks that hold its pieces (:func:`read_param`), written, and dropped, so memory stays near
the largest parameter whatever the checkpoint's size. Parameters go in layout order, each
with its fp32 master then its optimizer states, so a checksum block shared by neighbouring
pieces (or, in a rank file smaller than one block, by all of a parameter's tensors) is
still in the reader's small cache when it is needed again. An expert stack is written as one
global tensor ``[E, ...]`` under its own name (its description in the manifest's
``expert_stacks``), a legacy one (MoEGPT's) as one tensor per global expert in ``nn.Linear``
orientation, as before (:mod:`..experts`). Everything read is digested in logical order
(each expert of a stack on its own) and checked against the source's digests
(:mod:`..attest.read_digests`); the output carries them, and the model's config files the source
recorded (:mod:`..model_config`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path
import numpy as np

from ...layout import LEGACY_STACK
from ..directory import write_file_durably
from ...io.dtypes import dtype_of
from ..format import DEFAULT_BLOCK_SIZE
from ..formats import open_source
from ..output_dir import OutputKind, output_path, staged_output
from ...io.safetensors_io import PlannedTensor
from ..experts import UNIVERSAL_FORM, ExportedParam, exported_params, read_exported
from ..attest.read_digests import ReadChecker
from ..model_config import STORED_NAMES, stored_name, write_config
from ..param_groups import universal_param_groups
from ..source import ShardSource, read_model_configs
from ...io.streaming import OutputTensor, plan_shards, write_shards
from .format import (
    DEFAULT_MAX_SHARD_SIZE,
    DIGESTS_VERSION,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
    UniversalManifest,
    UniversalParam,
    UniversalParamGroup,
    model_key,
    param_key,
    shard_file_name,
    shard_metadata,
)

OUTPUT_KIND = OutputKind(
    "universal checkpoint",
    r"universal\.json|universal-\d{5,}-of-\d{5,}\.safetensors|" + "|".join(map(re.escape, STORED_NAMES)),
    (MANIFEST_FILE,),
    {"format": FORMAT_NAME},
)


def to_universal(
    source: ShardSource | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    progress: bool | None = None,
    overwrite: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Path:
    """Write the universal checkpoint of ``source`` (a ShardSource, or a path to a native or
    DeepSpeed checkpoint) to ``out_dir``; returns ``out_dir``.

    Shards hold at most ``max_shard_size`` bytes of tensor data (a bigger tensor gets its
    own). ``progress``: a tqdm bar; None shows it when stderr is a terminal. An existing
    complete universal checkpoint at ``out_dir`` is replaced only with ``overwrite``.
    """
    if isinstance(source, (str, os.PathLike)):
        opened = open_source(source)
        try:
            return _convert(opened, out_dir, (source, opened.path), max_shard_size, progress, overwrite, block_size)
        finally:
            opened.close()
    return _convert(source, out_dir, (source.path,), max_shard_size, progress, overwrite, block_size)


def _convert(
    source: ShardSource,
    out_dir: str | os.PathLike[str],
    inputs: tuple[str | os.PathLike[str], ...],
    max_shard_size: int,
    progress: bool | None,
    overwrite: bool,
    block_size: int,
) -> Path:
    if source.info.weights_from_masters:
        raise ValueError(f"{source.path}: already a universal checkpoint")
    out_dir = output_path(out_dir)  # once: publishing may replace the current directory
    checker = ReadChecker(source)
    manifest = describe(source, checker)
    tensors = output_tensors(source, manifest, checker)
    configs = read_model_configs(source)
    version = FORMAT_VERSION if configs else DIGESTS_VERSION  # what the complete manifest will say
    shards = plan_shards([t.planned.nbytes for t in tensors], max_shard_size)
    names = [shard_file_name(i, len(shards)) for i in range(len(shards))]
    with staged_output(out_dir, kind=OUTPUT_KIND, overwrite=overwrite, inputs=inputs) as staging:
        records = write_shards(
            staging,
            tensors,
            shards,
            names,
            block_size=block_size,
            metadata=shard_metadata(version),
            progress=progress,
            description="to-universal",
            page_aligned=True,  # a load reads the masters past the page cache straight into its partitions
        )
        weight_map = {tensors[i].planned.key: name for shard, name in zip(shards, names) for i in shard}
        digests = checker.digests(len(manifest.param_groups), list(manifest.model_entries))
        stored = {stored_name(name): text for name, text in configs.items()}
        stored = {name: write_config(staging, name, text, block_size) for name, text in stored.items()}
        complete = dataclasses.replace(manifest, shards=records, weight_map=weight_map, digests=digests, configs=stored)
        assert complete.format_version == version, (complete.format_version, version)
        write_file_durably(staging / MANIFEST_FILE, complete.to_json())
    return out_dir


def describe(source: ShardSource, checker: ReadChecker | None = None) -> UniversalManifest:
    """The manifest of ``source``'s universal checkpoint, without shards, weight map and
    digests (``checker`` checks and keeps the scalars' as they are read)."""
    info = source.info
    layout = info.layout
    owner, scalars = universal_param_groups(source, checker)
    params: dict[str, UniversalParam] = {}
    exported: dict[str, list[str]] = {}  # layout parameter -> its exported names
    for param in exported_params(layout, UNIVERSAL_FORM):
        group = layout.param(param.param)[0]
        states = tuple(info.state_keys[group.index])
        params[param.name] = UniversalParam(param.shape, group.dtype, owner[group.index], states)
        exported.setdefault(param.param, []).append(param.name)
    expert_slots = [(g, slot) for g in layout.groups if g.is_expert_group for slot in g.params]
    experts = {slot.name: tuple(exported[slot.name]) for g, slot in expert_slots if g.stacks[slot.index] == LEGACY_STACK}
    stacks = {slot.name: g.stacks[slot.index] for g, slot in expert_slots if g.stacks[slot.index] != LEGACY_STACK}
    param_groups = [
        UniversalParamGroup(
            hyperparameters=dict(state.hyperparameters),
            params=tuple(name for g in state.layout_groups for slot in layout.groups[g].params for name in exported[slot.name]),
            scalars=scalars[index],
            optimizer=state.optimizer if state.optimizer != info.optimizer_class else "",
        )
        for index, state in enumerate(info.param_groups)
    ]
    return UniversalManifest(
        source={
            "kind": getattr(source, "kind", type(source).__name__),
            "path": str(source.path),
            "world_size": getattr(source, "world_size", layout.world_size),  # a view's: of the run it read
            "policy": layout.policy.to_dict(),
        },
        optimizer_class=info.optimizer_class,
        param_groups=param_groups,
        params=params,
        model_entries={entry.name: entry for entry in info.model_entries},
        aliases=dict(info.aliases),
        extra=dict(info.extra),
        experts=experts,
        expert_stacks=stacks,
    )


def output_tensors(
    source: ShardSource, manifest: UniversalManifest, checker: ReadChecker | None = None
) -> list[OutputTensor]:
    """Every tensor of the universal shards, in write order, each with its producer (which
    ``checker``, if given, checks and digests).

    The order is a load's: per layout group, per key ("fp32", then each state), its
    parameters in layout order. A loader reads a group's masters, then each state, each a
    run of the group's parameters back to back (:mod:`..packed`), so each such run is one
    range of a shard: read with one read, no checksum block read twice."""
    layout = source.info.layout
    check = checker.param if checker is not None else None
    by_group: dict[int, list[ExportedParam]] = {}
    for param in exported_params(layout, UNIVERSAL_FORM):
        by_group.setdefault(layout.param(param.param)[0].index, []).append(param)
    tensors: list[OutputTensor] = []
    for group, params in by_group.items():
        for key in ("fp32", *source.info.state_keys[group]):
            for param in params:
                planned = PlannedTensor(param_key(param.name, key), "float32", param.shape)
                tensors.append(OutputTensor(planned, functools.partial(read_exported, source, param, key, check)))
    for name, entry in manifest.model_entries.items():
        planned = PlannedTensor(model_key(name), entry.dtype, entry.shape)
        tensors.append(OutputTensor(planned, functools.partial(_model_tensor, source, name, planned, checker)))
    return tensors


def _model_tensor(source: ShardSource, name: str, planned: PlannedTensor, checker: ReadChecker | None) -> np.ndarray:
    tensor = source.model_tensor(name)
    if checker is not None:
        checker.model_tensor(name, tensor)
    dtype = dtype_of(tensor).name
    if dtype != planned.dtype or tuple(tensor.shape) != planned.shape:
        raise ValueError(
            f"{source.path}: module tensor {name!r} is {dtype} {list(tensor.shape)}, "
            f"the checkpoint describes it as {planned.dtype} {list(planned.shape)}"
        )
    return tensor
