"""What reducing gradients in bf16 costs in accuracy: loss curves, fp32 vs bf16 reduction.

The demo TinyGPT (bf16 parameters, fp32 masters, AdamW, clipping at 1.0) learns the demo's
Markov-chain corpus at D ranks (gloo), two micro-batches per step, with ZeRO stage 1 and
stage 2, each reducing in fp32 (the default) and in bf16 (``reduce_dtype=torch.bfloat16``).
Every run sees the same data. Printed: the mean loss over ranks and micro-batches every
``--every`` steps for each run, and per stage the largest and the mean |loss difference|
between the bf16 and the fp32 reduction, next to the loss's own step-to-step noise.

    .venv/bin/python benchmarks/reduce_dtype_loss.py [--steps 300] [--world-size 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zeroshard.demos.data import batch_seed, markov_chain, sample_batch
from zeroshard.engine import ZeroOptimizer
from zeroshard.launch import spawn
from zeroshard.models import TinyGPT, gpt_param_groups

BATCH, ACCUMULATION, LR, CLIP = 8, 2, 3e-3, 1.0
RUNS = {  # name: (stage, reduce dtype)
    "stage 1 fp32-reduce": (1, torch.float32),
    "stage 1 bf16-reduce": (1, torch.bfloat16),
    "stage 2 fp32-reduce": (2, torch.float32),
    "stage 2 bf16-reduce": (2, torch.bfloat16),
}


def train(rank: int, world_size: int, steps: int) -> dict[str, list[float]]:
    """Every run's per-step loss on this rank (mean over its micro-batches)."""
    curves = {}
    for name, (stage, reduce_dtype) in RUNS.items():
        torch.manual_seed(0)
        model = TinyGPT()
        params = dict(model.named_parameters())
        decay, no_decay = gpt_param_groups(model)
        groups = [
            {"params": [params[n] for n in decay], "weight_decay": 0.1},
            {"params": [params[n] for n in no_decay], "weight_decay": 0.0},
        ]
        engine = ZeroOptimizer(
            model,
            torch.optim.AdamW,
            groups,
            stage=stage,
            param_dtype=torch.bfloat16,
            reduce_dtype=reduce_dtype,
            gradient_accumulation_steps=ACCUMULATION,
            max_grad_norm=CLIP,
            lr=LR,
        )
        chain = markov_chain(model.config.vocab_size)
        losses = []
        for step in range(steps):
            total = 0.0
            for micro in range(ACCUMULATION):
                idx, targets = sample_batch(chain, BATCH, model.config.block_size, batch_seed(step, rank, micro))
                loss = model(idx, targets)
                engine.backward(loss)
                total += float(loss)
            engine.step()
            engine.zero_grad()
            losses.append(total / ACCUMULATION)
        engine.reducer.remove_hooks()
        curves[name] = losses
    return curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--every", type=int, default=25)
    args = parser.parse_args()
    start = time.perf_counter()
    per_rank = spawn(train, args.world_size, (args.steps,), timeout_s=3600)
    curves = {
        name: [statistics.fmean(ranks[name][step] for ranks in per_rank) for step in range(args.steps)] for name in RUNS
    }
    print(
        f"demo TinyGPT, D = {args.world_size}, {ACCUMULATION} micro-batches of {BATCH} per rank and step, bf16 params, "
        f"AdamW lr {LR}, clip {CLIP}; mean loss over ranks and micro-batches"
    )
    print(f"{'step':>6}" + "".join(f"{name:>22}" for name in RUNS))
    for step in [*range(0, args.steps, args.every), args.steps - 1]:
        print(f"{step:>6}" + "".join(f"{curves[name][step]:>22.4f}" for name in RUNS))
    for stage in (1, 2):
        fp32, bf16 = curves[f"stage {stage} fp32-reduce"], curves[f"stage {stage} bf16-reduce"]
        differences = [abs(a - b) for a, b in zip(fp32, bf16)]
        noise = statistics.fmean(abs(a - b) for a, b in zip(fp32[1:], fp32[:-1]))
        tail = max(1, args.steps // 10)
        print(
            f"stage {stage}: |bf16 - fp32 reduce loss| max {max(differences):.4f}, "
            f"mean {statistics.fmean(differences):.4f}; "
            f"last {tail} steps mean loss fp32 {statistics.fmean(fp32[-tail:]):.4f} vs bf16 "
            f"{statistics.fmean(bf16[-tail:]):.4f} (fp32 step-to-step |change| {noise:.4f})"
        )
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
