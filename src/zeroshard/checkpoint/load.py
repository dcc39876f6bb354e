"""Load one rank's share of a checkpoint into any layout: another world size, policy or bucket size.

What is verified when (docs/FORMAT.md has the table):

* opening: manifest format and version, the Layout (offsets re-derived), the file list
  against the world size, and every file's presence and size (one ``stat`` each, so every
  rank fails the same way on a missing or truncated file);
* before any data is read: the run's parameters against the checkpoint's (names, shapes,
  dtypes; also frozen parameters and buffers when ``module_state`` is given), and the
  safetensors header of each file this rank reads against the manifest;
* while reading: the CRC-32 of every checksum block this rank reads. model.safetensors is
  read and checked whole; of rank files only the blocks under the needed ranges.

The result is built in new tensors and returned only when all of this passed, so a failed
load leaves the caller's state as it was.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Callable, Mapping

import torch

from ..layout import Layout
from ..state import ShardedState
from .compat import compare_module, compare_params
from .dtypes import arrays_to_torch, torch_dtype
from .format import MODEL_FILE, fp32_key, rank_file_name, scalar_key, state_key
from .handle import Checkpoint, open_checkpoint
from .manifest import GroupRecord, Manifest
from .model_file import load_model_state, tensor_from_bytes
from .reshard import GroupPlan, plan_reads
from .safetensors_io import ReadStats, TensorEntry, VerifiedRanges, check_entries, read_header


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
) -> ShardedState:
    """This rank's ShardedState for ``layout`` (the new run's), read from ``checkpoint``.

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
        stats: counts the bytes read per file.
    """
    ckpt = open_checkpoint(checkpoint)
    manifest = ckpt.manifest
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} is outside world size {layout.world_size}")
    if base is not None and (base.layout != layout or base.rank != rank):
        raise ValueError("base must be this rank's state under the layout being loaded")
    loadable = _check_match(ckpt, layout, module_state, strict)
    model_state = load_model_state(
        ckpt.path(MODEL_FILE), manifest.files[MODEL_FILE], manifest.model_file_tensors(), manifest.aliases, stats
    )
    if module_state is not None and not strict:
        model_state = {name: tensor for name, tensor in model_state.items() if name in module_state}
    groups = range(len(layout.groups))
    if load_optimizer_states and not load_module_only:
        fp32, states, scalars = _read_partitions(ckpt, layout, rank, loadable, base, stats)
    else:
        fp32 = [_fp32_from_weights(layout, rank, g, model_state, loadable, base) for g in groups]
        states, scalars = [{} for _ in groups], [{} for _ in groups]
    return ShardedState(
        layout=layout,
        rank=rank,
        fp32_partitions=fp32,
        optimizer_states=states,
        optimizer_scalars=scalars,
        param_groups=[] if load_module_only else [
            dataclasses.replace(g, hyperparameters=arrays_to_torch(g.hyperparameters)) for g in manifest.param_groups
        ],
        optimizer_class="" if load_module_only else manifest.optimizer_class,
        model_state=model_state,
        extra={} if load_module_only else arrays_to_torch(dict(manifest.extra)),
    )


def _check_match(
    ckpt: Checkpoint, layout: Layout, module_state: Mapping[str, torch.Tensor] | None, strict: bool
) -> set[str]:
    """Names of the parameters to load; raises (strict) or warns on any difference."""
    what = f"{ckpt.directory}: checkpoint does not match the run's parameters"
    params = compare_params(ckpt.manifest.layout, layout)
    module = compare_module(ckpt.manifest, module_state) if module_state is not None else None
    for mismatch, label in (
        (params, what),
        (module, f"{ckpt.directory}: checkpoint does not match the run's state_dict"),
    ):
        if mismatch and mismatch.retyped:
            raise ValueError(mismatch.describe(label))
        if mismatch and strict:
            raise ValueError(mismatch.describe(label))
        if mismatch:
            warnings.warn(mismatch.describe(label) + "; loading the rest (strict=False)", stacklevel=3)
    return set(layout.param_names) - params.skipped()


def _read_partitions(
    ckpt: Checkpoint, layout: Layout, rank: int, loadable: set[str], base: ShardedState | None, stats: ReadStats | None
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """fp32 master, optimizer states and scalars of every new group, from the old rank files."""
    plans = plan_reads(ckpt.manifest.layout, layout, rank, loadable)
    records = [_record_for(ckpt.manifest, plan) for plan in plans]
    reader = _RankFileReader(ckpt, plans, stats)
    fp32, states, scalars = [], [], []
    for g, (plan, record) in enumerate(zip(plans, records)):
        start = _start(base, layout, rank, g, None, record.fp32_dtype)
        fp32.append(reader.fill(plan, fp32_key, start))
        states.append(
            {
                name: reader.fill(plan, lambda i, n=name: state_key(i, n), _start(base, layout, rank, g, name, dtype))
                for name, dtype in record.states.items()
            }
        )
        scalars.append(reader.scalars(plan, record))
    return fp32, states, scalars


def _record_for(manifest: Manifest, plan: GroupPlan) -> GroupRecord:
    """The dtypes and state names of a new group: those of the old groups it draws from."""
    sources = [manifest.groups[g] for g in plan.source_groups] or [GroupRecord("float32", {}, {})]
    for other, index in zip(sources[1:], plan.source_groups[1:]):
        if (other.fp32_dtype, other.states) != (sources[0].fp32_dtype, sources[0].states):
            raise ValueError(
                f"group {plan.group} takes parameters from old groups {list(plan.source_groups)} whose optimizer state "
                f"differs (group {index}: {other.states}, group {plan.source_groups[0]}: {sources[0].states})"
            )
    return sources[0]


def _start(
    base: ShardedState | None, layout: Layout, rank: int, group: int, name: str | None, dtype: str
) -> torch.Tensor:
    """The partition before the checkpoint's ranges land in it: the base's values, or zeros."""
    if base is not None:
        tensor = base.fp32_partitions[group] if name is None else base.optimizer_states[group].get(name)
        if tensor is not None and tensor.dtype == torch_dtype(dtype):
            return tensor.detach().to("cpu", copy=True)
    return torch.zeros(layout.groups[group].partition_numel, dtype=torch_dtype(dtype))


def _fp32_from_weights(
    layout: Layout,
    rank: int,
    group: int,
    model_state: Mapping[str, torch.Tensor],
    loadable: set[str],
    base: ShardedState | None,
) -> torch.Tensor:
    partition = _start(base, layout, rank, group, None, "float32")
    for fragment in layout.groups[group].fragments(rank):
        if fragment.name in loadable:
            weight = model_state[fragment.name].reshape(-1)
            end = fragment.param_start + fragment.length
            partition[fragment.partition_start : fragment.partition_start + fragment.length] = weight[
                fragment.param_start : end
            ]
    return partition


class _RankFileReader:
    """Reads ranges of old rank files; every header is checked before any data is read."""

    def __init__(self, ckpt: Checkpoint, plans: tuple[GroupPlan, ...], stats: ReadStats | None) -> None:
        self.ckpt = ckpt
        self.stats = stats
        self.manifest = ckpt.manifest
        old_world = self.manifest.world_size
        needed = {rank for plan in plans for rank in plan.source_ranks} | {_scalar_source(plan) for plan in plans}
        self.headers = {rank: self._checked_header(rank_file_name(rank, old_world)) for rank in sorted(needed)}

    def _checked_header(self, file_name: str) -> dict[str, TensorEntry]:
        path = self.ckpt.path(file_name)
        entries = read_header(path, self.manifest.files[file_name].size, self.stats)
        check_entries(path, entries, self.manifest.rank_file_tensors())
        return entries

    def fill(self, plan: GroupPlan, key_of: Callable[[int], str], dest: torch.Tensor) -> torch.Tensor:
        """Copy the plan's ranges of tensor ``key_of(old group)`` into ``dest``, in place."""
        itemsize = dest.element_size()
        dest_bytes = dest.view(torch.uint8)
        for source_rank in plan.source_ranks:
            copies = [c for c in plan.copies if c.source_rank == source_rank]
            file_name = rank_file_name(source_rank, self.manifest.world_size)
            entries = self.headers[source_rank]
            ranges = []
            for copy in copies:
                begin = entries[key_of(copy.source_group)].begin + copy.source_start * itemsize
                ranges.append((begin, begin + copy.length * itemsize))
            data = VerifiedRanges(self.ckpt.path(file_name), self.manifest.files[file_name], ranges, self.stats)
            for copy, (begin, end) in zip(copies, ranges):
                target = dest_bytes[copy.dest_start * itemsize : (copy.dest_start + copy.length) * itemsize]
                target.copy_(torch.frombuffer(data.view(begin, end), dtype=torch.uint8))
        return dest

    def scalars(self, plan: GroupPlan, record: GroupRecord) -> dict[str, torch.Tensor]:
        """Carried as they are: the same on every old rank, so read from one file."""
        if not plan.source_groups or not record.scalars:
            return {}
        source_rank = _scalar_source(plan)
        file_name = rank_file_name(source_rank, self.manifest.world_size)
        entries = self.headers[source_rank]
        keys = {name: entries[scalar_key(plan.source_groups[0], name)] for name in record.scalars}
        data = VerifiedRanges(
            self.ckpt.path(file_name),
            self.manifest.files[file_name],
            [(e.begin, e.end) for e in keys.values()],
            self.stats,
        )
        return {
            name: tensor_from_bytes(
                data.view(e.begin, e.end), torch_dtype(record.scalars[name][0]), record.scalars[name][1]
            )
            for name, e in keys.items()
        }


def _scalar_source(plan: GroupPlan) -> int:
    # A file this rank reads anyway; scalars sit next to its header, in the first block.
    return plan.source_ranks[0] if plan.copies else 0
