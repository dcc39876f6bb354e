"""A Lightning training script with zeroshard: ``Trainer(strategy="zeroshard")``.

    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/trainer_lightning.py --out runs/pl --steps 4
    .venv/bin/torchrun --standalone --nproc_per_node 1 examples/trainer_lightning.py --out runs/pl --steps 8

The first command trains a tiny GPT-2 for 4 steps (2 epochs of 2 steps) on 2 ranks: ZeRO-2
with ``precision="bf16-mixed"`` (bf16 parameters, fp32 masters), the LightningModule's own
AdamW and lr schedule, clipping by the engine. A checkpoint after each epoch is a directory
``runs/pl/checkpoints/epoch=0-step=2.ckpt/``: Lightning's dictionary (``lightning.ckpt``:
loops, callbacks, lr schedulers) and a zeroshard sharded checkpoint ``zeroshard/`` written by
every rank. The second resumes the newest on 1 rank (``ckpt_path=``, resharded, attested) and
trains to step 8. Rank 0 prints ``step N loss X`` (X exactly, as ``repr``).

Against a plain Lightning script the change is the strategy (and the import that registers it):

    +import zeroshard.integrations.lightning  # registers strategy="zeroshard"
    -trainer = Trainer(strategy="deepspeed_stage_2", ...)
    +trainer = Trainer(strategy="zeroshard", ...)

Every step sees the same rows at any world size: the global batch is ``--global-batch`` rows in
micro-batches of ``--micro-batch``; ``RankBlocks`` gives each rank its consecutive share and
``accumulate_grad_batches`` makes up for fewer ranks.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tiny_lm, beside this file

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from tiny_lm import ProgressionCorpus, decay_groups, tiny_gpt2  # noqa: E402
from torch.utils.data import DataLoader, Sampler  # noqa: E402

import zeroshard.integrations.lightning  # noqa: E402,F401  (registers strategy="zeroshard")


class RankBlocks(Sampler):
    """This rank's rows: step t's global batch is world x accumulate micro-batches in order, and
    rank r reads its ``accumulate`` consecutive ones (so 2 ranks x 1 = 1 rank x 2)."""

    def __init__(self, rows: int, micro: int, rank: int, world: int, accumulate: int) -> None:
        self.rows, self.micro, self.rank, self.world, self.accumulate = rows, micro, rank, world, accumulate

    def __iter__(self):
        per_step = self.world * self.accumulate
        for step in range(self.rows // (self.micro * per_step)):
            for index in range(self.accumulate):
                first = (step * per_step + self.rank * self.accumulate + index) * self.micro
                yield from range(first, first + self.micro)

    def __len__(self) -> int:
        return self.rows // self.world


class TinyLM(L.LightningModule):
    """The tiny GPT-2, its AdamW and a linear lr decay; prints each step's loss over every rank."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.model = tiny_gpt2()
        self.micro_losses: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> torch.Tensor:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.micro_losses.append(loss.detach())
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        step_loss = self.trainer.strategy.reduce(torch.stack(self.micro_losses).mean(), reduce_op="mean")
        self.micro_losses.clear()
        if self.trainer.is_global_zero:
            print(f"step {self.trainer.global_step + 1} loss {float(step_loss)!r}", flush=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(decay_groups(self.model, 0.1), lr=self.args.lr)
        total = self.args.total_steps or self.args.steps
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, (total - step) / total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        rows = self.args.global_batch * self.args.save_every  # an epoch is --save-every steps
        sampler = RankBlocks(rows, self.args.micro_batch, self.global_rank, self.trainer.world_size, self.accumulate)
        return DataLoader(ProgressionCorpus(rows), batch_size=self.args.micro_batch, sampler=sampler)

    @property
    def accumulate(self) -> int:
        return self.trainer.accumulate_grad_batches


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoints go to OUT/checkpoints")
    parser.add_argument("--steps", type=int, default=4, help="train until this step (resuming first)")
    parser.add_argument("--total-steps", type=int, default=None, help="the lr schedule's length (default --steps)")
    parser.add_argument("--global-batch", type=int, default=8, help="rows per step over all ranks")
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per rank and backward")
    parser.add_argument("--save-every", type=int, default=2, help="steps per epoch; a checkpoint after each")
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser.parse_args(argv)


def newest_checkpoint(folder: Path) -> Path | None:
    """The checkpoint of the most steps under ``folder`` whose sharded save finished."""
    finished = [p for p in folder.glob("*.ckpt") if (p / "latest").is_file()]
    return max(finished, key=lambda p: int(re.search(r"step=(\d+)", p.name).group(1))) if finished else None


def main(argv: list[str] | None = None, callbacks: list = ()) -> tuple[L.Trainer, TinyLM]:
    """Fit (resuming from the newest checkpoint under --out); returns the trainer and the module."""
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.global_batch % (world * args.micro_batch):
        raise SystemExit(f"--global-batch {args.global_batch} does not split into {world} x {args.micro_batch} rows")
    checkpoints = ModelCheckpoint(dirpath=args.out / "checkpoints", filename="{epoch}-{step}", save_top_k=-1)
    trainer = L.Trainer(
        strategy="zeroshard",
        accelerator="cuda" if torch.cuda.is_available() else "cpu",
        devices=world,
        precision="bf16-mixed",
        max_steps=args.steps,
        accumulate_grad_batches=args.global_batch // (world * args.micro_batch),
        gradient_clip_val=1.0,
        use_distributed_sampler=False,  # RankBlocks shares the rows out
        callbacks=[checkpoints, *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = TinyLM(args)
    trainer.fit(module, ckpt_path=newest_checkpoint(args.out / "checkpoints"))
    return trainer, module


if __name__ == "__main__":
    main()
