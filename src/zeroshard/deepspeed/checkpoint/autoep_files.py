"""What DeepSpeed AutoEP adds to a ZeRO-1/2 checkpoint, as plain dataclasses, every field checked.

A tag folder of an AutoEP run (DeepSpeed 0.19.8, docs/DEEPSPEED.md "AutoEP checkpoints")
holds the dense files and:

* in ``mp_rank_00_model_states.pt``, ``ds_autoep_layers``: per MoE layer its module path, the
  expert count, EP, the placement (the global expert ids each EP rank holds, in the order of
  its stacked weights) and affine maps that restate the placement per weight;
* one ``layer_{L}_expert_{g}_mp_rank_00_model_states.pt`` per MoE layer ``L`` and global
  expert ``g``, holding ``{prefix}.w1.{g}`` ``[I, H]``, ``{prefix}.w2.{g}`` ``[H, I]`` and
  ``{prefix}.w3.{g}`` ``[I, H]`` in the run's dtype (read by :mod:`.autoep_experts`).

The fp32 masters and Adam state of the stacked ``{prefix}.w1`` ``[E / EP, I, H]`` (and w2,
w3) are in the ZeRO rank files, in an optimizer group of their own partitioned over the
expert-data-parallel group. Parsing checks types, values and agreement within the metadata;
:mod:`.source` checks it against the layout.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...io.budget import Budget, quoted
from . import fields
from .pickled import DeepSpeedFormatError

LAYERS_KEY = "ds_autoep_layers"
_LEGACY_LAYERS_KEY = "autoep_layers"  # older DeepSpeed releases
CHECKPOINT_FORMAT = "per_expert_files"  # ZeRO-3's "zero3_partitioned" is not read
EXPERT_WEIGHTS = ("w1", "w2", "w3")  # gate [I, H], down [H, I], up [I, H] per expert
EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt$")
_VERSION = 1  # of the placement descriptor and of the affine maps


@dataclass(frozen=True)
class AutoEPLayer:
    """One MoE layer AutoEP replaced."""

    moe_layer_id: int  # numbers its expert files
    module_path: str  # "model.layers.0.mlp"
    expert_key_prefix: str  # "model.layers.0.mlp.experts"
    num_experts: int
    ep_size: int
    placement: tuple[tuple[int, ...], ...]  # per EP rank, its global expert ids in local order
    affine_maps: dict[str, Any]  # per stacked weight name: the map as saved (checked by check_affine_maps)
    data_parallel_size: int  # expert-data-parallel ranks, as rank 0 saw them

    def param_name(self, weight: str) -> str:
        """The stacked weight in the ZeRO files: ``model.layers.0.mlp.experts.w1``."""
        return f"{self.expert_key_prefix}.{weight}"

    def expert_file(self, expert: int) -> str:
        """``layer_0_expert_5_mp_rank_00_model_states.pt``: the file of global expert ``expert``."""
        return f"layer_{self.moe_layer_id}_expert_{expert}_mp_rank_00_model_states.pt"

    def expert_key(self, weight: str, expert: int) -> str:
        """``model.layers.0.mlp.experts.w1.5``: the key of one expert's ``weight`` in its file."""
        return f"{self.expert_key_prefix}.{weight}.{expert}"


@dataclass(frozen=True)
class AutoEP:
    """The AutoEP metadata of a checkpoint."""

    layers: tuple[AutoEPLayer, ...]
    ep_size: int
    preset: str | None  # ds_config expert_parallel.preset_model

    def expert_params(self) -> dict[str, tuple[AutoEPLayer, str]]:
        """Every stacked expert weight of the ZeRO files -> (its layer, w1/w2/w3)."""
        return {layer.param_name(weight): (layer, weight) for layer in self.layers for weight in EXPERT_WEIGHTS}


def parse_autoep(raw: dict[str, Any], ds_config: dict[str, Any], path: Path, budget: Budget) -> AutoEP | None:
    """The AutoEP metadata of a model-states file (``raw``, its top-level dict; ``ds_config``
    already checked as plain data), or None for a run without AutoEP. What parsing copies is
    charged to the file's ``budget`` first (a pickle may share one layer, placement or id list
    many times), and every count is compared with what it must equal before anything of its
    size is built."""
    if raw.get(_LEGACY_LAYERS_KEY) is not None and raw.get(LAYERS_KEY) is None:
        raise DeepSpeedFormatError(
            f"{path}: {_LEGACY_LAYERS_KEY}: AutoEP metadata of an older DeepSpeed is not supported"
        )
    value = raw.get(LAYERS_KEY)
    if value is None:
        return None
    entries = fields.sequence(value, LAYERS_KEY, path, budget)
    if not entries:
        raise fields.field_error(path, LAYERS_KEY, "is empty")
    layers: list[AutoEPLayer] = []
    module_paths: set[str] = set()  # strings: their hashes are keyed by the process, a file cannot make them collide
    for index, entry in enumerate(entries):
        layer = _layer(entry, f"{LAYERS_KEY}[{index}]", path, budget)
        if layer.module_path in module_paths:  # at once: one layer shared by every entry is no more work than two
            raise fields.field_error(path, LAYERS_KEY, f"names module_path {quoted(layer.module_path)} twice")
        module_paths.add(layer.module_path)
        layers.append(layer)
    ordered = sorted(layer.moe_layer_id for layer in layers)  # not a set: ints a file chose may share a hash
    twice = next((first for first, second in zip(ordered, ordered[1:]) if first == second), None)
    if twice is not None:
        raise fields.field_error(path, LAYERS_KEY, f"names moe_layer_id {quoted(twice)} twice")
    ep_size = layers[0].ep_size
    other = next((layer.ep_size for layer in layers if layer.ep_size != ep_size), None)
    if other is not None:
        raise fields.field_error(path, LAYERS_KEY, f"mixes expert-parallel sizes {quoted(ep_size)} and {quoted(other)}")
    counts = raw.get("num_experts")
    expected = [layer.num_experts for layer in layers]
    if counts is not None and fields.integers(counts, "num_experts", path, budget) != expected:
        raise fields.field_error(path, "num_experts", f"is {quoted(counts)}, {LAYERS_KEY} gives {quoted(expected)}")
    return AutoEP(tuple(layers), ep_size, _check_config(ds_config, ep_size, path))


def _layer(value: Any, where: str, path: Path, budget: Budget) -> AutoEPLayer:
    entry = fields.mapping(value, where, path, budget)

    def integer(key: str, minimum: int = 0) -> int:
        return fields.integer(entry.get(key), f"{where}[{quoted(key)}]", path, minimum=minimum)

    def text(key: str) -> str:
        found = fields.text(entry.get(key), f"{where}[{quoted(key)}]", path)
        if not found:
            raise fields.field_error(path, f"{where}[{quoted(key)}]", "is empty")
        return found

    def wrong(key: str, problem: str) -> DeepSpeedFormatError:
        return fields.field_error(path, f"{where}[{quoted(key)}]", problem)

    fmt = entry.get("checkpoint_format", CHECKPOINT_FORMAT)
    if fmt != CHECKPOINT_FORMAT or entry.get("checkpoint_format_version") is not None:
        raise wrong(
            "checkpoint_format",
            f"is {quoted(fmt)} (version {quoted(entry.get('checkpoint_format_version'))}); "
            f"only {CHECKPOINT_FORMAT!r} is read",
        )
    num_experts, ep_size, local = integer("num_experts", 1), integer("ep_size", 1), integer("num_local_experts", 1)
    if local * ep_size != num_experts:
        raise wrong(
            "num_local_experts",
            f"is {quoted(local)}: {quoted(ep_size)} EP ranks x {quoted(local)} is not {quoted(num_experts)} experts",
        )
    module_path, prefix = text("module_path"), text("expert_key_prefix")
    if not prefix.startswith(module_path + "."):
        raise wrong("expert_key_prefix", f"{quoted(prefix)} is not inside module {quoted(module_path)}")
    sizes = (num_experts, ep_size)
    placement = _placement(entry.get("expert_placement"), sizes, f"{where}['expert_placement']", path, budget)
    if text("ep_group_name") != f"ep_size_{ep_size}":
        raise wrong("ep_group_name", f"is {quoted(entry['ep_group_name'])}, expected 'ep_size_{ep_size}'")
    for key in ("ep_rank", "expert_data_parallel_rank"):  # rank 0 writes the file
        if integer(key) != 0:
            raise wrong(key, f"is {quoted(entry[key])}, expected 0 (the model-states file is rank 0's)")
    first = placement[0]
    start, end = integer("global_expert_start"), integer("global_expert_end")
    if list(first) == list(range(first[0], first[0] + len(first))) and (start, end) != (first[0], first[-1] + 1):
        raise wrong(
            "global_expert_start",
            f"and global_expert_end are [{quoted(start)}, {quoted(end)}), "
            f"EP rank 0 holds experts {quoted(list(first))}",
        )
    maps = _affine_maps(entry.get("affine_maps"), prefix, f"{where}['affine_maps']", path, budget)
    return AutoEPLayer(
        integer("moe_layer_id"),
        module_path,
        prefix,
        num_experts,
        ep_size,
        placement,
        maps,
        integer("expert_data_parallel_world_size", 1),
    )


def _placement(
    value: Any, sizes: tuple[int, int], where: str, path: Path, budget: Budget
) -> tuple[tuple[int, ...], ...]:
    """Global expert ids per EP rank, every expert on exactly one EP rank, E / EP on each
    (``sizes``: E and EP). Files without a descriptor (older DeepSpeed releases) are refused:
    the ids would come from ``num_experts`` alone, a number a file could make as big as it
    likes. The EP ranks listed and each one's ids are counted before they are copied, and each
    copy is charged to ``budget``: E comes from the file, so E ids are built only once the file
    has listed them."""
    num_experts, ep_size = sizes
    local = num_experts // ep_size
    if value is None:
        raise fields.field_error(path, where, "is missing (AutoEP metadata of an older DeepSpeed is not supported)")
    descriptor = fields.mapping(value, where, path, budget)
    for key, expected in (("version", _VERSION), ("num_experts", num_experts), ("ep_size", ep_size)):
        found = descriptor.get(key)
        if type(found) is not int or found != expected:
            words = f"is {quoted(found)}, expected {quoted(expected)}"
            raise fields.field_error(path, f"{where}[{quoted(key)}]", words)
    listed = descriptor.get("ranks")
    if isinstance(listed, (list, tuple)) and len(listed) != ep_size:
        raise fields.field_error(path, f"{where}['ranks']", f"lists {len(listed):,} EP ranks, expected {ep_size}")
    by_rank: dict[int, tuple[int, ...]] = {}  # keys below EP, which is a count of items the file lists
    for index, item in enumerate(fields.sequence(listed, f"{where}['ranks']", path, budget)):
        label = f"{where}['ranks'][{index}]"
        rank_entry = fields.mapping(item, label, path, budget)
        rank = fields.integer(rank_entry.get("rank"), f"{label}['rank']", path)
        if rank >= ep_size or rank in by_rank:
            words = f"is {quoted(rank)}: EP ranks are 0..{ep_size - 1}, each once"
            raise fields.field_error(path, f"{label}['rank']", words)
        experts = rank_entry.get("experts")
        if isinstance(experts, (list, tuple)) and len(experts) != local:
            words = f"lists {len(experts):,} experts, expected {quoted(local)} (E / EP)"
            raise fields.field_error(path, f"{label}['experts']", words)
        by_rank[rank] = tuple(fields.integers(experts, f"{label}['experts']", path, budget))
    placement = tuple(by_rank[rank] for rank in range(ep_size))
    ids = sorted(expert for experts in placement for expert in experts)  # E of them, each charged
    wrong = next((index for index, expert in enumerate(ids) if expert != index), None)
    if wrong is not None:
        shown = quoted([list(experts) for experts in placement])  # the ids themselves only when short
        placed = f"places experts {shown}" if shown.startswith("[") else f"places {num_experts:,} experts"
        reason = f"expert {wrong} is on none" if ids[wrong] > wrong else f"expert {ids[wrong]} is on two"
        raise fields.field_error(
            path, where, f"{placed} ({reason}): each of 0..{num_experts - 1} must be on exactly one EP rank, "
            f"{local} per rank (replicated experts are not read)"
        )  # fmt: skip
    return placement


def _affine_maps(value: Any, prefix: str, where: str, path: Path, budget: Budget) -> dict[str, Any]:
    """Per stacked weight its saved affine map (``{}`` when none was saved), structure only."""
    if value is None:
        return {}
    maps = fields.mapping(value, where, path, budget)
    if type(maps.get("version")) is not int or maps["version"] != _VERSION:
        raise fields.field_error(path, f"{where}['version']", f"is {quoted(maps.get('version'))}, expected {_VERSION}")
    params = fields.mapping(maps.get("params"), f"{where}['params']", path, budget)
    expected = {f"{prefix}.{weight}" for weight in EXPERT_WEIGHTS}
    if set(params) != expected:
        raise fields.field_error(
            path, f"{where}['params']", f"holds {quoted(sorted(params))}, expected {sorted(expected)}"
        )
    return {
        name: fields.mapping(params[name], f"{where}['params'][{quoted(name)}]", path, budget)
        for name in sorted(expected)
    }


def check_affine_maps(
    layer: AutoEPLayer, local_shapes: dict[str, tuple[int, ...]], path: Path, budget: Budget | None
) -> None:
    """Every saved affine map must say what the placement says: local expert ``l`` of EP rank
    ``r`` is global expert ``placement[r][l]``, rows laid out row-major, each piece on its own
    rank. ``local_shapes``: the stacked weights' shapes (``param_shapes``). Every list is
    counted before it is copied (a shape has the weight's dimensions, a rank map at most one
    piece per expert), and what is copied is charged to the model-states file's ``budget``."""
    for name, saved in layer.affine_maps.items():
        where = f"{LAYERS_KEY}[{layer.moe_layer_id}]['affine_maps']['params'][{quoted(name)}]"
        local = local_shapes[name]
        logical = (layer.num_experts, *local[1:])
        found = saved.get("logical_shape")
        if _exactly(found, len(logical), f"{where}['logical_shape']", path) != logical:
            raise fields.field_error(path, f"{where}['logical_shape']", f"is {quoted(found)}, expected {list(logical)}")
        ranks = saved.get("ranks")
        if not isinstance(ranks, dict):
            ranks = fields.optional_dict(ranks, f"{where}['ranks']", path)
        if len(ranks) != layer.ep_size or not all(rank in ranks for rank in range(layer.ep_size)):
            shown = ", ".join(sorted(quoted(key) for key in itertools.islice(ranks, 4)))
            raise fields.field_error(
                path,
                f"{where}['ranks']",
                f"has keys {shown}{', ...' if len(ranks) > 4 else ''}, expected EP ranks 0..{layer.ep_size - 1}",
            )
        for rank, experts in enumerate(layer.placement):
            _check_rank_map(ranks[rank], (rank, experts), logical, f"{where}['ranks'][{rank}]", path, budget)


def _check_rank_map(
    value: Any,
    held: tuple[int, tuple[int, ...]],
    logical: tuple[int, ...],
    where: str,
    path: Path,
    budget: Budget | None,
) -> None:
    """The map of EP rank ``held[0]``, which holds global experts ``held[1]`` in local order."""
    rank, experts = held
    entry = fields.mapping(value, where, path, budget)
    shard = (len(experts), *logical[1:])
    found = entry.get("shard_shape")
    if _exactly(found, len(shard), f"{where}['shard_shape']", path) != shard:
        raise fields.field_error(path, f"{where}['shard_shape']", f"is {quoted(found)}, expected {list(shard)}")
    per_expert = math.prod(logical[1:])
    listed = entry.get("pieces")
    if isinstance(listed, (list, tuple)) and len(listed) > len(experts):  # each piece maps one expert or more
        words = f"lists {len(listed):,} pieces, more than EP rank {rank}'s {len(experts)} experts"
        raise fields.field_error(path, f"{where}['pieces']", words)
    covered = bytearray(len(experts))
    for index, item in enumerate(fields.sequence(listed, f"{where}['pieces']", path, budget)):
        label = f"{where}['pieces'][{index}]"
        piece = fields.mapping(item, label, path, budget)
        shape = _exactly(piece.get("shape"), len(logical), f"{label}['shape']", path)
        source = _offset_and_strides(piece.get("source"), len(logical), f"{label}['source']", path)
        dest = _offset_and_strides(piece.get("dest"), len(logical), f"{label}['dest']", path)
        locations = _exactly(piece.get("locations"), 1, f"{label}['locations']", path)
        ok = (
            shape is not None and shape[0] >= 1 and shape[1:] == logical[1:]
            and source[1] == _row_major(logical) and dest[1] == _row_major(shard) and locations == (rank,)
            and per_expert > 0 and source[0] % per_expert == 0 and dest[0] % per_expert == 0
        )  # fmt: skip
        first_local, first_global = (dest[0] // per_expert, source[0] // per_expert) if ok else (0, 0)
        count = shape[0] if ok and shape is not None else 0
        if not ok or first_local + count > len(experts) or any(
            experts[first_local + k] != first_global + k for k in range(count)
        ):  # the count is bounded by the experts before a range of it is walked
            raise fields.field_error(
                path, label, f"does not map EP rank {rank}'s experts {quoted(list(experts))} as the placement does"
            )
        for local in range(first_local, first_local + count):
            if covered[local]:
                words = f"cover local expert {local} twice, expected 0..{len(experts) - 1} once each"
                raise fields.field_error(path, f"{where}['pieces']", words)
            covered[local] = 1
    if not all(covered):
        words = f"cover no local expert {covered.index(0)}, expected 0..{len(experts) - 1} once each"
        raise fields.field_error(path, f"{where}['pieces']", words)


def _exactly(value: Any, count: int, where: str, path: Path) -> tuple[int, ...] | None:
    """``value`` as ``count`` non-negative integers; None, without a copy, for a list or tuple
    of another length (the caller says what was expected)."""
    if isinstance(value, (list, tuple)) and len(value) != count:
        return None
    return tuple(fields.integers(value, where, path))


def _offset_and_strides(value: Any, dims: int, where: str, path: Path) -> tuple[int, tuple[int, ...] | None]:
    """``[offset, strides]``: strides None where there are not ``dims`` of them."""
    if isinstance(value, (list, tuple)) and len(value) != 2:
        raise fields.field_error(path, where, f"has {len(value):,} items, expected [offset, strides]")
    pair = fields.sequence(value, where, path)
    return fields.integer(pair[0], f"{where}[0]", path), _exactly(pair[1], dims, f"{where}[1]", path)


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def _check_config(ds_config: dict[str, Any], ep_size: int, path: Path) -> str | None:
    """The ``expert_parallel`` section must be the one the metadata came from; topologies the
    reader does not map (data before expert parallelism, expert tensor parallelism) are refused."""
    section = fields.optional_mapping(ds_config.get("expert_parallel"), "ds_config['expert_parallel']", path)
    where = "ds_config['expert_parallel']"
    if section.get("enabled") is not True:
        raise fields.field_error(
            path, f"{where}['enabled']", f"is {quoted(section.get('enabled'))}, but the file holds {LAYERS_KEY}"
        )
    if section.get("autoep_size", 1) != ep_size:
        raise fields.field_error(
            path, f"{where}['autoep_size']", f"is {quoted(section.get('autoep_size'))}, {LAYERS_KEY} gives EP {ep_size}"
        )
    if section.get("expert_tensor_parallel_size", 1) != 1:
        raise fields.field_error(
            path, f"{where}['expert_tensor_parallel_size']", "is not 1: expert tensor parallelism is not supported"
        )
    if ds_config.get("use_data_before_expert_parallelism", False) is not False:
        raise fields.field_error(
            path,
            "ds_config['use_data_before_expert_parallelism']",
            "is set: that rank order of expert groups is not supported",
        )
    return fields.optional_text(section.get("preset_model"), f"{where}['preset_model']", path)
