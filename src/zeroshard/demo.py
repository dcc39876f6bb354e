"""The demo: train TinyGPT with ZeRO on D ranks and report what the sharding bought.

``train(rank, world_size, config)`` runs on every rank (spawned by the CLI or by torchrun)
and returns a summary for rank 0 to print.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from .data import batch_seed, markov_chain, sample_batch
from .engine import ZeroOptimizer
from .layout import LayoutPolicy
from .models import GPTConfig, TinyGPT, gpt_param_groups

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 60
    stage: int = 2
    dtype: str = "bf16"
    batch_size: int = 8
    micro_batches: int = 1
    lr: float = 3e-3
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    seed: int = 0
    progress: bool = True


@dataclass
class ParamAlignment:
    name: str
    shape: tuple[int, ...]
    address_mod_16: int
    compact_offset_bytes: int  # where a compact layout would start it


@dataclass
class DemoSummary:
    world_size: int
    backend: str
    losses: list[float] = field(default_factory=list)
    step_seconds: float = 0.0
    memory: dict = field(default_factory=dict)
    padding: dict = field(default_factory=dict)
    alignment: list[ParamAlignment] = field(default_factory=list)


def build_engine(config: DemoConfig) -> tuple[TinyGPT, ZeroOptimizer]:
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


def train_steps(model: TinyGPT, engine: ZeroOptimizer, config: DemoConfig, first_step: int, steps: int, progress) -> list[float]:
    """Train ``steps`` steps; return the loss of each, averaged over ranks and micro-batches."""
    chain = markov_chain(model.config.vocab_size)
    losses = []
    for step in range(first_step, first_step + steps):
        total = torch.zeros(1)
        for micro in range(config.micro_batches):
            inputs, targets = sample_batch(chain, config.batch_size, model.config.block_size, batch_seed(step, engine.rank, micro))
            loss = model(inputs.to(engine.device), targets.to(engine.device))
            engine.backward(loss)
            total += loss.detach().float().cpu()
        engine.step()
        engine.zero_grad()
        total = engine.comm.all_reduce_(total.to(engine.device), op="sum").cpu()
        losses.append(total.item() / (config.micro_batches * engine.world_size))
        progress(step, losses[-1])
    return losses


def train(rank: int, world_size: int, config: DemoConfig) -> DemoSummary | None:
    model, engine = build_engine(config)
    summary = DemoSummary(world_size, engine.comm.backend)
    bar = _progress_bar(config, rank)
    start = time.perf_counter()
    summary.losses = train_steps(model, engine, config, 0, config.steps, bar)
    summary.step_seconds = (time.perf_counter() - start) / max(config.steps, 1)
    bar(None, None)
    summary.memory = asdict(engine.memory_report())
    summary.padding = asdict(engine.layout.padding())
    summary.alignment = _alignment(engine)
    return summary if rank == 0 else None


def _alignment(engine: ZeroOptimizer) -> list[ParamAlignment]:
    compact = engine.layout.with_policy(LayoutPolicy.native(compact=True))
    rows = []
    for buffer, compact_group in zip(engine.buffers, compact.groups):
        element = buffer.data.element_size()
        for slot, param, compact_slot in zip(buffer.group.params, buffer.params, compact_group.params):
            rows.append(ParamAlignment(slot.name, tuple(param.shape), param.data_ptr() % 16, compact_slot.offset * element))
    return rows


def _progress_bar(config: DemoConfig, rank: int):
    """A tqdm bar on rank 0's terminal; plain lines every 10 steps otherwise."""
    if rank != 0 or not config.progress:
        return lambda step, loss: None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=config.steps, desc="train", unit="step")

        def update(step, loss):
            if step is None:
                bar.close()
            else:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}")

        return update

    def log(step, loss):
        if step is not None and (step % 10 == 0 or step == config.steps - 1):
            print(f"  step {step:4d}  loss {loss:.4f}", flush=True)

    return log


def format_summary(summary: DemoSummary, config: DemoConfig) -> str:
    memory, padding = summary.memory, summary.padding
    per_rank = memory["param_buffer_bytes"] + memory["master_bytes"] + memory["optimizer_state_bytes"] + memory["gradient_bytes"]
    misaligned_if_compact = [row for row in summary.alignment if row.compact_offset_bytes % 16]
    aligned = sum(1 for row in summary.alignment if row.address_mod_16 == 0)
    lines = [
        "",
        f"ZeRO stage {config.stage}, {config.dtype}, {summary.world_size} ranks ({summary.backend}), {config.steps} steps",
        f"  loss: {summary.losses[0]:.4f} at the start -> {summary.losses[-1]:.4f} at the end "
        f"(uniform guess: {math.log(97):.4f})",
        f"  step time: {1e3 * summary.step_seconds:.1f} ms",
        "  memory per rank (training state):",
        f"    parameters ({config.dtype} flat buffers) {memory['param_buffer_bytes']:>10,} B",
        f"    fp32 master partition          {memory['master_bytes']:>10,} B",
        f"    optimizer state partition      {memory['optimizer_state_bytes']:>10,} B",
        f"    gradient partition             {memory['gradient_bytes']:>10,} B",
        f"    total                          {per_rank:>10,} B  vs {memory['unsharded_bytes']:,} B unsharded "
        f"({per_rank / memory['unsharded_bytes']:.2f}x)",
        f"  padding: {padding['inter_param_elements'] + padding['tail_elements']:,} elements, "
        f"{padding['padding_bytes']:,} B = {100 * padding['padding_bytes'] / padding['param_bytes']:.3f}% of the parameters",
        f"  alignment: {aligned} of {len(summary.alignment)} parameters start on a 16-byte boundary "
        f"(a compact layout would misalign {len(misaligned_if_compact)}):",
    ]
    for row in summary.alignment:
        note = "  <- misaligned if compact" if row.compact_offset_bytes % 16 else ""
        lines.append(f"    {row.name:<28} {str(list(row.shape)):<12} data_ptr % 16 = {row.address_mod_16}{note}")
    return "\n".join(lines)
