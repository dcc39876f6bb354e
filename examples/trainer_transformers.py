"""transformers' Trainer with zeroshard: ZeroShardTrainer, as a Trainer(deepspeed=...) user runs it.

    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/trainer_transformers.py --out runs/hf --steps 4
    .venv/bin/torchrun --standalone --nproc_per_node 1 examples/trainer_transformers.py --out runs/hf --steps 8

The first command trains a tiny GPT-2 for 4 steps on 2 ranks (ZeRO-2, bf16 parameters with
fp32 masters), saving ``runs/hf/checkpoint-2`` and ``checkpoint-4``: each holds Trainer's own
files and a zeroshard sharded checkpoint ``zeroshard/`` written by every rank. The second
finds the newest checkpoint and resumes it on 1 rank (resharded at load time, attested),
with the optimizer state and the lr schedule where they were, and trains to step 8; then it
writes the fp32 weights with ``save_model`` (``runs/hf/model``, loaded back here with
``from_pretrained``).

Against a plain Trainer script the change is the class and the ``deepspeed=`` argument:

    -trainer = Trainer(model=model, args=TrainingArguments(..., deepspeed="ds_config.json"), ...)
    +trainer = ZeroShardTrainer(model=model, args=TrainingArguments(...), zeroshard="ds_config.json", ...)

Every step sees the same rows at any world size: the global batch (``--global-batch``) is
split into per-rank micro-batches of ``--micro-batch`` rows, and the ranks' shortfall is made
up with gradient accumulation (2 ranks x 1 micro-batch = 1 rank x 2 micro-batches), read in
order (``train_sampling_strategy="sequential"``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tiny_lm, beside this file

import torch  # noqa: E402
from tiny_lm import ProgressionCorpus, tiny_gpt2  # noqa: E402
from transformers import GPT2LMHeadModel, TrainingArguments  # noqa: E402

from zeroshard.integrations.transformers import ZeroShardTrainer  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output_dir: checkpoint-N/ and the final model/")
    parser.add_argument("--steps", type=int, default=4, help="train until this step (resuming first)")
    parser.add_argument("--global-batch", type=int, default=8, help="rows per step over all ranks")
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per rank and backward")
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--fp32", action="store_true", help="fp32 parameters (default: bf16 with fp32 masters)")
    return parser.parse_args(argv)


def training_arguments(args: argparse.Namespace, world_size: int) -> TrainingArguments:
    """The TrainingArguments; gradient accumulation makes up for fewer ranks."""
    per_step = world_size * args.micro_batch
    if args.global_batch % per_step:
        raise SystemExit(f"--global-batch {args.global_batch} does not split into {world_size} x {args.micro_batch} rows")
    return TrainingArguments(
        output_dir=str(args.out),
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.global_batch // per_step,
        learning_rate=args.lr,
        weight_decay=0.1,
        lr_scheduler_type="linear",
        bf16=not args.fp32,
        save_steps=args.save_every,
        logging_steps=1,
        train_sampling_strategy="sequential",
        use_cpu=not torch.cuda.is_available(),
        report_to=[],
        disable_tqdm=True,
    )


def main(argv: list[str] | None = None) -> ZeroShardTrainer:
    """Train (resuming from the newest checkpoint under --out), save the model; returns the trainer."""
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    trainer = ZeroShardTrainer(
        model=tiny_gpt2(),
        args=training_arguments(args, world_size),
        train_dataset=ProgressionCorpus(),
    )
    resume = any(args.out.glob("checkpoint-*"))
    trainer.train(resume_from_checkpoint=resume or None)
    trainer.save_model(str(args.out / "model"))
    if trainer.is_world_process_zero():
        GPT2LMHeadModel.from_pretrained(args.out / "model")  # the fp32 weights and config.json load as they are
        print(f"saved {args.out / 'model'} (from_pretrained loads it)", flush=True)
    return trainer


if __name__ == "__main__":
    main()
