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
:mod:`.deepspeed` checks it against the layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.io.budget import quoted
from . import deepspeed_fields as fields
from .deepspeed_pickle import DeepSpeedFormatError

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


def parse_autoep(raw: dict[str, Any], ds_config: dict[str, Any], path: Path) -> AutoEP | None:
    """The AutoEP metadata of a model-states file (``raw``, its top-level dict; ``ds_config``
    already checked as plain data), or None for a run without AutoEP."""
    if raw.get(_LEGACY_LAYERS_KEY) is not None and raw.get(LAYERS_KEY) is None:
        raise DeepSpeedFormatError(
            f"{path}: {_LEGACY_LAYERS_KEY}: AutoEP metadata of an older DeepSpeed is not supported"
        )
    value = raw.get(LAYERS_KEY)
    if value is None:
        return None
    entries = fields.sequence(value, LAYERS_KEY, path)
    if not entries:
        raise fields.field_error(path, LAYERS_KEY, "is empty")
    layers = tuple(_layer(entry, f"{LAYERS_KEY}[{index}]", path) for index, entry in enumerate(entries))
    for what, values in (
        ("moe_layer_id", [layer.moe_layer_id for layer in layers]),
        ("module_path", [layer.module_path for layer in layers]),
    ):
        ordered = sorted(values)  # not a set: ints a file chose may share a hash, and a set compares them all
        if any(first == second for first, second in zip(ordered, ordered[1:])):
            twice = next(first for first, second in zip(ordered, ordered[1:]) if first == second)
            raise fields.field_error(path, LAYERS_KEY, f"names {what} {quoted(twice)} twice")
    ep_size = layers[0].ep_size
    other = next((layer.ep_size for layer in layers if layer.ep_size != ep_size), None)
    if other is not None:
        raise fields.field_error(path, LAYERS_KEY, f"mixes expert-parallel sizes {quoted(ep_size)} and {quoted(other)}")
    counts = raw.get("num_experts")
    if counts is not None and fields.integers(counts, "num_experts", path) != [layer.num_experts for layer in layers]:
        raise fields.field_error(
            path, "num_experts", f"is {counts}, {LAYERS_KEY} gives {[layer.num_experts for layer in layers]}"
        )
    return AutoEP(layers, ep_size, _check_config(ds_config, ep_size, path))


def _layer(value: Any, where: str, path: Path) -> AutoEPLayer:
    entry = fields.mapping(value, where, path)

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
        raise wrong("num_local_experts", f"is {local}: {ep_size} EP ranks x {local} is not {num_experts} experts")
    module_path, prefix = text("module_path"), text("expert_key_prefix")
    if not prefix.startswith(module_path + "."):
        raise wrong("expert_key_prefix", f"{quoted(prefix)} is not inside module {quoted(module_path)}")
    placement = _placement(entry.get("expert_placement"), num_experts, ep_size, f"{where}['expert_placement']", path)
    if text("ep_group_name") != f"ep_size_{ep_size}":
        raise wrong("ep_group_name", f"is {quoted(entry['ep_group_name'])}, expected 'ep_size_{ep_size}'")
    for key in ("ep_rank", "expert_data_parallel_rank"):  # rank 0 writes the file
        if integer(key) != 0:
            raise wrong(key, f"is {entry[key]}, expected 0 (the model-states file is rank 0's)")
    first = placement[0]
    start, end = integer("global_expert_start"), integer("global_expert_end")
    if list(first) == list(range(first[0], first[0] + len(first))) and (start, end) != (first[0], first[-1] + 1):
        raise wrong(
            "global_expert_start", f"and global_expert_end are [{start}, {end}), EP rank 0 holds experts {list(first)}"
        )
    maps = _affine_maps(entry.get("affine_maps"), prefix, f"{where}['affine_maps']", path)
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


def _placement(value: Any, num_experts: int, ep_size: int, where: str, path: Path) -> tuple[tuple[int, ...], ...]:
    """Global expert ids per EP rank, every expert on exactly one EP rank, E / EP on each.
    Files without a descriptor (older DeepSpeed releases) are refused: the ids would come from
    ``num_experts`` alone, a number a file could make as big as it likes."""
    if value is None:
        raise fields.field_error(path, where, "is missing (AutoEP metadata of an older DeepSpeed is not supported)")
    descriptor = fields.mapping(value, where, path)
    for key, expected in (("version", _VERSION), ("num_experts", num_experts), ("ep_size", ep_size)):
        found = descriptor.get(key)
        if type(found) is not int or found != expected:
            raise fields.field_error(path, f"{where}[{quoted(key)}]", f"is {quoted(found)}, expected {expected}")
    ranks = fields.sequence(descriptor.get("ranks"), f"{where}['ranks']", path)
    by_rank: dict[int, tuple[int, ...]] = {}
    for index, item in enumerate(ranks):
        label = f"{where}['ranks'][{index}]"
        rank_entry = fields.mapping(item, label, path)
        rank = fields.integer(rank_entry.get("rank"), f"{label}['rank']", path)
        if rank >= ep_size or rank in by_rank:
            raise fields.field_error(path, f"{label}['rank']", f"is {rank}: EP ranks are 0..{ep_size - 1}, each once")
        by_rank[rank] = tuple(fields.integers(rank_entry.get("experts"), f"{label}['experts']", path))
    if len(by_rank) != ep_size:
        raise fields.field_error(path, f"{where}['ranks']", f"lists {len(by_rank)} EP ranks, expected {ep_size}")
    placement = tuple(by_rank[rank] for rank in range(ep_size))
    ids = sorted(expert for experts in placement for expert in experts)
    uneven = any(len(experts) != num_experts // ep_size for experts in placement)
    if len(ids) != num_experts or ids != list(range(num_experts)) or uneven:  # sizes first: num_experts is the file's
        raise fields.field_error(
            path, where, f"places experts {[list(experts) for experts in placement]}: each of 0..{num_experts - 1} "
            f"must be on exactly one EP rank, {num_experts // ep_size} per rank (replicated experts are not read)"
        )  # fmt: skip
    return placement


def _affine_maps(value: Any, prefix: str, where: str, path: Path) -> dict[str, Any]:
    """Per stacked weight its saved affine map (``{}`` when none was saved), structure only."""
    if value is None:
        return {}
    maps = fields.mapping(value, where, path)
    if type(maps.get("version")) is not int or maps["version"] != _VERSION:
        raise fields.field_error(path, f"{where}['version']", f"is {quoted(maps.get('version'))}, expected {_VERSION}")
    params = fields.mapping(maps.get("params"), f"{where}['params']", path)
    expected = {f"{prefix}.{weight}" for weight in EXPERT_WEIGHTS}
    if set(params) != expected:
        raise fields.field_error(
            path, f"{where}['params']", f"holds {quoted(sorted(params))}, expected {sorted(expected)}"
        )
    return {name: fields.mapping(params[name], f"{where}['params'][{quoted(name)}]", path) for name in sorted(expected)}


def check_affine_maps(layer: AutoEPLayer, local_shapes: dict[str, tuple[int, ...]], path: Path) -> None:
    """Every saved affine map must say what the placement says: local expert ``l`` of EP rank
    ``r`` is global expert ``placement[r][l]``, rows laid out row-major, each piece on its own
    rank. ``local_shapes``: the stacked weights' shapes (``param_shapes``)."""
    for name, saved in layer.affine_maps.items():
        where = f"{LAYERS_KEY}[{layer.moe_layer_id}]['affine_maps']['params'][{quoted(name)}]"
        local = local_shapes[name]
        logical = (layer.num_experts, *local[1:])
        if tuple(fields.integers(saved.get("logical_shape"), f"{where}['logical_shape']", path)) != logical:
            raise fields.field_error(
                path, f"{where}['logical_shape']", f"is {saved.get('logical_shape')}, expected {list(logical)}"
            )
        ranks = fields.optional_dict(saved.get("ranks"), f"{where}['ranks']", path)
        if set(ranks) != set(range(layer.ep_size)):
            keys = sorted(map(repr, ranks))
            shown = ", ".join(keys[:4]) + (", ..." if len(keys) > 4 else "")
            raise fields.field_error(
                path, f"{where}['ranks']", f"has keys {shown}, expected EP ranks 0..{layer.ep_size - 1}"
            )
        for rank, experts in enumerate(layer.placement):
            _check_rank_map(ranks[rank], rank, experts, logical, f"{where}['ranks'][{rank}]", path)


def _check_rank_map(
    value: Any, rank: int, experts: tuple[int, ...], logical: tuple[int, ...], where: str, path: Path
) -> None:
    entry = fields.mapping(value, where, path)
    shard = (len(experts), *logical[1:])
    if tuple(fields.integers(entry.get("shard_shape"), f"{where}['shard_shape']", path)) != shard:
        raise fields.field_error(
            path, f"{where}['shard_shape']", f"is {entry.get('shard_shape')}, expected {list(shard)}"
        )
    per_expert = 1
    for dim in logical[1:]:
        per_expert *= dim
    covered: list[int] = []
    for index, item in enumerate(fields.sequence(entry.get("pieces"), f"{where}['pieces']", path)):
        label = f"{where}['pieces'][{index}]"
        piece = fields.mapping(item, label, path)
        shape = fields.integers(piece.get("shape"), f"{label}['shape']", path)
        source = _offset_and_strides(piece.get("source"), f"{label}['source']", path)
        dest = _offset_and_strides(piece.get("dest"), f"{label}['dest']", path)
        locations = fields.integers(piece.get("locations"), f"{label}['locations']", path)
        ok = (
            len(shape) == len(logical) and shape[0] >= 1 and tuple(shape[1:]) == logical[1:]
            and source[1] == _row_major(logical) and dest[1] == _row_major(shard) and locations == [rank]
            and per_expert > 0 and source[0] % per_expert == 0 and dest[0] % per_expert == 0
        )  # fmt: skip
        first_local, first_global = (dest[0] // per_expert, source[0] // per_expert) if per_expert else (0, 0)
        runs = [(first_local + k, first_global + k) for k in range(shape[0])] if ok else []
        if not ok or any(local >= len(experts) or experts[local] != expert for local, expert in runs):
            raise fields.field_error(
                path, label, f"does not map EP rank {rank}'s experts {list(experts)} as the placement does"
            )
        covered += [local for local, _ in runs]
    if sorted(covered) != list(range(len(experts))):
        raise fields.field_error(
            path,
            f"{where}['pieces']",
            f"cover local experts {sorted(covered)}, expected 0..{len(experts) - 1} once each",
        )


def _offset_and_strides(value: Any, where: str, path: Path) -> tuple[int, tuple[int, ...]]:
    pair = fields.sequence(value, where, path)
    if len(pair) != 2:
        raise fields.field_error(path, where, f"has {len(pair)} items, expected [offset, strides]")
    return fields.integer(pair[0], f"{where}[0]", path), tuple(fields.integers(pair[1], f"{where}[1]", path))


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
