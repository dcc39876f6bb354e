"""``zeroshard demo``: the whole arc on local ranks.

Train TinyGPT with ZeRO on D ranks and save a checkpoint; resume it at another world size
D' and train on; convert the last checkpoint to a universal checkpoint and to an fp32
state dict; check the export against the live fp32 masters and load it into the model
class. Each stage prints its time and sizes. Under torchrun only the training phase runs.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
from pathlib import Path

from ..checkpoint.retention import tag_step
from ..demos.dense import LIVE_MASTERS_FILE, DemoConfig, PhaseResult, train_phase
from ..demos.report import convert_timed, memory_lines, size_of
from .arguments import at_least, positive_float, positive_int


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand and its arguments to ``commands``."""
    parser = commands.add_parser("demo", help="train a small GPT with ZeRO, resume at another D, convert")
    parser.add_argument(
        "--world-size",
        type=positive_int,
        default=None,
        help="ranks for the first phase (default 2, with --moe 4; ignored under torchrun)",
    )
    parser.add_argument(
        "--resume-world-size", type=positive_int, default=None, help="ranks for the resumed phase (default 3, --moe 2)"
    )
    parser.add_argument(
        "--steps", type=at_least(2), default=None, help="steps in all, half per phase (default 60, with --moe 40)"
    )
    parser.add_argument("--moe", action="store_true", help="train MoEGPT (8 experts, top-2) with expert parallelism")
    parser.add_argument(
        "--hf",
        action="store_true",
        help="with --moe: the transformers Qwen3-MoE (8 experts, top-2, grouped_mm) instead of MoEGPT; needs transformers",
    )
    parser.add_argument("--ep", type=positive_int, default=2, help="with --moe: expert parallelism of the first phase")
    parser.add_argument(
        "--resume-ep", type=positive_int, default=1, help="with --moe: expert parallelism of the resumed phase"
    )
    parser.add_argument("--stage", type=int, choices=(1, 2), default=DemoConfig.stage)
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=DemoConfig.dtype)
    parser.add_argument("--micro-batches", type=positive_int, default=DemoConfig.micro_batches)
    parser.add_argument("--global-batch", type=positive_int, default=DemoConfig.global_batch)
    parser.add_argument("--lr", type=positive_float, default=DemoConfig.lr)
    parser.add_argument("--out", type=Path, default=None, help="keep checkpoints and exports here (default: a temporary folder)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with CUDA GPUs, else gloo")
    parser.add_argument(
        "--timeout", type=positive_float, default=900.0, help="seconds before spawned ranks are stopped"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``zeroshard demo``: the dense arc (or, with ``--moe``, :func:`~.demo_moe_cmd.run_moe`);
    returns 0. It spawns its own ranks; under torchrun it runs one training phase instead and
    is collective over the torchrun ranks (each calls it).

    Raises:
        ValueError: the options do not fit (``--out`` not a directory, ``--hf`` without
            ``--moe``, a batch that does not split into the ranks and micro-batches, no
            ``--out`` under torchrun), or the fp32 export differs from the live masters.
    """
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    check_out_dir(args.out)
    if not under_torchrun:
        check_no_earlier_checkpoints(args.out)
    if args.hf and not args.moe:
        raise ValueError("--hf trains the transformers MoE model: give --moe too")
    if args.moe:
        from .demo_moe_cmd import run_moe

        return run_moe(args, under_torchrun)
    args.world_size = args.world_size or 2
    args.resume_world_size = args.resume_world_size or 3
    config = DemoConfig(
        steps=args.steps or DemoConfig.steps,
        stage=args.stage,
        dtype=args.dtype,
        global_batch=args.global_batch,
        micro_batches=args.micro_batches,
        lr=args.lr,
    )
    world_sizes = [args.world_size, args.resume_world_size]
    for world_size in [int(os.environ.get("WORLD_SIZE", 1))] if under_torchrun else world_sizes:
        if config.global_batch % (world_size * config.micro_batches):
            raise ValueError(
                f"--global-batch {config.global_batch} does not split into {world_size} ranks x "
                f"{config.micro_batches} micro-batches"
            )
    if under_torchrun:
        return _run_under_torchrun(config, args)
    out = args.out or Path(tempfile.mkdtemp(prefix="zeroshard-demo-"))
    try:
        _run_arc(config, args, out)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    return 0


def check_out_dir(out: Path | None) -> None:
    """``--out`` is a directory, or can be made one: checked before any rank is spawned (a
    rank that found a file there failed with a traceback the command called a bug)."""
    if out is None:
        return
    for place in (out, *out.parents):
        if place.is_dir():
            return
        if place.exists() or place.is_symlink():
            where = "exists and is not a directory" if place == out else f"lies under {place}, which is not a directory"
            raise ValueError(f"--out {out}: {where}")


def check_no_earlier_checkpoints(out: Path | None) -> None:
    """The demo's first phase trains from step 0 into ``--out``'s checkpoints, and a
    Checkpointer never saves over a checkpoint: an ``--out`` holding an earlier run's is
    refused before any rank is spawned (its first save would fail after training)."""
    root = None if out is None else out / "checkpoints"
    earlier = sorted(p.name for p in root.iterdir() if tag_step(p.name) is not None) if root and root.is_dir() else []
    if earlier:
        raise ValueError(
            f"--out {out}: {root} holds an earlier run's checkpoints ({earlier[-1]}, ...); the demo trains from "
            f"step 0 and never saves over a checkpoint: give another --out, or remove {root}"
        )


def _run_arc(config: DemoConfig, args: argparse.Namespace, out: Path) -> None:
    from ..launch import spawn

    first_steps = config.steps // 2
    rows: list[tuple[str, float, str]] = []
    print(f"zeroshard demo: phase 1 on {args.world_size} ranks", flush=True)
    first: PhaseResult = spawn(
        train_phase, args.world_size, (config, str(out), 0, first_steps, False), backend=args.backend, timeout_s=args.timeout
    )[0]
    rows.append((f"train D={first.world_size}, steps 0-{first_steps - 1}", first.train_seconds, _losses(first)))
    rows.append((f"save checkpoint at D={first.world_size}", first.save_seconds, size_of(Path(first.checkpoint))))

    print(f"zeroshard demo: phase 2 resumes on {args.resume_world_size} ranks", flush=True)
    second: PhaseResult = spawn(
        train_phase,
        args.resume_world_size,
        (config, str(out), first_steps, config.steps - first_steps, True),
        backend=args.backend,
        timeout_s=args.timeout,
    )[0]
    print(f"zeroshard demo: resumed at D={second.world_size}: {second.attestation}", flush=True)
    rows.append((f"load it at D={second.world_size} (resharded)", second.load_seconds, ""))
    rows.append((f"train D={second.world_size}, steps {first_steps}-{config.steps - 1}", second.train_seconds, _losses(second)))
    rows.append((f"save checkpoint at D={second.world_size}", second.save_seconds, size_of(Path(second.checkpoint))))
    rows += _convert(Path(second.checkpoint), out)
    print(_format(config, first, second, rows))


def _convert(checkpoint: Path, out: Path) -> list[tuple[str, float, str]]:
    import torch
    from safetensors.torch import load_file

    from ..models import GPTConfig, TinyGPT

    rows, exported = convert_timed(checkpoint, out)
    state = load_file(str(exported / "model.safetensors"))  # what any safetensors user would do
    live = load_file(str(out / LIVE_MASTERS_FILE))
    exact = sum(torch.equal(state[name], tensor) for name, tensor in live.items())
    model = TinyGPT(GPTConfig())
    model.load_state_dict(state, strict=True)
    verdict = f"{exact} of {len(live)} parameters bit-for-bit equal to the live fp32 masters; TinyGPT.load_state_dict(strict=True) ok"
    rows.append(("check the export", 0.0, verdict))
    if exact != len(live):
        raise ValueError(f"the fp32 export differs from the live masters in {len(live) - exact} parameters")
    return rows


def _losses(result: PhaseResult) -> str:
    return f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}"


def _format(config: DemoConfig, first: PhaseResult, second: PhaseResult, rows: list[tuple[str, float, str]]) -> str:
    lines = [
        "",
        f"ZeRO stage {config.stage}, {config.dtype}, {config.steps} steps, global batch {config.global_batch} "
        f"({first.backend}); uniform guess loss {math.log(97):.4f}",
        "",
        f"  {'stage':<44} {'time':>9}  result",
    ]
    lines += [f"  {name:<44} {seconds:>8.2f}s  {detail}" for name, seconds, detail in rows]
    lines += ["", memory_lines(config, first), _padding_line(first), *_alignment_lines(first)]
    return "\n".join(lines)


def _padding_line(result: PhaseResult) -> str:
    padding = result.padding
    elements = padding["inter_param_elements"] + padding["tail_elements"]
    percent = 100 * padding["padding_bytes"] / padding["param_bytes"]
    return f"  padding at D={result.world_size}: {elements:,} elements, {padding['padding_bytes']:,} B = {percent:.3f}% of the parameters"


def _alignment_lines(result: PhaseResult) -> list[str]:
    rows = result.alignment
    aligned = sum(1 for row in rows if row.address_mod_16 == 0)
    misaligned_if_compact = sum(1 for row in rows if row.compact_offset_bytes % 16)
    lines = [
        f"  alignment: {aligned} of {len(rows)} parameters start on a 16-byte boundary "
        f"(a compact layout would misalign {misaligned_if_compact}):"
    ]
    for row in rows:
        note = "  <- misaligned if compact" if row.compact_offset_bytes % 16 else ""
        lines.append(f"    {row.name:<28} {str(list(row.shape)):<12} data_ptr % 16 = {row.address_mod_16}{note}")
    return lines


def _run_under_torchrun(config: DemoConfig, args: argparse.Namespace) -> int:
    """One training phase on the torchrun ranks (resuming from --out when it has a checkpoint)."""
    import torch.distributed as dist

    from ..launch import init_from_env

    if args.out is None:
        raise ValueError("under torchrun, pass --out DIR for the checkpoints")
    init_from_env(args.backend)
    try:
        resume = (args.out / "checkpoints" / "latest").is_file()
        first_step = config.steps // 2 if resume else 0
        result = train_phase(dist.get_rank(), dist.get_world_size(), config, str(args.out), first_step, config.steps // 2, resume)
        if result is not None:
            if resume:
                print(f"zeroshard demo: resumed at D={result.world_size}: {result.attestation}")
            print(f"\nD={result.world_size} ({result.backend}): {_losses(result)}; checkpoint {result.checkpoint}")
            print(memory_lines(config, result))
            print(_padding_line(result))
    finally:
        dist.destroy_process_group()
    return 0
