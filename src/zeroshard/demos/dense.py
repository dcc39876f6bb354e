"""The demo: train TinyGPT with ZeRO, save, resume at another world size, convert.

``train_phase`` runs on every rank (spawned by the CLI, or under torchrun) and returns a
``PhaseResult`` on rank 0. Data is drawn per global batch, and each rank trains on its
contiguous share, so a run resumed at another world size continues the same optimisation.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..checkpoint.checkpointer import Checkpointer, SaveStats
from .data import markov_chain, sample_batch
from ..engine import ZeroOptimizer
from ..layout import LayoutPolicy
from ..models import GPTConfig, TinyGPT, gpt_param_groups

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LIVE_MASTERS_FILE = "live_fp32_masters.safetensors"


@dataclass(frozen=True)
class DemoConfig:
    """The dense demo's training settings: steps in all (half per phase), ZeRO stage, the
    parameters' dtype ("bf16", "fp16", "fp32"), the global batch and its micro-batches per
    rank, AdamW's learning rate and weight decay, the gradient-norm clip, the seed, whether to
    show a progress bar, and how often to save."""

    steps: int = 60
    stage: int = 2
    dtype: str = "bf16"
    global_batch: int = 24
    micro_batches: int = 1
    lr: float = 3e-3
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    seed: int = 0
    progress: bool = True
    save_every: int = 10  # an asynchronous save every this many steps, and after the last


@dataclass
class ParamAlignment:
    """Where one parameter's view lies in its flat buffer: its name and shape, its address
    modulo 16 bytes, and the byte offset a compact layout (no alignment padding) would give it."""

    name: str
    shape: tuple[int, ...]
    address_mod_16: int
    compact_offset_bytes: int  # where a compact layout would start it


@dataclass
class PhaseResult:
    """What rank 0 reports of one phase (training, then a save)."""

    world_size: int
    backend: str
    first_step: int
    losses: list[float] = field(default_factory=list)
    train_seconds: float = 0.0
    load_seconds: float = 0.0
    attestation: str = ""  # what the resume's load proved (its one line)
    save_seconds: float = 0.0  # the last save, from save() until it was committed
    checkpoint: str = ""
    saves: list[SaveStats] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    padding: dict = field(default_factory=dict)
    alignment: list[ParamAlignment] = field(default_factory=list)


def build_engine(config: DemoConfig) -> tuple[TinyGPT, ZeroOptimizer]:
    """TinyGPT, seeded with ``config.seed`` (the same on every rank), and its ZeroOptimizer
    (AdamW, decayed and undecayed param groups) as ``config`` says. Collective: the engine's
    construction communicates over the default process group."""
    torch.manual_seed(config.seed)
    model = TinyGPT(GPTConfig())
    decay, no_decay = gpt_param_groups(model)
    params = dict(model.named_parameters())
    groups = [
        {"params": [params[n] for n in decay], "weight_decay": config.weight_decay},
        {"params": [params[n] for n in no_decay], "weight_decay": 0.0},
    ]
    engine = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        groups,
        stage=config.stage,
        param_dtype=DTYPES[config.dtype],
        gradient_accumulation_steps=config.micro_batches,
        max_grad_norm=config.max_grad_norm,
        lr=config.lr,
        betas=(0.9, 0.95),
    )
    return model, engine


def train_steps(
    model: TinyGPT, engine: ZeroOptimizer, config: DemoConfig, first_step: int, steps: int, progress, after_step=None
) -> list[float]:
    """Collective. Train ``steps`` steps; the loss of each, averaged over the global batch.
    ``after_step(step)`` is called after each (the demo saves there)."""
    chain = markov_chain(model.config.vocab_size)
    per_micro = config.global_batch // (engine.world_size * config.micro_batches)
    losses = []
    for step in range(first_step, first_step + steps):
        inputs, targets = sample_batch(chain, config.global_batch, model.config.block_size, seed=step)
        total = torch.zeros(1)
        for micro in range(config.micro_batches):
            start = (engine.rank * config.micro_batches + micro) * per_micro
            rows = slice(start, start + per_micro)
            loss = model(inputs[rows].to(engine.device), targets[rows].to(engine.device))
            engine.backward(loss)
            total += loss.detach().float().cpu()
        engine.step()
        engine.zero_grad()
        total = engine.comm.all_reduce_(total.to(engine.device), op="sum").cpu()
        losses.append(total.item() / (config.micro_batches * engine.world_size))
        progress(step, losses[-1])
        if after_step is not None:
            after_step(step)
    return losses


def resume_at(ckpt: Checkpointer, first_step: int, report: bool = True) -> tuple[float, str]:
    """Collective. Load the latest checkpoint, which must resume at ``first_step``, and say
    (rank 0, if ``report``) which it was; the seconds it took and its attestation's line.

    Raises:
        ValueError: there is none, or it resumes at another step.
    """
    start = time.perf_counter()
    resumed_at = ckpt.load()
    if ckpt.resumed_from is None:
        raise ValueError(f"{ckpt.root}: no checkpoint to resume from (no 'latest' file)")
    if resumed_at != first_step:
        raise ValueError(f"the latest checkpoint resumes at step {resumed_at}, not at {first_step}")
    if report and ckpt.engine.rank == 0:
        print(f"  resumed from {ckpt.resumed_from} at step {resumed_at}", flush=True)
    assert ckpt.attestation is not None  # every load attests
    return time.perf_counter() - start, ckpt.attestation.line()

def train_phase(
    rank: int, world_size: int, config: DemoConfig, out_dir: str, first_step: int, steps: int, resume: bool
) -> PhaseResult | None:
    """Collective (every rank of the phase runs it): build the engine, load the latest
    checkpoint if ``resume``, train, save. The PhaseResult on rank 0, None on the others.
    ValueError when the global batch does not split into the ranks and micro-batches."""
    if config.global_batch % (world_size * config.micro_batches):
        raise ValueError(f"global batch {config.global_batch} does not split into {world_size} ranks x {config.micro_batches} micro-batches")
    model, engine = build_engine(config)
    result = PhaseResult(world_size, engine.comm.backend, first_step)
    last_step = first_step + steps - 1
    with Checkpointer(engine, Path(out_dir) / "checkpoints", keep_last=3, async_save=True) as ckpt:
        if resume:
            result.load_seconds, result.attestation = resume_at(ckpt, first_step, config.progress)

        def save_now(step: int) -> None:
            if (step + 1) % config.save_every == 0 or step == last_step:
                ckpt.save(step)
                _report_saves(ckpt.history[:-1], result.saves, rank, config)  # the earlier ones are done

        bar = progress_bar(config, rank, first_step, steps)
        start = time.perf_counter()
        result.losses = train_steps(model, engine, config, first_step, steps, bar, save_now)
        result.train_seconds = time.perf_counter() - start
        bar(None, None)
        start = time.perf_counter()
        last = ckpt.wait()
        if last is not None:
            result.save_seconds = last.stall_s + time.perf_counter() - start
            result.checkpoint = str(last.path)
        _report_saves(ckpt.history, result.saves, rank, config)
    _save_live_masters(engine, Path(out_dir) / LIVE_MASTERS_FILE)
    result.memory = asdict(engine.memory_report())
    result.padding = asdict(engine.layout.padding())
    result.alignment = _alignment(engine)
    return result if rank == 0 else None


def _report_saves(done: list[SaveStats], reported: list[SaveStats], rank: int, config: DemoConfig) -> None:
    """Print (rank 0) each finished save not reported yet: its stall next to its write time."""
    for stats in done[len(reported) :]:
        reported.append(stats)
        if rank == 0 and config.progress and stats.write_s is not None:
            print(
                f"  saved {stats.tag}: training stalled {1e3 * stats.stall_s:.1f} ms, "
                f"written in the background in {1e3 * stats.write_s:.1f} ms",
                flush=True,
            )


def _save_live_masters(engine: ZeroOptimizer, path: Path) -> None:
    """Rank 0 writes every parameter's fp32 master, gathered from the live engine."""
    from safetensors.torch import save_file

    masters = {name: engine.get_full_fp32_param(name).contiguous() for name in engine.layout.param_names}
    if engine.rank == 0:
        save_file(masters, str(path))


def _alignment(engine: ZeroOptimizer) -> list[ParamAlignment]:
    compact = engine.layout.with_policy(LayoutPolicy.native(compact=True))
    rows = []
    for buffer, compact_group in zip(engine.buffers, compact.groups):
        element = buffer.data.element_size()
        for slot, param, compact_slot in zip(buffer.group.params, buffer.params, compact_group.params):
            rows.append(ParamAlignment(slot.name, tuple(param.shape), param.data_ptr() % 16, compact_slot.offset * element))
    return rows


def progress_bar(config: DemoConfig, rank: int, first_step: int, steps: int):
    """A tqdm bar on rank 0's terminal; plain lines every 10 steps otherwise."""
    if rank != 0 or not config.progress:
        return lambda step, loss: None
    import sys

    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=steps, desc="train", unit="step")

        def update(step, loss):
            if step is None:
                bar.close()
            else:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}")

        return update

    def log(step, loss):
        if step is not None and ((step - first_step) % 10 == 0 or step == first_step + steps - 1):
            print(f"  step {step:4d}  loss {loss:.4f}", flush=True)

    return log
