"""Convert any saved run (a :class:`ShardSource`) to a universal checkpoint, streaming.

The shards are planned up front from the shapes; then each tensor is assembled from the
ranks that hold its pieces (:func:`read_param`), written, and dropped, so memory stays near
the largest parameter whatever the checkpoint's size. Parameters go in layout order, each
with its fp32 master then its optimizer states, so a checksum block shared by neighbouring
pieces (or, in a rank file smaller than one block, by all of a parameter's tensors) is
still in the reader's small cache when it is needed again. A stacked expert weight is written
as one tensor per global expert in ``nn.Linear`` orientation (:mod:`..experts`). Everything
read is digested in logical order and checked against the source's digests
(:mod:`..read_digests`); the output carries them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..io.directory import write_file_durably
from ..io.dtypes import dtype_of
from ..format import DEFAULT_BLOCK_SIZE
from ..formats import open_source
from ..io.output_dir import staged_output
from ..io.safetensors_io import PlannedTensor
from ..experts import exported_params, read_exported
from ..read_digests import ReadChecker
from ..source import ShardSource
from ..io.streaming import OutputTensor, plan_shards, write_shards
from .format import (
    DEFAULT_MAX_SHARD_SIZE,
    FORMAT_NAME,
    MANIFEST_FILE,
    UniversalManifest,
    UniversalParam,
    UniversalParamGroup,
    model_key,
    param_key,
    shard_file_name,
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
            return to_universal(
                opened, out_dir, max_shard_size=max_shard_size, progress=progress, overwrite=overwrite, block_size=block_size
            )
        finally:
            opened.close()
    if source.info.weights_from_masters:
        raise ValueError(f"{source.path}: already a universal checkpoint")
    checker = ReadChecker(source)
    manifest = describe(source, checker)
    tensors = output_tensors(source, manifest, checker)
    shards = plan_shards([t.planned.nbytes for t in tensors], max_shard_size)
    names = [shard_file_name(i, len(shards)) for i in range(len(shards))]
    with staged_output(out_dir, markers=[MANIFEST_FILE], overwrite=overwrite, what="universal checkpoint") as staging:
        records = write_shards(
            staging,
            tensors,
            shards,
            names,
            block_size=block_size,
            metadata={"format": FORMAT_NAME},
            progress=progress,
            description="to-universal",
        )
        weight_map = {tensors[i].planned.key: name for shard, name in zip(shards, names) for i in shard}
        digests = checker.digests(len(manifest.param_groups), list(manifest.model_entries))
        complete = dataclasses.replace(manifest, shards=records, weight_map=weight_map, digests=digests)
        write_file_durably(staging / MANIFEST_FILE, complete.to_json())
    return Path(out_dir)


def describe(source: ShardSource, checker: ReadChecker | None = None) -> UniversalManifest:
    """The manifest of ``source``'s universal checkpoint, without shards, weight map and
    digests (``checker`` checks and keeps the scalars' as they are read)."""
    info = source.info
    layout = info.layout
    owner = _param_group_of_layout_groups(source)
    params: dict[str, UniversalParam] = {}
    exported: dict[str, list[str]] = {}  # layout parameter -> its exported names
    for param in exported_params(layout):
        group = layout.param(param.param)[0]
        states = tuple(info.state_keys[group.index])
        params[param.name] = UniversalParam(param.shape, group.dtype, owner[group.index], states)
        exported.setdefault(param.param, []).append(param.name)
    experts = {slot.name: tuple(exported[slot.name]) for g in layout.groups if g.is_expert_group for slot in g.params}
    param_groups = [
        UniversalParamGroup(
            hyperparameters=dict(state.hyperparameters),
            params=tuple(name for g in state.layout_groups for slot in layout.groups[g].params for name in exported[slot.name]),
            scalars=_scalars_of(source, index, state.layout_groups, checker),
        )
        for index, state in enumerate(info.param_groups)
    ]
    return UniversalManifest(
        source={
            "kind": getattr(source, "kind", type(source).__name__),
            "path": str(source.path),
            "world_size": layout.world_size,
            "policy": layout.policy.to_dict(),
        },
        optimizer_class=info.optimizer_class,
        param_groups=param_groups,
        params=params,
        model_entries={entry.name: entry for entry in info.model_entries},
        aliases=dict(info.aliases),
        extra=dict(info.extra),
        experts=experts,
    )


def output_tensors(source: ShardSource, manifest: UniversalManifest, checker: ReadChecker | None = None) -> list[OutputTensor]:
    """Every tensor of the universal shards, in write order, each with its producer (which
    ``checker``, if given, checks and digests)."""
    layout = source.info.layout
    check = checker.param if checker is not None else None
    tensors: list[OutputTensor] = []
    for param in exported_params(layout):
        for key in ("fp32", *source.info.state_keys[layout.param(param.param)[0].index]):
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


def _param_group_of_layout_groups(source: ShardSource) -> list[int]:
    owner: dict[int, int] = {}
    for index, state in enumerate(source.info.param_groups):
        for group in state.layout_groups:
            if group in owner:
                raise ValueError(f"{source.path}: layout group {group} is in param groups {owner[group]} and {index}")
            owner[group] = index
    missing = [g.index for g in source.info.layout.groups if g.index not in owner]
    if missing:
        raise ValueError(f"{source.path}: layout groups {missing} belong to no optimizer param group")
    return [owner[g.index] for g in source.info.layout.groups]


def _scalars_of(source: ShardSource, index: int, layout_groups: list[int], checker: ReadChecker | None) -> dict[str, Any]:
    """The param group's scalars; every layout group of it must hold the same ones."""
    found = [source.scalars(g) for g in layout_groups]
    if checker is not None:
        for group, scalars in zip(layout_groups, found):
            checker.scalars(index, group, scalars)
    for group, other in zip(layout_groups[1:], found[1:]):
        if not _same_scalars(found[0], other):
            raise ValueError(
                f"{source.path}: param group {index}: layout groups {layout_groups[0]} and {group} hold different "
                "optimizer scalars (step); a universal checkpoint keeps one set per param group"
            )
    return found[0] if found else {}


def _same_scalars(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and _same_array(x, y)):
                return False
        elif x != y:
            return False
    return True


def _same_array(x: np.ndarray, y: np.ndarray) -> bool:
    """Same dtype, shape and bytes (so NaN equals NaN, and -0.0 differs from 0.0)."""
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
