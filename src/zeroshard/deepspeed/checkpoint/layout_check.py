"""The layout a DeepSpeed ZeRO-1/2 run used, rebuilt from its files, and checked against them.

:func:`rebuild_layout` rebuilds the flat layout with the layout module's ``deepspeed`` policy
from the model-states file's ``param_shapes``; :class:`RankChecks` compares everything each
rank file says about it (partition counts and sizes, paddings, slice mappings) before
anything is read. A disagreement is a :class:`~.pickled.DeepSpeedFormatError` naming the
file, group and rank: a misread layout would silently scramble weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...io.budget import quoted
from ...layout import GroupLayout, GroupSpec, Layout, LayoutPolicy, ParamSpec, build_layout, canonical_dtype
from ...layout.coordinates import shard_rank
from ...torchfile.torch_records import one_line
from .autoep_layout import expert_group_spec, group_kind
from .files import ModelStates, RankShard
from .pickled import DeepSpeedFormatError


def rebuild_layout(model: ModelStates, first: RankShard, world_size: int) -> Layout:
    """The layout DeepSpeed used: groups from ``param_shapes`` (already in flat-buffer order,
    round-robin reordering included), dtypes from the module, alignment from the paddings.
    An AutoEP run's expert group is partitioned over its W / EP expert-data-parallel ranks."""
    where = f"{first.path}, rank 0"
    if model.autoep is None and set(first.partition_count) != {world_size}:  # named first: the likeliest damage
        raise DeepSpeedFormatError(
            f"{where}: partition_count {quoted(first.partition_count)}, but there are {world_size} rank files"
        )
    saved_world = model.counters.get("dp_world_size")  # an int: read_model_states checked it
    if saved_world is not None and saved_world != world_size:
        raise DeepSpeedFormatError(
            f"{model.path}: dp_world_size is {quoted(saved_world)}, "
            f"but there are {world_size} rank files in {model.path.parent}"
        )
    for what, count in (("fp32 partitions", len(first.fp32)), ("optimizer groups", len(first.param_groups))):
        if len(model.param_shapes) != count:
            raise DeepSpeedFormatError(
                f"{where}: {count} {what}, but {model.path.name} lists {len(model.param_shapes)} groups"
            )
    fallback_dtype = _config_dtype(model.ds_config, first.path)
    groups: list[GroupSpec | list[ParamSpec]] = []
    for index, shapes in enumerate(model.param_shapes):
        if group_kind(model.autoep, list(shapes), first.param_groups[index], f"{where}, group {index}"):
            spec = expert_group_spec(model.autoep, shapes, fallback_dtype, world_size, model.path, model.budget)
            groups.append(spec)
        else:
            dtypes = {name: _param_dtype(model, name, shape, fallback_dtype) for name, shape in shapes.items()}
            groups.append([ParamSpec.of(name, shape, dtypes[name]) for name, shape in shapes.items()])
    counts = [group.world_size if isinstance(group, GroupSpec) else world_size for group in groups]
    if first.partition_count != counts:
        raise DeepSpeedFormatError(
            f"{where}: partition_count {quoted(first.partition_count)}, but {world_size} rank files at EP "
            f"{model.autoep.ep_size if model.autoep else 1} give {counts}"
        )
    policy = LayoutPolicy.deepspeed(parameter_alignment=_uses_parameter_alignment(first, model.ds_config))
    try:
        return build_layout(groups, world_size, policy)
    except ValueError as err:
        raise DeepSpeedFormatError(f"{model.path}: param_shapes do not give a layout: {one_line(err)}") from None


def check_rank(layout: Layout, shard: RankShard) -> None:
    """Compare everything ``shard``'s file says about the layout with ``layout``."""
    RankChecks(layout).check(shard)


class RankChecks:
    """:func:`check_rank` for every rank file of one layout: what the checks expect of every
    rank alike (partition sizes, alignment paddings) is worked out once, not once per file."""

    def __init__(self, layout: Layout, muon: set[int] | frozenset[int] = frozenset()) -> None:
        self.layout = layout
        self._muon = muon  # Muon groups: their momentum has a layout of its own (muon.py checks it)
        self._partition_numels = [group.partition_numel for group in layout.groups]
        self._paddings = [[slot.padding for slot in group.params] for group in layout.groups]

    def check(self, shard: RankShard) -> None:
        """Compare everything ``shard``'s file says about the layout (partition counts and sizes,
        paddings, slice mappings, state sizes) with the layout; DeepSpeedFormatError naming
        the file, group and rank at the first difference."""
        group_count = len(self.layout.groups)
        per_group = {
            "fp32 partitions": shard.fp32,
            "optimizer groups": shard.param_groups,
            "group_paddings": shard.group_paddings,
            "partition_count entries": shard.partition_count,
            "param_slice_mappings": shard.slice_mappings,
        }
        if shard.param_alignment_paddings is not None:  # None: written before DeepSpeed had the key
            per_group["param_alignment_paddings"] = shard.param_alignment_paddings
        for what, values in per_group.items():
            if len(values) != group_count:
                raise DeepSpeedFormatError(
                    f"{shard.path}, rank {shard.rank}: {len(values)} {what}, the layout has {group_count} groups"
                )
        for group in self.layout.groups:
            self._check_group(group, shard)

    def _check_group(self, group: GroupLayout, shard: RankShard) -> None:
        rank, index = shard.rank, group.index
        partition_numel = self._partition_numels[index]

        def mismatch(message: str) -> DeepSpeedFormatError:
            return DeepSpeedFormatError(f"{shard.path}, group {index}, rank {rank}: {message}")

        if shard.partition_count[index] != group.world_size:
            raise mismatch(f"partition_count {quoted(shard.partition_count[index])}, expected {group.world_size}")
        place = shard_rank(group, rank)  # the rank's place in the group's shard group (an expert group's: rank // EP)
        # DeepSpeed saves the fp32 partition without the group's tail padding.
        stored = sum(piece.length for piece in group.logical_ranges(place))
        tail = partition_numel - stored
        fp32 = shard.fp32[index]
        if fp32.numel() != stored:
            raise mismatch(f"saved fp32 partition has {fp32.numel()} elements, the layout gives {stored}")
        if fp32.dtype != "float32":
            raise mismatch(f"saved fp32 partition is {fp32.dtype}, not float32")
        if shard.group_paddings[index] != tail:
            raise mismatch(f"group_paddings says {quoted(shard.group_paddings[index])}, the layout gives {tail}")
        for key, tensor in shard.states[index].items():
            if index not in self._muon and tensor.numel() != partition_numel:
                raise mismatch(
                    f"optimizer state {quoted(key)} has {tensor.numel()} elements, the partition has {partition_numel}"
                )
        expected_pads = self._paddings[index]
        if shard.param_alignment_paddings is not None and shard.param_alignment_paddings[index] != expected_pads:
            raise mismatch(
                f"param_alignment_paddings {quoted(shard.param_alignment_paddings[index])}, "
                f"the layout gives {quoted(expected_pads)}"
            )
        expected = {f.name: (f.length, f.partition_start) for f in group.fragments(place)}
        found = shard.slice_mappings[index]
        if found != expected:
            name = next(n for n in sorted(set(found) | set(expected)) if found.get(n) != expected.get(n))
            raise mismatch(
                f"param_slice_mappings[{quoted(name)}] (numel, start) is {quoted(found.get(name))}, "
                f"the layout gives {expected.get(name)}"
            )


def _uses_parameter_alignment(first: RankShard, ds_config: dict[str, Any]) -> bool:
    if first.param_alignment_paddings is None:
        return False  # written before DeepSpeed had the option
    if any(pad for group in first.param_alignment_paddings for pad in group):
        return True
    # All zero: both policies give the same offsets; follow the config for the record.
    zero = ds_config.get("zero_optimization")  # a dict, or DeepSpeed's legacy bool
    return isinstance(zero, dict) and bool(zero.get("parameter_alignment", False))


def _param_dtype(model: ModelStates, name: str, shape: tuple[int, ...], fallback: str) -> str:
    tensor = model.module.get(name)
    if tensor is None:
        if model.module:
            raise DeepSpeedFormatError(
                f"{model.path}: param_shapes lists {quoted(name)}, the module has no such tensor"
            )
        return fallback
    if tuple(tensor.shape) != shape:
        raise DeepSpeedFormatError(
            f"{model.path}: {quoted(name)} is {list(tensor.shape)} in the module, {quoted(list(shape))} in param_shapes"
        )
    return canonical_dtype(tensor.dtype)


def _config_dtype(ds_config: dict[str, Any], rank_file: Path) -> str:
    for key, dtype in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16")):
        if (ds_config.get(key) or {}).get("enabled"):
            return dtype
    return "bfloat16" if rank_file.name.startswith("bf16_") else "float32"
