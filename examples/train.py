"""A complete zeroshard training script, to copy and change (the model, the data, the knobs).

    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/train.py --out runs/example --steps 20
    .venv/bin/torchrun --standalone --nproc_per_node 1 examples/train.py --out runs/example --steps 40

The first command trains steps 0-19 on 2 ranks; the second finds the checkpoint under
``runs/example/checkpoints`` and resumes at step 20 on 1 rank (resharded at load time), with
the optimizer state and the lr schedule where they were. What it shows:

* ZeroOptimizer, ZeRO stage 2, bf16 parameters (inputs are cast to the parameter dtype:
  the engine does not cast them), gradient accumulation, clipping, on CPU (gloo) or one GPU
  per rank (NCCL; the model is moved to ``cuda:LOCAL_RANK`` before the engine is built);
* a torch lr scheduler (warmup, then cosine) stepped after every optimizer step;
* the Checkpointer: an asynchronous save every ``--save-every`` steps and after the last,
  ``load()`` resuming from ``latest`` at any world size (it logs where it resumed from);
* logging on rank 0: the loss averaged over every rank and micro-batch, the lr, the time;
* at the end, rank 0 exports the last checkpoint as an fp32 safetensors state dict
  (``runs/example/model/model.safetensors``) and loads it back into the model class with
  ``strict=True``.

Every rank trains on its own rows of the same global batch per step (``rank_rows``), so the
run continues the same optimisation at any world size.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.checkpoint import Checkpointer
from zeroshard.checkpoint.export.fp32 import to_fp32
from zeroshard.engine import ZeroOptimizer
from zeroshard.launch import init_from_env

log = logging.getLogger("train")

IN_FEATURES, HIDDEN, CLASSES = 32, 100, 10


class MLP(nn.Module):
    """Two layers of width 100 and a LayerNorm: the model to replace with yours."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, CLASSES)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(inputs))))


def global_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s rows of every rank: inputs and the classes a fixed random teacher gives."""
    teacher = torch.randn(IN_FEATURES, CLASSES, generator=torch.Generator().manual_seed(1234))
    inputs = torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(step))
    return inputs, (inputs @ teacher).argmax(dim=1)


def rank_rows(batch: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """This rank's contiguous, equal share of the global batch."""
    share = batch[0].shape[0] // world_size
    return tuple(tensor[rank * share : (rank + 1) * share] for tensor in batch)


def lr_factor(step: int, warmup: int, total: int) -> float:
    """The lr multiplier of optimizer step ``step``: linear warmup, then cosine to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="checkpoints go to OUT/checkpoints, the export to OUT/model"
    )
    parser.add_argument("--steps", type=int, default=20, help="train until this step (resuming first)")
    parser.add_argument("--total-steps", type=int, default=40, help="the length of the lr schedule")
    parser.add_argument("--global-batch", type=int, default=48, help="rows per step over all ranks")
    parser.add_argument("--micro-batches", type=int, default=2, help="backward calls per step on each rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save-every", type=int, default=5)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    init_from_env()  # gloo on CPU, NCCL when CUDA GPUs are there (reads torchrun's RANK, WORLD_SIZE, ...)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    if args.global_batch % (world_size * args.micro_batches):
        raise SystemExit(f"--global-batch {args.global_batch} does not split into {world_size} x {args.micro_batches}")
    device = (
        torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}") if torch.cuda.is_available() else torch.device("cpu")
    )

    torch.manual_seed(0)  # every rank builds the same model (the engine also broadcasts rank 0's)
    model = MLP().to(device)  # on its device before the engine is built
    decay = [p for name, p in model.named_parameters() if name.endswith("weight") and p.dim() > 1]
    no_decay = [p for name, p in model.named_parameters() if not (name.endswith("weight") and p.dim() > 1)]
    engine = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        stage=2,
        param_dtype=torch.bfloat16,
        gradient_accumulation_steps=args.micro_batches,
        max_grad_norm=1.0,
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine, lambda step: lr_factor(step, 5, args.total_steps))
    param_dtype = next(model.parameters()).dtype

    with Checkpointer(engine, args.out / "checkpoints", keep_last=2, lr_scheduler=scheduler) as ckpt:
        start = ckpt.load()  # collective; 0 without a checkpoint; logs where it resumed from
        if ckpt.resumed_from is None:
            log.info("no checkpoint under %s: training from step 0 on %d ranks", ckpt.root, world_size)
        started = time.perf_counter()
        for step in range(start, args.steps):
            inputs, targets = rank_rows(global_batch(step, args.global_batch), rank, world_size)
            total = torch.zeros(1, device=device)
            for micro_inputs, micro_targets in zip(inputs.chunk(args.micro_batches), targets.chunk(args.micro_batches)):
                logits = model(micro_inputs.to(device, param_dtype))  # inputs in the parameter dtype
                loss = nn.functional.cross_entropy(logits.float(), micro_targets.to(device))
                engine.backward(loss)  # divides by the accumulation steps
                total += loss.detach()
            lr = engine.param_groups[0]["lr"]  # the lr this step uses
            engine.step()  # collective
            scheduler.step()
            engine.zero_grad()
            dist.all_reduce(total)  # logging only: the mean loss over every rank and micro-batch
            log.info("step %d loss %.6f lr %.8f", step, total.item() / (world_size * args.micro_batches), lr)
            if (step + 1) % args.save_every == 0 or step == args.steps - 1:
                ckpt.save(step)  # collective; returns once the state is copied to host memory
        last = ckpt.wait()  # the last save's outcome (raises on every rank if it failed)
        log.info(
            "trained steps %d-%d in %.2f s on %d ranks",
            start,
            args.steps - 1,
            time.perf_counter() - started,
            world_size,
        )

    if rank == 0 and last is not None:  # export reads the checkpoint's files: one process is enough
        exported = to_fp32(last.path, args.out / "model", overwrite=True)
        from safetensors.torch import load_file

        MLP().load_state_dict(load_file(str(exported / "model.safetensors")), strict=True)
        log.info("exported %s to %s (fp32; loads into MLP with strict=True)", last.path, exported)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
