"""``zeroshard demo --moe [--hf]``: MoEGPT, or the transformers Qwen3-MoE, with expert
parallelism on local ranks.

Train the model (8 experts, top-2) with ZeRO at W ranks and expert parallelism EP, printing
the alignment of every expert view next to the ``torch._grouped_mm`` call that read it and
the check of every call (and its weight's gradient) against CUDA's grouped GEMM rules.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..demos.report import convert_timed, memory_lines, size_of
from ..demos.moe import LIVE_STATE_FILE, CheckpointPlan, MoEDemoConfig, MoEPhaseResult, moe_train_phase
from ..layout import ExpertMesh, Layout
from ..moe.recorder import GroupedMMCall
from .expert_report import format_ids, shard_group_lines

HF_MODEL_MODULE = "transformers.models.qwen3_moe.modeling_qwen3_moe"  # what --hf's ranks build the model from


def run_moe(args: argparse.Namespace, under_torchrun: bool = False) -> int:
    """``zeroshard demo --moe``: train at (W, EP), resume at the other (W, EP), convert and
    check the export; returns 0. It spawns its own ranks; ``under_torchrun``, it runs one
    phase instead and is collective over the torchrun ranks (each calls it).

    Raises:
        ValueError: EP does not divide the world size or the experts, the batch does not split
            into the ranks, ``--micro-batches`` is not 1, ``--hf`` without transformers, no
            ``--out`` under torchrun, or the fp32 export differs from the live state.
    """
    config = MoEDemoConfig(
        steps=args.steps or MoEDemoConfig.steps,
        stage=args.stage,
        dtype=args.dtype,
        global_batch=args.global_batch,
        lr=args.lr,
        hf=args.hf,
    )
    if args.hf:
        _need_transformers()
    if args.micro_batches != 1:
        raise ValueError("--moe trains one micro-batch per step; leave --micro-batches at 1")
    if under_torchrun:
        torchrun_phase = Phase(int(os.environ.get("WORLD_SIZE", 1)), args.ep)
        _check_phase(config, torchrun_phase, "the torchrun world size", "--ep")
        return _run_under_torchrun(config, args, torchrun_phase)
    phases = (Phase(args.world_size or 4, args.ep), Phase(args.resume_world_size or 2, args.resume_ep))
    _check_phase(config, phases[0], "--world-size", "--ep")
    _check_phase(config, phases[1], "--resume-world-size", "--resume-ep")
    out = args.out or Path(tempfile.mkdtemp(prefix="zeroshard-demo-moe-"))
    try:
        _run_arc(config, args, phases, out)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    return 0


@dataclass(frozen=True)
class Phase:
    """One phase's world size (W) and expert parallelism (EP); prints as ``W=4 EP=2``."""

    world_size: int
    ep_size: int

    def __str__(self) -> str:
        return f"W={self.world_size} EP={self.ep_size}"


def _check_phase(config: MoEDemoConfig, phase: Phase, world_flag: str, ep_flag: str) -> None:
    """Refuse a (W, EP) the run cannot use, before any rank is spawned."""
    if phase.world_size % phase.ep_size:
        raise ValueError(f"{ep_flag} {phase.ep_size} does not divide {world_flag} {phase.world_size}")
    if config.num_experts % phase.ep_size:
        raise ValueError(f"{ep_flag} {phase.ep_size} does not divide the model's {config.num_experts} experts")
    if config.global_batch % phase.world_size:
        raise ValueError(f"--global-batch {config.global_batch} does not split into {phase.world_size} ranks")


def _need_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError("--hf needs transformers (pip install -e '.[hf]')") from None


def _preload_hf_model() -> None:
    """Every rank builds the transformers model: its module imported once, in the forkserver
    the ranks fork from. A process that spawned ranks before (a caller running demos in a
    row) keeps its forkserver, and the ranks import the module themselves."""
    from ..launch import preload

    try:
        preload(HF_MODEL_MODULE)
    except RuntimeError:
        pass


def _run_arc(config: MoEDemoConfig, args: argparse.Namespace, phases: tuple[Phase, Phase], out: Path) -> None:
    """Phase 1 trains every step and saves halfway; phase 2 resumes that checkpoint at the
    other (W, EP) and trains the second half again, so its losses can be held against the
    uninterrupted run's."""
    from ..launch import spawn

    if config.hf:
        _preload_hf_model()
    first_phase, second_phase = phases
    half, last = config.steps // 2, config.steps - 1

    def run(phase: Phase, first_step: int, plan: CheckpointPlan) -> MoEPhaseResult:
        steps = config.steps - first_step
        arguments = (config, phase.ep_size, first_step, steps, plan)
        return spawn(moe_train_phase, phase.world_size, arguments, backend=args.backend, timeout_s=args.timeout)[0]

    demo = "zeroshard demo --moe --hf" if config.hf else "zeroshard demo --moe"
    print(f"{demo}: phase 1 on {first_phase}, steps 0-{last}, saving after step {half - 1}", flush=True)
    first = run(first_phase, 0, CheckpointPlan(str(out), resume=False, save_after=half - 1))
    print(f"{demo}: phase 2 resumes that checkpoint on {second_phase}, steps {half}-{last}", flush=True)
    second = run(second_phase, half, CheckpointPlan(str(out), resume=True, save_after=last, live_state=True))
    print(f"{demo}: resumed at {second_phase}: {second.attestation}", flush=True)
    rows = [
        (f"train {first_phase}, steps 0-{last}", first.train_seconds, _losses(first)),
        _save_row(f"save after step {half - 1} at {first_phase}", first),
        (f"load it at {second_phase} (resharded)", second.load_seconds, ""),
        (f"train {second_phase}, steps {half}-{last}", second.train_seconds, _losses(second)),
        _save_row(f"save after step {last} at {second_phase}", second),
        *_convert(Path(second.checkpoint), out, config),
    ]
    print(_format(config, first, second, rows))


def _convert(checkpoint: Path, out: Path, config: MoEDemoConfig) -> list[tuple[str, float, str]]:
    """To universal, then fp32; the export against the live masters, and loaded into the model
    holding every expert: MoEGPT (EP = 1) with strict=True, or the transformers model with
    ``from_pretrained`` (no missing, unexpected or mismatched key)."""
    import torch
    from safetensors.torch import load_file

    rows, exported = convert_timed(checkpoint, out)
    state = load_file(str(exported / "model.safetensors"))
    live = load_file(str(out / LIVE_STATE_FILE))  # every parameter, experts by global id
    exact = sum(name in state and torch.equal(state[name], tensor) for name, tensor in live.items())
    if config.hf:
        from ..demos.hf import from_pretrained_check

        loaded, total = from_pretrained_check(exported, live)
        stacks = sum(".experts." in name for name in state)
        verdict = (
            f"{exact} of {len(live)} tensors ({stacks} expert stacks [E, ...] under their own names) bit-for-bit equal "
            f"to the live fp32 masters; Qwen3MoeForCausalLM.from_pretrained: no missing or unexpected keys, "
            f"{loaded} of {total} parameters equal to the live masters"
        )
        exact = min(exact, loaded)
    else:
        from ..moe import MoEGPT

        experts = sum(".moe.experts." in name for name in state)
        MoEGPT(config.model).load_state_dict(state, strict=True)
        verdict = (
            f"{exact} of {len(live)} tensors ({experts} per-expert weights) bit-for-bit equal to the live fp32 masters; "
            "MoEGPT(EP=1).load_state_dict(strict=True) ok"
        )
    rows.append(("check the export", 0.0, verdict))
    if exact != len(live):
        raise ValueError(f"the fp32 export differs from the live masters in {len(live) - exact} tensors")
    return rows


def _run_under_torchrun(config: MoEDemoConfig, args: argparse.Namespace, phase: Phase) -> int:
    """One phase on the torchrun ranks: the first half of the steps, or, when --out has a
    checkpoint, the second half resumed from it (at this run's W and --ep); saves at its end."""
    import torch.distributed as dist

    from ..launch import init_from_env

    if args.out is None:
        raise ValueError("under torchrun, pass --out DIR for the checkpoints")
    init_from_env(args.backend)
    try:
        resume = (args.out / "checkpoints" / "latest").is_file()
        first_step = config.steps // 2 if resume else 0
        steps = config.steps - first_step if resume else config.steps // 2
        plan = CheckpointPlan(str(args.out), resume=resume, save_after=first_step + steps - 1)
        result = moe_train_phase(dist.get_rank(), dist.get_world_size(), config, phase.ep_size, first_step, steps, plan)
        if result is not None:
            resumed = f"resumed from step {first_step - 1}'s checkpoint, " if resume else ""
            if resume:
                print(f"zeroshard demo --moe: resumed at {phase}: {result.attestation}")
            print(
                f"\n{phase} ({result.backend}): {resumed}steps {first_step}-{first_step + steps - 1}, {_losses(result)}"
            )
            print(f"  checkpoint {result.checkpoint}")
            print("\n".join(_phase_lines(config, result)))
    finally:
        dist.destroy_process_group()
    return 0


def _save_row(name: str, result: MoEPhaseResult) -> tuple[str, float, str]:
    """The background write time; the stall it cost training and the checkpoint's size."""
    save = result.save
    assert save is not None and save.write_s is not None  # waited for by the phase
    detail = f"{size_of(Path(result.checkpoint))}; training stalled {1e3 * save.stall_s:.1f} ms"
    return name, save.write_s, detail


def _losses(result: MoEPhaseResult) -> str:
    return f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}"


def _format(
    config: MoEDemoConfig, first: MoEPhaseResult, second: MoEPhaseResult, rows: list[tuple[str, float, str]]
) -> str:
    lines = [
        "",
        f"{_model_line(config)}; ZeRO stage {config.stage}, {config.dtype}, {config.steps} steps, "
        f"global batch {config.global_batch} ({first.backend}); uniform guess loss {math.log(config.model.vocab_size):.4f}",
        "",
        f"  {'stage':<44} {'time':>9}  result",
    ]
    lines += [f"  {name:<44} {seconds:>8.2f}s  {detail}" for name, seconds, detail in rows]
    lines += ["", *continuation_lines(first, second)]
    for result in (first, second):
        lines += ["", *_phase_lines(config, result)]
    return "\n".join(lines)


def _model_line(config: MoEDemoConfig) -> str:
    if config.hf:
        from ..demos.hf import HF_MODEL as hf

        return (
            f"transformers Qwen3MoeForCausalLM (unmodified, experts_implementation={hf['experts_implementation']!r}, "
            f"made expert-parallel by zeroshard.moe.expert_parallel): {hf['num_experts']} experts, "
            f"top-{hf['num_experts_per_tok']}, {hf['num_hidden_layers']} layers, hidden {hf['hidden_size']}, "
            f"head_dim {hf['head_dim']}, expert intermediate {hf['moe_intermediate_size']}"
        )
    model = config.model
    return (
        f"MoEGPT: {model.num_experts} experts, top-{model.top_k}, {model.n_layer} layers, width {model.n_embd}, "
        f"expert hidden {model.expert_hidden}"
    )


def continuation_lines(uninterrupted: MoEPhaseResult, resumed: MoEPhaseResult) -> list[str]:
    """The resumed run's losses next to the uninterrupted run's, step by step."""
    offset = resumed.first_step - uninterrupted.first_step
    pairs = list(zip(uninterrupted.losses[offset:], resumed.losses))
    worst = max(abs(a - b) for a, b in pairs)
    lines = [
        f"  loss continuation: resumed at W={resumed.world_size} EP={resumed.ep_size} from step {resumed.first_step - 1}'s "
        f"checkpoint of the W={uninterrupted.world_size} EP={uninterrupted.ep_size} run, which trained on; "
        f"max |difference| over {len(pairs)} steps = {worst:.2e}",
        f"    {'step':>6} {'uninterrupted':>14} {'resumed':>10} {'|difference|':>13}",
    ]
    rows = [(resumed.first_step + index, a, b) for index, (a, b) in enumerate(pairs)]
    shown = rows if len(rows) <= 6 else [*rows[:3], None, *rows[-2:]]
    for row in shown:
        if row is None:
            lines.append(f"    {'...':>6}")
        else:
            step, a, b = row
            lines.append(f"    {step:>6} {a:>14.6f} {b:>10.6f} {abs(a - b):>13.2e}")
    return lines


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
    lines.insert(0, rule_check_line(result))
    lines += [f"    BROKEN: {problem}" for problem in result.problems]
    for rank in sorted({call.rank for call in calls}):
        mine = [call for call in calls if call.rank == rank]
        lines.append(f"    rank {rank} (EP rank {mesh.ep_rank(rank)}, experts {format_ids(mine[0].expert_ids)}):")
        lines += [f"      {_call_line(call)}" for call in mine]
    return lines


def rule_check_line(result: MoEPhaseResult) -> str:
    """The verdict of the grouped_mm rule check over every call of the phase on every rank."""
    verdict = "every one meets them" if not result.problems else f"{len(result.problems)} rules BROKEN (listed below)"
    return (
        f"  grouped_mm rule check (CUDA's: data_ptr % 16 == 0 for the weight and each expert's matrix, 16-byte leading "
        f"stride; the CPU kernel checks none): {result.checked_calls} calls on every step of every rank, and the "
        f"{result.checked_gradients} gradients backward computed for their weights: {verdict}"
    )


def _call_line(call: GroupedMMCall) -> str:
    ids = call.expert_ids or tuple(f"local {index}" for index in range(len(call.expert_mod_16)))  # unknown weight
    experts = " ".join(f"{expert}:{mod}" for expert, mod in zip(ids, call.expert_mod_16))
    where = "" if call.in_flat_buffer else "  NOT a view of the flat buffer"
    rules = "rules ok" if call.aligned else "rules BROKEN: " + ", ".join(call.problems)
    return (
        f"call {call.index}  {call.param or '?':<24} {str(list(call.shape)):<12} {call.dtype:<8} "
        f"data_ptr % 16 = {call.weight_mod_16}; experts {experts}; "
        f"row stride {call.row_stride_bytes} B; {rules}{where}"
    )
