"""``zeroshard demo --moe``: MoEGPT with expert parallelism on local ranks.

Train MoEGPT (8 experts, top-2) with ZeRO at W ranks and expert parallelism EP, printing
the alignment of every expert view next to the ``torch._grouped_mm`` call that read it.
"""

from __future__ import annotations

import argparse
import math

from ..demo_moe import GroupedMMCall, MoEDemoConfig, MoEPhaseResult, moe_train_phase
from ..layout import ExpertMesh, Layout
from .demo_cmd import memory_lines
from .expert_report import format_ids, shard_group_lines


def run_moe(args: argparse.Namespace) -> int:
    config = MoEDemoConfig(
        steps=args.steps or MoEDemoConfig.steps,
        stage=args.stage,
        dtype=args.dtype,
        global_batch=args.global_batch,
        lr=args.lr,
    )
    world_size = args.world_size or 4
    _check_phase(config, world_size, args.ep, "--world-size", "--ep")
    if args.micro_batches != 1:
        raise ValueError("--moe trains one micro-batch per step; leave --micro-batches at 1")
    _run_arc(config, args, world_size)
    return 0


def _check_phase(config: MoEDemoConfig, world_size: int, ep: int, world_flag: str, ep_flag: str) -> None:
    """Refuse a (W, EP) the run cannot use, before any rank is spawned."""
    if world_size % ep:
        raise ValueError(f"{ep_flag} {ep} does not divide {world_flag} {world_size}")
    if config.model.num_experts % ep:
        raise ValueError(f"{ep_flag} {ep} does not divide the model's {config.model.num_experts} experts")
    if config.global_batch % world_size:
        raise ValueError(f"--global-batch {config.global_batch} does not split into {world_size} ranks")


def _run_arc(config: MoEDemoConfig, args: argparse.Namespace, world_size: int) -> None:
    from ..launch import spawn

    print(f"zeroshard demo --moe: training on {world_size} ranks, EP={args.ep}", flush=True)
    first: MoEPhaseResult = spawn(
        moe_train_phase,
        world_size,
        (config, args.ep, 0, config.steps),
        backend=args.backend,
        timeout_s=args.timeout,
    )[0]
    rows = [(f"train W={first.world_size} EP={first.ep_size}, steps 0-{config.steps - 1}", first.train_seconds, _losses(first))]
    print(_format(config, first, rows))


def _losses(result: MoEPhaseResult) -> str:
    return f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}"


def _format(config: MoEDemoConfig, first: MoEPhaseResult, rows: list[tuple[str, float, str]]) -> str:
    model = config.model
    lines = [
        "",
        f"MoEGPT: {model.num_experts} experts, top-{model.top_k}, {model.n_layer} layers, width {model.n_embd}, "
        f"expert hidden {model.expert_hidden}; ZeRO stage {config.stage}, {config.dtype}, {config.steps} steps, "
        f"global batch {config.global_batch} ({first.backend}); uniform guess loss {math.log(model.vocab_size):.4f}",
        "",
        f"  {'stage':<44} {'time':>9}  result",
    ]
    lines += [f"  {name:<44} {seconds:>8.2f}s  {detail}" for name, seconds, detail in rows]
    lines += ["", *_phase_lines(config, first)]
    return "\n".join(lines)


def _phase_lines(config: MoEDemoConfig, result: MoEPhaseResult) -> list[str]:
    layout = Layout.from_dict(result.layout)
    lines = [f"  at W={result.world_size}, EP={result.ep_size}:", *shard_group_lines(layout, indent="    ")]
    lines.append(memory_lines(config, result))
    return lines + grouped_mm_lines(result)


def grouped_mm_lines(result: MoEPhaseResult) -> list[str]:
    """Every grouped GEMM of the phase's first step on every rank, with the alignment of the
    stacked weight it read and of each expert's matrix in it."""
    calls = result.calls
    aligned = sum(1 for call in calls if call.aligned and call.in_flat_buffer)
    views = sum(1 + len(call.expert_ids) for call in calls)
    kept = "the same addresses at the phase's last step" if result.storage_kept else "OTHER addresses at the last step"
    lines = [
        f"  grouped_mm calls at step {result.first_step} (every rank): {aligned} of {len(calls)} read 16-byte aligned "
        f"views of the flat buffer ({views} views: stacked weights and each expert in them, shown as "
        f"expert id:data_ptr % 16); {kept}:"
    ]
    mesh = ExpertMesh(result.world_size, result.ep_size)
    for rank in sorted({call.rank for call in calls}):
        mine = [call for call in calls if call.rank == rank]
        lines.append(f"    rank {rank} (EP rank {mesh.ep_rank(rank)}, experts {format_ids(mine[0].expert_ids)}):")
        lines += [f"      {_call_line(call)}" for call in mine]
    return lines


def _call_line(call: GroupedMMCall) -> str:
    experts = " ".join(f"{expert}:{mod}" for expert, mod in zip(call.expert_ids, call.expert_mod_16))
    where = "" if call.in_flat_buffer else "  NOT a view of the flat buffer"
    return (
        f"call {call.index}  {call.param or '?':<24} {str(list(call.shape)):<12} {call.dtype:<8} "
        f"data_ptr % 16 = {call.weight_mod_16}; experts {experts}; "
        f"row stride {call.row_stride_bytes} B{where}"
    )

