"""``zeroshard demo``: train TinyGPT with ZeRO on D local ranks (or under torchrun)."""

from __future__ import annotations

import argparse
import os

from ..demo import DemoConfig, format_summary, train


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("demo", help="train a small GPT with ZeRO stage 2 on D local ranks")
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=DemoConfig.steps)
    parser.add_argument("--stage", type=int, choices=(1, 2), default=DemoConfig.stage)
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=DemoConfig.dtype)
    parser.add_argument("--micro-batches", type=int, default=DemoConfig.micro_batches)
    parser.add_argument("--batch-size", type=int, default=DemoConfig.batch_size)
    parser.add_argument("--lr", type=float, default=DemoConfig.lr)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with CUDA GPUs, else gloo")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before spawned ranks are stopped")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    config = DemoConfig(
        steps=args.steps,
        stage=args.stage,
        dtype=args.dtype,
        batch_size=args.batch_size,
        micro_batches=args.micro_batches,
        lr=args.lr,
    )
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return _run_under_torchrun(config, args.backend)
    from ..launch import spawn

    print(f"zeroshard demo: spawning {args.world_size} ranks", flush=True)
    summary = spawn(train, args.world_size, (config,), backend=args.backend, timeout_s=args.timeout)[0]
    print(format_summary(summary, config))
    return 0


def _run_under_torchrun(config: DemoConfig, backend: str | None) -> int:
    import torch.distributed as dist

    from ..launch import init_from_env

    init_from_env(backend)
    try:
        summary = train(dist.get_rank(), dist.get_world_size(), config)
        if summary is not None:
            print(format_summary(summary, config))
    finally:
        dist.destroy_process_group()
    return 0
