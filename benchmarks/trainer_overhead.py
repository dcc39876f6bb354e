"""What a trainer costs around zeroshard's step, and ZeroShardTrainer against Trainer(deepspeed=...).

One GPT-2 (vocab 8192, width 256, 4 layers, 4 heads, sequences of 64 tokens, 4 per rank;
no dropout) trains at D = 2 on gloo, one thread per rank, ZeRO-2 with bf16 parameters and
fp32 masters, torch's AdamW, clipping at 1.0, a linear lr decay, under each of:

* ``bare``: the bare zeroshard loop (ZeroOptimizer, a DataLoader with a DistributedSampler);
* ``transformers``: ZeroShardTrainer with the same settings (``optim="adamw_torch"``);
* ``accelerate``: an Accelerate loop with ``prepare_zeroshard`` (``accumulate``, clip, step);
* ``lightning``: Lightning's Trainer with ``strategy="zeroshard"``, ``precision="bf16-mixed"``;
* ``transformers ds-config``: ZeroShardTrainer with ``zeroshard=DS_CONFIG``, the DeepSpeed
  config below, whose defaults (bf16 reduction, the overflow check) the mapping keeps;
* ``deepspeed``: transformers' Trainer with ``TrainingArguments(deepspeed=DS_CONFIG)``,
  DeepSpeed 0.19.8 ZeRO-2 on its CPU accelerator (``torch_adam``: torch's AdamW).

Each variant runs in a torchrun job of its own (frameworks keep process-wide state), for
``--steps`` optimizer steps; a step's time is the wall time (and the process CPU time)
between the ends of consecutive steps, everything the loop does per step included (data,
hooks, logging, the scheduler); the first ``--warmup`` steps are dropped and the median of
the rest is the job's figure (the slower rank's). Rounds run every variant once, in an
order that rotates every round, so load on the machine hits all alike; the ratios
(variant / bare, zeroshard / DeepSpeed) are taken per round, then their median and range.

On a shared machine the step times of separate jobs move by tens of percent, far more than
a trainer's cost. So each job also splits every step's CPU time in two, in the same
process: the core, from the model's forward (a pre-hook) to the end of the optimizer step
(the engine's step post-hook; for the two transformers variants Trainer's
``on_optimizer_step``), and the rest, the framework's loop around it (data, callbacks,
logging, the scheduler). The overhead of a framework against the bare loop is then
``(core + its rest) / (core + the bare loop's rest)`` with the bare loop's core: the
difference of two small CPU figures, which contention disturbs far less.

    .venv/bin/python benchmarks/trainer_overhead.py [--rounds 3] [--steps 12] [--warmup 2]

Goals (issue 30): every framework within 1.03x the bare loop; ZeroShardTrainer at or below
1.0x Trainer with DeepSpeed ZeRO-2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from torchrun_job import run_for_json, write_gathered

VOCAB, WIDTH, LAYERS, HEADS, SEQ, MICRO = 8192, 256, 4, 4, 64, 4
LR, WEIGHT_DECAY = 3e-4, 0.1
VARIANTS = ("bare", "transformers", "accelerate", "lightning", "transformers ds-config", "deepspeed")
DS_CONFIG = {
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": "auto"},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True},
    },
}


# ---- worker (one rank under torchrun) ----------------------------------------------------------


class StepClock:
    """Per step: wall and process CPU time from the end of the previous step, and the CPU time
    of its core (the model's forward to the end of the optimizer step)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, float]] = []
        self.start()

    def start(self) -> None:
        self.last, self.core_from, self.core_to = (time.perf_counter(), time.process_time()), None, None

    def core_start(self, *_: object) -> None:
        if self.core_from is None:
            self.core_from = time.process_time()

    def core_end(self, *_: object) -> None:
        self.core_to = time.process_time()

    def tick(self) -> None:
        now = (time.perf_counter(), time.process_time())
        core = self.core_to - self.core_from if self.core_from is not None and self.core_to is not None else 0.0
        self.steps.append((now[0] - self.last[0], now[1] - self.last[1], core))
        self.last, self.core_from, self.core_to = now, None, None

    def watch(self, model, engine=None) -> None:
        """The core starts at ``model``'s forward and ends at ``engine``'s step (if given)."""
        model.register_forward_pre_hook(self.core_start)
        if engine is not None:
            engine.register_step_post_hook(self.core_end)


def _model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


def _decay_groups(model) -> list[dict]:
    from torch import nn

    norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    named = list(model.named_parameters())
    decay = [p for n, p in named if not n.endswith("bias") and id(p) not in norms]
    rest = [p for n, p in named if n.endswith("bias") or id(p) in norms]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]


class _Rows:
    """Seeded random token rows: input_ids and labels."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int):
        import torch

        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


def _training_arguments(out: str, steps: int, **options):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=MICRO, learning_rate=LR,
        weight_decay=WEIGHT_DECAY, bf16=True, optim="adamw_torch", save_strategy="no", logging_steps=10**6,
        use_cpu=True, report_to=[], disable_tqdm=True, train_sampling_strategy="sequential", **options,
    )  # fmt: skip


def _clock_callback(clock: StepClock):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            clock.watch(model)
            clock.start()

        def on_optimizer_step(self, args, state, control, **kwargs):
            clock.core_end()

        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    return Clock()


def run_bare(steps: int, clock: StepClock) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler
    from transformers import get_scheduler

    from zeroshard.engine import ZeroOptimizer

    model = _model()
    engine = ZeroOptimizer(
        model, torch.optim.AdamW, _decay_groups(model), stage=2, param_dtype=torch.bfloat16, max_grad_norm=1.0, lr=LR
    )
    schedule = get_scheduler("linear", engine, num_warmup_steps=0, num_training_steps=steps)
    rows = _Rows(MICRO * dist.get_world_size() * steps)
    loader = DataLoader(rows, batch_size=MICRO, sampler=DistributedSampler(rows, shuffle=False))
    clock.watch(model, engine)
    clock.start()
    for batch in loader:
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        engine.backward(loss)
        engine.step()
        schedule.step()
        engine.zero_grad()
        clock.tick()


def run_transformers(steps: int, clock: StepClock, out: str, zeroshard=None) -> None:
    from zeroshard.integrations.transformers import ZeroShardTrainer

    trainer = ZeroShardTrainer(
        model=_model(), args=_training_arguments(out, steps), train_dataset=_Rows(10**5),
        callbacks=[_clock_callback(clock)], zeroshard=zeroshard,
    )  # fmt: skip
    trainer.train()


def run_deepspeed(steps: int, clock: StepClock, out: str) -> None:
    from transformers import Trainer

    trainer = Trainer(
        model=_model(), args=_training_arguments(out, steps, deepspeed=DS_CONFIG), train_dataset=_Rows(10**5),
        callbacks=[_clock_callback(clock)],
    )  # fmt: skip
    assert trainer.is_deepspeed_enabled
    trainer.train()


def run_accelerate(steps: int, clock: StepClock) -> None:
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    from zeroshard.integrations.accelerate import prepare_zeroshard

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = _model()
    model, optimizer = prepare_zeroshard(accelerator, model, torch.optim.AdamW(_decay_groups(model), lr=LR))
    schedule = get_scheduler("linear", optimizer, 0, steps * accelerator.num_processes)
    loader = DataLoader(_Rows(MICRO * accelerator.num_processes * steps), batch_size=MICRO)
    loader, schedule = accelerator.prepare(loader, schedule)
    clock.watch(model, optimizer.engine)
    clock.start()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        clock.tick()


def run_lightning(steps: int, clock: StepClock) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    import zeroshard.integrations.lightning  # noqa: F401  (registers strategy="zeroshard")

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model()

        def training_step(self, batch, index):
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(_decay_groups(self.model), lr=LR)
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, (steps - step) / steps))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

        def train_dataloader(self):
            return DataLoader(_Rows(MICRO * self.trainer.world_size * steps), batch_size=MICRO)

    class Clock(Callback):
        def on_train_start(self, trainer, module):
            clock.watch(module.model, trainer.strategy.engine)
            clock.start()

        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            clock.tick()

    trainer = L.Trainer(
        strategy="zeroshard", accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), precision="bf16-mixed",
        max_steps=steps, gradient_clip_val=1.0, callbacks=[Clock()], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Module())


def worker(variant: str, steps: int, out_path: Path) -> None:
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # gloo does it all
    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        if variant == "bare":
            dist.init_process_group("gloo")
            run_bare(steps, clock)
        elif variant == "transformers":
            run_transformers(steps, clock, out)
        elif variant == "transformers ds-config":
            run_transformers(steps, clock, out, zeroshard=DS_CONFIG)
        elif variant == "deepspeed":
            run_deepspeed(steps, clock, out)
        elif variant == "accelerate":
            run_accelerate(steps, clock)
        elif variant == "lightning":
            run_lightning(steps, clock)
        write_gathered(out_path, clock.steps, variant=variant)
    sys.stdout.flush()
    os._exit(0)  # as engine_vs_deepspeed.py: skip gloo's interpreter teardown


# ---- launcher ---------------------------------------------------------------------------------


def job_figures(result: dict, warmup: int) -> tuple[float, float, float]:
    """The median step (wall, CPU) and the median CPU time outside its core (the framework's
    loop) of the slower rank, past ``warmup`` steps."""
    medians = []
    for steps in result["ranks"]:
        kept = steps[warmup:]
        medians.append(tuple(statistics.median(step[i] if i < 2 else step[1] - step[2] for step in kept) for i in range(3)))
    return tuple(max(m[i] for m in medians) for i in range(3))


def summary(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return

    env = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    figures: dict[str, list[tuple[float, float, float]]] = {name: [] for name in args.variants}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            shift = round_index % len(args.variants)
            for name in args.variants[shift:] + args.variants[:shift]:
                out = Path(scratch) / f"{round_index}-{name.replace(' ', '_')}.json"
                worker_args = ["--worker", name, "--steps", str(args.steps), "--out", str(out)]
                result = run_for_json(__file__, args.world_size, worker_args, out, timeout=900, **env)
                figures[name].append(job_figures(result, args.warmup))
                wall, cpu, rest = figures[name][-1]
                print(
                    f"round {round_index}: {name:24s} {wall * 1e3:8.1f} ms/step wall, {cpu * 1e3:8.1f} ms CPU, "
                    f"{rest * 1e3:6.2f} ms CPU outside the core",
                    flush=True,
                )

    print(f"\nD = {args.world_size}, {args.steps} steps per job ({args.warmup} dropped), {args.rounds} rounds")
    header = f"{'variant':24s} {'wall ms':>8s} {'CPU ms':>7s} {'loop ms':>8s}  {'wall / bare':>22s}  {'CPU / bare':>22s}"
    print(header + f"  {'loop overhead':>22s}")
    for name in args.variants:
        line = "".join(f" {statistics.median(f[i] for f in figures[name]) * 1e3:{w}.2f}" for i, w in ((0, 8), (1, 7), (2, 8)))
        line = f"{name:24s}" + line
        if "bare" in figures and name != "bare":
            rounds = list(zip(figures[name], figures["bare"]))
            line += f"  {summary([f[0] / b[0] for f, b in rounds]):>22s}  {summary([f[1] / b[1] for f, b in rounds]):>22s}"
            # the bare loop's step with this framework's loop around the same core, per round
            line += f"  {summary([(b[1] - b[2] + f[2]) / b[1] for f, b in rounds]):>22s}"
        print(line)
    if "deepspeed" in figures and "transformers ds-config" in figures:
        pairs = list(zip(figures["transformers ds-config"], figures["deepspeed"]))
        print(
            f"\nZeroShardTrainer (same DeepSpeed config) / Trainer(deepspeed=...): wall "
            f"{summary([a[0] / b[0] for a, b in pairs])}, CPU {summary([a[1] / b[1] for a, b in pairs])}"
        )
    print(json.dumps({name: figures[name] for name in args.variants}))


if __name__ == "__main__":
    main()
