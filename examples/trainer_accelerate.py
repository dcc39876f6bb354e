"""An Accelerate training script with zeroshard: one call beside ``accelerator.prepare``.

    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/trainer_accelerate.py --out runs/acc --steps 4
    .venv/bin/torchrun --standalone --nproc_per_node 1 examples/trainer_accelerate.py --out runs/acc --steps 8

The first command trains a tiny GPT-2 for 4 steps on 2 ranks (ZeRO-2, bf16 parameters with
fp32 masters from ``mixed_precision="bf16"``), with ``accelerator.save_state`` every 2 steps:
each ``runs/acc/checkpoint-N`` holds Accelerate's files (scheduler, RNG states, the step
counter below) and a zeroshard sharded checkpoint ``zeroshard/`` written by every rank. The
second resumes the newest on 1 rank with ``accelerator.load_state`` (resharded, attested)
and trains to step 8; it prints ``step N loss X`` on rank 0 (X exactly, as ``repr``).

Against a plain Accelerate script the change is one line, after the optimizer is built:

    +model, optimizer = prepare_zeroshard(accelerator, model, optimizer)

Every step sees the same rows at any world size: the global batch (``--global-batch``) is read
in order in micro-batches of ``--micro-batch`` rows, shared out by Accelerate's sampler, and
``gradient_accumulation_steps`` makes up for fewer ranks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tiny_lm, beside this file

import torch  # noqa: E402
from accelerate import Accelerator, PartialState  # noqa: E402
from tiny_lm import ProgressionCorpus, decay_groups, tiny_gpt2  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import get_scheduler  # noqa: E402

from zeroshard.integrations.accelerate import prepare_zeroshard  # noqa: E402


class Progress:
    """The optimizer steps taken, saved and loaded with the accelerator's state."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint-N/ folders of save_state")
    parser.add_argument("--steps", type=int, default=4, help="train until this step (resuming first)")
    parser.add_argument("--total-steps", type=int, default=None, help="the lr schedule's length (default --steps)")
    parser.add_argument("--global-batch", type=int, default=8, help="rows per step over all ranks")
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per rank and backward")
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser.parse_args(argv)


def newest_state(out: Path) -> Path | None:
    """The newest checkpoint-N folder whose sharded save finished (its latest names it)."""
    finished = [p for p in out.glob("checkpoint-*") if (p / "latest").is_file()]
    return max(finished, key=lambda p: int(p.name.split("-")[1])) if finished else None


def main(argv: list[str] | None = None) -> tuple[Accelerator, list[float]]:
    """Train (resuming from the newest checkpoint under --out); returns the accelerator and
    the loss of every step this run took (averaged over the ranks)."""
    args = parse_args(argv)
    world = PartialState().num_processes
    if args.global_batch % (world * args.micro_batch):
        raise SystemExit(f"--global-batch {args.global_batch} does not split into {world} x {args.micro_batch} rows")
    accelerator = Accelerator(
        gradient_accumulation_steps=args.global_batch // (world * args.micro_batch),
        mixed_precision="bf16",
        cpu=not torch.cuda.is_available(),
    )
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(decay_groups(model, 0.1), lr=args.lr)
    model, optimizer = prepare_zeroshard(accelerator, model, optimizer)
    total = args.total_steps or args.steps
    # Accelerate steps a prepared scheduler once per process at each optimizer step.
    scheduler = get_scheduler("linear", optimizer, 0, total * accelerator.num_processes)
    loader = DataLoader(ProgressionCorpus(), batch_size=args.micro_batch, shuffle=False)
    loader, scheduler = accelerator.prepare(loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    saved = newest_state(args.out)
    if saved is not None:
        accelerator.load_state(str(saved))  # every rank's shard, resharded to this world size
    batches = iter(accelerator.skip_first_batches(loader, progress.step * accelerator.gradient_accumulation_steps))
    losses = []
    while progress.step < args.steps:
        step_loss = torch.zeros(())
        for _ in range(accelerator.gradient_accumulation_steps):
            batch = next(batches)
            with accelerator.accumulate(model):
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                accelerator.backward(loss)
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the engine clips at step
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            step_loss += loss.detach() / accelerator.gradient_accumulation_steps
        progress.step += 1
        losses.append(float(accelerator.reduce(step_loss, reduction="mean")))
        accelerator.print(f"step {progress.step} loss {losses[-1]!r} grad_norm {float(grad_norm):.4f}")
        if progress.step % args.save_every == 0:
            accelerator.save_state(str(args.out / f"checkpoint-{progress.step}"))
    accelerator.wait_for_everyone()
    return accelerator, losses


if __name__ == "__main__":
    main()
