"""Worker code for the trainer integration tests (spawned gloo ranks).

Each framework's worker runs, in the same processes, the bare zeroshard loop on the same
model, data and world size as the framework's example, then the example itself, and
gathers the engine's full state after its last step (the state its last checkpoint holds).
Workers return numbers and tensors, never verdicts.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from zeroshard.engine import ZeroOptimizer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ADAM_STATES = ("exp_avg", "exp_avg_sq")
STEP_LINE = re.compile(r"^step \d+ loss (\S+)$", re.MULTILINE)  # the Lightning example's lines


def torchrun(ranks: int, *args: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node RANKS ARGS`` from the repository root, as a user runs it."""
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", str(ranks), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "terminate called" not in done.stderr
    return done


def example(name: str):
    """The example script ``examples/<name>.py`` as a module (its folder on the path, for tiny_lm)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def full_state(engine: ZeroOptimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Collective: every parameter's fp32 master and Adam states, gathered over the ranks."""
    state = {}
    for name, _ in engine.model.named_parameters():
        entry = {"fp32": engine.get_full_fp32_param(name)}
        for key in ADAM_STATES:
            entry[key] = engine.get_full_optimizer_state(name, key)
        state[name] = entry
    return state


def state_difference(engine: ZeroOptimizer, expected: dict[str, dict[str, torch.Tensor]]) -> float:
    """Collective: the largest absolute difference between the engine's full state and ``expected``."""
    got = full_state(engine)
    if set(got) != set(expected):
        return float("inf")
    return max(float((got[name][key] - expected[name][key]).abs().max()) for name in got for key in got[name])


def mean_over_ranks(value: torch.Tensor) -> float:
    total = value.detach().clone().reshape(1)
    dist.all_reduce(total)
    return float(total / dist.get_world_size())


def bare_engine(fused: bool, wrapped: bool = False) -> ZeroOptimizer:
    """The examples' tiny GPT-2 under a ZeroOptimizer as the examples build it: ZeRO-2, bf16
    parameters, the decay split, AdamW (fused as Trainer's default, or torch's default), clip
    1.0. ``wrapped``: the GPT-2 as the ``model`` of a container, as in the LightningModule."""
    lm = example("tiny_lm")
    gpt2 = lm.tiny_gpt2()
    model = gpt2
    if wrapped:
        model = torch.nn.Module()
        model.model = gpt2
    return ZeroOptimizer(
        model,
        torch.optim.AdamW,
        lm.decay_groups(gpt2, 0.1),
        stage=2,
        param_dtype=torch.bfloat16,
        max_grad_norm=1.0,
        lr=3e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        fused=fused,
    )


def bare_losses(steps: int, micro: int, fused: bool, epoch_rows: int | None = None) -> list[float]:
    """The bare zeroshard loop the examples amount to at this world size (one micro-batch per
    rank and step; rank r takes the step's r-th block of rows, epochs of ``epoch_rows`` rows
    starting over): the same model, rows, optimizer, linear lr decay and clipping. Each
    step's loss, averaged over the ranks."""
    from transformers import get_scheduler

    rank, world_size = dist.get_rank(), dist.get_world_size()
    engine = bare_engine(fused)
    schedule = get_scheduler("linear", engine, num_warmup_steps=0, num_training_steps=steps)
    corpus = example("tiny_lm").ProgressionCorpus()
    losses = []
    for step in range(steps):
        first = (step * world_size + rank) * micro % (epoch_rows or len(corpus))
        ids = torch.stack([corpus[i]["input_ids"] for i in range(first, first + micro)])
        loss = engine.model(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        schedule.step()
        engine.zero_grad()
        losses.append(mean_over_ranks(loss))
    return losses


# ---- the frameworks ---------------------------------------------------------------------------


def transformers_run(rank: int, world_size: int, out: str, steps: int) -> dict:
    """The bare loop, then examples/trainer_transformers.py; the losses of both and the
    engine's gathered state after the last step (rank 0)."""
    module = example("trainer_transformers")
    bare = bare_losses(steps, micro=4, fused=True)  # Trainer's default optim is adamw_torch_fused
    trainer = module.main(["--out", out, "--steps", str(steps)])
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    gathered = full_state(trainer.engine)
    return {"bare": bare, "trainer": logged, "grad_norms": norms, "state": gathered if rank == 0 else None}


class TokenRows(torch.utils.data.Dataset):
    """Random token rows (seeded by index) for the MoE model: input_ids and labels."""

    def __init__(self, vocab: int, length: int = 8, rows: int = 64) -> None:
        self.vocab, self.length, self.rows = vocab, length, rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab, (self.length,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


def moe_trainer(out: str, world_size: int, expert_parallel: int | None, steps: int):
    """A ZeroShardTrainer over the tiny transformers Qwen3-MoE of tests/hf_moe_workers.py, fp32,
    global batch 8 in micro-batches of 4 (accumulation makes up for fewer ranks)."""
    from hf_moe_workers import CONFIG, qwen3_moe
    from transformers import TrainingArguments

    from zeroshard.integrations.transformers import ZeroShardTrainer

    args = TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2 // world_size,
        learning_rate=1e-2,
        save_steps=2,
        logging_steps=1,
        train_sampling_strategy="sequential",
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
    )
    return ZeroShardTrainer(
        model=qwen3_moe(), args=args, train_dataset=TokenRows(CONFIG["vocab_size"]), expert_parallel=expert_parallel
    )


def moe_run(rank: int, world_size: int, out: str, steps: int) -> list[float]:
    """The Qwen3-MoE trained at EP = world size under ZeroShardTrainer; its logged losses."""
    trainer = moe_trainer(out, world_size, world_size, steps)
    assert trainer.model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4 // world_size  # its own experts
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def accelerate_run(rank: int, world_size: int, out: str, steps: int) -> dict:
    """The bare loop, then examples/trainer_accelerate.py; the losses of both and the engine's
    gathered state after the last step (rank 0)."""
    module = example("trainer_accelerate")
    bare = bare_losses(steps, micro=4, fused=False)  # the example's AdamW is torch's default
    accelerator, losses = module.main(["--out", out, "--steps", str(steps)])
    engine = accelerator._optimizers[0].engine
    gathered = full_state(engine)
    return {"bare": bare, "accelerate": losses, "state": gathered if rank == 0 else None}


def lightning_run(rank: int, world_size: int, out: str, steps: int) -> dict:
    """The bare loop, then examples/trainer_lightning.py; the losses of both (the example's
    from its printed lines, rank 0) and the engine's gathered state at the end of fit (rank 0)."""
    import contextlib
    import io

    from lightning.pytorch.callbacks import Callback

    class GatherState(Callback):
        state: dict = {}

        def on_train_end(self, trainer, module) -> None:  # before the strategy's teardown
            GatherState.state = full_state(trainer.strategy.engine)

    module = example("trainer_lightning")
    bare = bare_losses(steps, micro=4, fused=False, epoch_rows=16)  # torch's default AdamW; epochs of 2 steps
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        module.main(["--out", out, "--steps", str(steps)], callbacks=[GatherState()])
    losses = [float(loss) for loss in STEP_LINE.findall(printed.getvalue())]
    return {"bare": bare, "lightning": losses, "state": GatherState.state if rank == 0 else None}
