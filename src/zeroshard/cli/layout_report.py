"""``zeroshard layout``: where the padding goes, per group and world size."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

from ..io import jsonvalue
from ..io.members import read_small_file
from ..layout import ExpertMesh, GroupSpec, Layout, LayoutPolicy, ParamSpec, build_layout, itemsize
from .arguments import positive_int
from .expert_report import group_partitioning, shard_group_lines

GroupInput = list[ParamSpec] | GroupSpec
_MAX_MODEL_BYTES = 64 << 20  # a --model file: shapes, not a stream (a FIFO is refused, never waited on)

POLICIES = {
    "native": lambda args: LayoutPolicy.native(args.alignment, bucket_numel=args.bucket_numel),
    "compact": lambda args: LayoutPolicy.native(args.alignment, compact=True, bucket_numel=args.bucket_numel),
    "deepspeed": lambda args: LayoutPolicy.deepspeed(),
    "deepspeed-aligned": lambda args: LayoutPolicy.deepspeed(parameter_alignment=True),
}


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``zeroshard layout`` and its options to the subcommands ``commands``."""
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
    parser.add_argument(
        "--moe",
        action="store_true",
        help="the MoE demo model (MoEGPT) with expert parallelism --ep, instead of --model",
    )
    parser.add_argument("--ep", type=positive_int, default=2, help="expert parallelism for --moe (default 2)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the padding report (or, with ``--json``, the Layout) ``args`` ask for; returns 0.

    Raises:
        ValueError: a ``--model`` file that is not UTF-8 JSON of shapes, ``--moe`` with
            ``--model``, an ``--ep`` that divides neither the experts nor a world size, or a
            layout that cannot be built (naming the parameter).
        FileNotFoundError: no ``--model`` file of that name.
    """
    groups_at, title = _model_groups(args)
    policy = POLICIES[args.policy](args)
    layouts = [build_layout(groups_at(world), world, policy) for world in args.world_size]
    if args.json:
        print(layouts[0].to_json(indent=2))
        return 0
    first = layouts[0]
    print(f"{title}: {len(first.param_names)} parameters in {len(first.groups)} group(s), policy {policy.describe()}")
    for group_index in range(len(first.groups)):
        _print_group(layouts, group_index)
    print()
    print("whole model:")
    for layout in layouts:
        stats = layout.padding()
        print(
            f"  D={layout.world_size:<6} padding {stats.padding_elements:>10,} elements "
            f"{stats.padding_bytes:>12,} bytes  {100 * stats.fraction:7.3f}% of {stats.param_bytes:,} parameter bytes"
        )
    _print_shard_groups(layouts)
    return 0


def _print_group(layouts: list[Layout], group_index: int) -> None:
    first = layouts[0].groups[group_index]
    size = itemsize(first.dtype)
    partitioning = group_partitioning(layouts[0], first)
    print()
    print(
        f"group {group_index} ({first.dtype}{', ' + partitioning if partitioning else ''}): "
        f"{len(first.params)} parameters, "
        f"{first.param_numel:,} elements, {len(first.buckets)} bucket(s), padding between parameters "
        f"{first.inter_param_padding:,} elements"
    )
    ranks_column = "" if layouts[0].is_dense else f" {'ranks':>6}"  # the shard group's size
    print(
        f"  {'D':>6}{ranks_column} {'tail pad':>10} {'partition/rank':>15} {'padding bytes':>14} {'overhead':>9}  "
        "ranks with padding"
    )
    for layout in layouts:
        group = layout.groups[group_index]
        padding = group.inter_param_padding + group.tail_padding
        padded_ranks, only_padding = group.padded_rank_counts()  # no loop over the ranks: any D
        ranks = "" if layout.is_dense else f" {group.world_size:>6}"
        print(
            f"  {layout.world_size:>6}{ranks} {group.tail_padding:>10,} {group.partition_numel:>15,} "
            f"{padding * size:>14,} {100 * padding / max(group.param_numel, 1):>8.3f}%  "
            f"{padded_ranks} ({only_padding} hold padding only)"
        )


def _print_shard_groups(layouts: list[Layout]) -> None:
    """Shard groups, EP and the expert map at each world size (nothing for dense layouts)."""
    for layout in layouts:
        lines = shard_group_lines(layout, indent="    ")
        if lines:
            print()
            print(f"  D={layout.world_size}:")
            print("\n".join(lines))


def _model_groups(args: argparse.Namespace) -> tuple[Callable[[int], list[GroupInput]], str]:
    """The model's layout groups at a world size, and what to call the model."""
    if args.moe:
        if args.model is not None:
            raise ValueError("--moe reports the MoE demo model; give either --moe or --model")
        return _moe_demo_groups(args.dtype, args.ep)
    groups, title = _load_groups(args.model, args.dtype)
    return (lambda world: groups), title



def _load_groups(path: Path | None, dtype: str) -> tuple[list[list[ParamSpec]], str]:
    if path is None:
        return _demo_groups(dtype), "demo model (TinyGPT)"
    try:
        data = jsonvalue.loads(read_small_file(path, _MAX_MODEL_BYTES), path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
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


def _moe_demo_groups(dtype: str, ep: int) -> tuple[Callable[[int], list[GroupInput]], str]:
    """The MoE demo model's groups: dense over all ranks, the E / EP experts of one EP rank
    over the W / EP ranks that hold them."""
    import torch

    from ..demos.moe import MOE_MODEL
    from ..moe import MoEGPT, layout_groups

    with torch.device("meta"):
        model = MoEGPT(MOE_MODEL)  # every expert: EP = 1
    dense, all_experts = layout_groups(model, ExpertMesh(1, 1), dtype)
    assert isinstance(all_experts, GroupSpec)
    experts = MOE_MODEL.num_experts
    if experts % ep:
        raise ValueError(f"--ep {ep} does not divide the demo model's {experts} experts")
    local = [ParamSpec(spec.name, (spec.shape[0] // ep, *spec.shape[1:]), spec.dtype) for spec in all_experts.params]

    def groups_at(world_size: int) -> list[GroupInput]:
        if world_size % ep:
            raise ValueError(f"--ep {ep} does not divide --world-size {world_size}")
        return [dense, ExpertMesh(world_size, ep).expert_group(local, experts)]

    title = f"MoE demo model (MoEGPT, {experts} experts, top-{MOE_MODEL.top_k}) at EP={ep}"
    return groups_at, title
