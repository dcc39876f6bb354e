"""``zeroshard layout``: where the padding goes, per group and world size."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..checkpoint.io import jsonvalue
from ..layout import Layout, LayoutPolicy, ParamSpec, build_layout, itemsize
from .arguments import positive_int

POLICIES = {
    "native": lambda args: LayoutPolicy.native(args.alignment, bucket_numel=args.bucket_numel),
    "compact": lambda args: LayoutPolicy.native(args.alignment, compact=True, bucket_numel=args.bucket_numel),
    "deepspeed": lambda args: LayoutPolicy.deepspeed(),
    "deepspeed-aligned": lambda args: LayoutPolicy.deepspeed(parameter_alignment=True),
}


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("layout", help="report the flat-buffer layout and its padding")
    parser.add_argument(
        "--model",
        type=Path,
        help="JSON file: a list of shapes (one group), or {'groups': [[shape, ...], ...]}; default: the demo model",
    )
    parser.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    parser.add_argument("--world-size", type=positive_int, nargs="+", default=[2, 8, 768], metavar="D")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="native")
    parser.add_argument("--alignment", type=positive_int, default=16, help="alignment in bytes for native/compact")
    parser.add_argument("--bucket-numel", type=positive_int, default=None)
    parser.add_argument("--json", action="store_true", help="print the Layout itself (first world size)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    groups, title = _load_groups(args.model, args.dtype)
    policy = POLICIES[args.policy](args)
    layouts = [build_layout(groups, world, policy) for world in args.world_size]
    if args.json:
        print(layouts[0].to_json(indent=2))
        return 0
    print(f"{title}: {sum(len(g) for g in groups)} parameters in {len(groups)} group(s), policy {policy.describe()}")
    for group_index in range(len(groups)):
        _print_group(layouts, group_index)
    print()
    print("whole model:")
    for layout in layouts:
        stats = layout.padding()
        print(
            f"  D={layout.world_size:<6} padding {stats.padding_elements:>10,} elements "
            f"{stats.padding_bytes:>12,} bytes  {100 * stats.fraction:7.3f}% of {stats.param_bytes:,} parameter bytes"
        )
    return 0


def _print_group(layouts: list[Layout], group_index: int) -> None:
    first = layouts[0].groups[group_index]
    size = itemsize(first.dtype)
    print()
    print(
        f"group {group_index} ({first.dtype}): {len(first.params)} parameters, {first.param_numel:,} elements, "
        f"{len(first.buckets)} bucket(s), padding between parameters {first.inter_param_padding:,} elements"
    )
    print(f"  {'D':>6} {'tail pad':>10} {'partition/rank':>15} {'padding bytes':>14} {'overhead':>9}  ranks with padding")
    for layout in layouts:
        group = layout.groups[group_index]
        padding = group.inter_param_padding + group.tail_padding
        per_rank = group.padding_per_rank()
        padded_ranks = sum(1 for pad in per_rank if pad)
        only_padding = sum(1 for pad in per_rank if pad and pad == group.partition_numel)
        print(
            f"  {layout.world_size:>6} {group.tail_padding:>10,} {group.partition_numel:>15,} "
            f"{padding * size:>14,} {100 * padding / max(group.param_numel, 1):>8.3f}%  "
            f"{padded_ranks} ({only_padding} hold padding only)"
        )



def _load_groups(path: Path | None, dtype: str) -> tuple[list[list[ParamSpec]], str]:
    if path is None:
        return _demo_groups(dtype), "demo model (TinyGPT)"
    try:
        data = jsonvalue.loads(path.read_text(), path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    raw_groups = data["groups"] if isinstance(data, dict) and "groups" in data else [data]
    if not isinstance(raw_groups, list) or not all(isinstance(g, list) for g in raw_groups):
        raise ValueError(f"{path}: expected a list of shapes or {{'groups': [[shape, ...], ...]}}")
    groups = [
        [ParamSpec.of(f"group{g}.param{i}", shape if isinstance(shape, list) else [shape], dtype) for i, shape in enumerate(group)]
        for g, group in enumerate(raw_groups)
    ]
    return groups, str(path)


def _demo_groups(dtype: str) -> list[list[ParamSpec]]:
    import torch

    from ..models import TinyGPT, gpt_param_groups, param_specs

    with torch.device("meta"):
        model = TinyGPT()
    specs = {spec.name: spec for spec in param_specs(model, dtype)}
    decay, no_decay = gpt_param_groups(model)
    return [[specs[name] for name in names if name in specs] for names in (decay, no_decay)]
