"""gpu_check.py, check 5: the memory each kind of training state takes, against the formula.

ZeRO at D ranks, bf16 parameters, fp32 masters and AdamW, per rank: 2 bytes per parameter
(plus the layout's padding), 4 per master element and 8 of Adam state per element of the
rank's partition (numel / D), fp32 gradients (stage 2: the partition; stage 1: also a
full-size accumulator), plus stage 2's bucket pool. Here D=1 on the device, for the step-
time check's model.

Two readings: the engine's own tensor count (``memory_report``) against the formula, kind
by kind; and on CUDA the caching allocator's ``memory_allocated`` after each phase (model
on the device, engine built, first step) against what the formula says that phase adds,
and the peaks (``max_memory_allocated``) of construction and step.
"""

from __future__ import annotations

import gc

import torch

from gpu_check_common import CheckResult, Context
from gpu_check_step import model_config
from zeroshard.engine import ZeroOptimizer
from zeroshard.models import TinyGPT

ALLOCATOR_ROUNDING = 512  # the caching allocator rounds each block up to a multiple of this
SMALL_TENSORS = 64 * 1024  # scalars the step leaves (norm, scaler, step counts)


def _allocated(context: Context) -> int:
    return torch.cuda.memory_allocated(context.device) if context.cuda else 0


def formula(engine: ZeroOptimizer, stage: int) -> dict[str, int]:
    """Bytes per state kind on this rank, from the layout alone (pool: what the reducer keeps)."""
    groups = engine.layout.groups
    padding = engine.layout.padding().padding_bytes
    param_numel = sum(group.param_numel for group in groups)
    partition = sum(group.partition_numel for group in groups)
    full = sum(group.numel for group in groups)
    return {
        "params": 2 * param_numel + padding,
        "masters": 4 * partition,
        "optimizer": 8 * partition,
        "gradients": 4 * partition + (4 * full if stage == 1 else 0),
        "buckets": engine.reducer.pool_bytes,
    }


def _warm_up(context: Context) -> None:
    """Run bf16 and fp32 matmuls forward and backward once, so that the workspaces cuBLAS
    keeps in the caching allocator exist before the first reading."""
    for dtype in (torch.bfloat16, torch.float32):
        weight = torch.randn(256, 256, dtype=dtype, device=context.device, requires_grad=True)
        (weight @ weight).float().sum().backward()
    context.sync()


def _measure_stage(context: Context, result: CheckResult, stage: int) -> None:
    tag = f"stage{stage}"
    _warm_up(context)
    gc.collect()
    if context.cuda:
        torch.cuda.empty_cache()
    base = _allocated(context)
    config = model_config(context)
    torch.manual_seed(0)
    model = TinyGPT(config).to(device=context.device, dtype=torch.bfloat16)
    model_bytes = _allocated(context) - base
    if context.cuda:
        torch.cuda.reset_peak_memory_stats(context.device)
    built_from = _allocated(context)
    engine = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, param_dtype=torch.bfloat16, lr=1e-4)
    built = _allocated(context)
    construction_peak = torch.cuda.max_memory_allocated(context.device) if context.cuda else 0
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size + 1)).to(context.device)
    engine.backward(model(tokens[:, :-1], tokens[:, 1:]))
    engine.step()
    engine.zero_grad()
    stepped = _allocated(context)
    expected = formula(engine, stage)
    report = engine.memory_report()
    counted = {
        "params": report.param_buffer_bytes,
        "masters": report.master_bytes,
        "optimizer": report.optimizer_state_bytes,
        "gradients": report.gradient_bytes,
        "buckets": report.bucket_pool_bytes,
    }
    for kind, value in counted.items():
        result.figure(f"{tag}_{kind}_bytes", value)
        result.figure(f"{tag}_{kind}_formula_bytes", expected[kind])
        result.figure(f"{tag}_{kind}_excess_bytes", abs(value - expected[kind]))
        slack = 16 * len(engine.buffers) if kind == "params" else 0  # aligned_zeros' start slack
        result.compare(f"{tag}_{kind}", f"{tag}_{kind}_excess_bytes", "<=", slack, "tensor bytes = formula")
    if not context.cuda:
        result.skipped[f"{tag}_allocator"] = "no CUDA allocator on the CPU"
        return
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # Blocks a phase allocates or frees: the model's tensors (moved in, then freed when the
    # flat buffer takes their values), and per layout group a buffer, a master, two
    # gradient tensors and two of Adam state; a few more for what the step leaves.
    blocks = len(list(model.parameters())) + len(list(model.buffers())) + 6 * len(engine.buffers) + 4
    tolerance = ALLOCATOR_ROUNDING * blocks + SMALL_TENSORS
    phases = {  # allocator growth of each phase, and what the formula says it adds
        "model": (model_bytes, 2 * sum(g.param_numel for g in engine.layout.groups) + buffers),
        "engine": (built - built_from, expected["params"] - 2 * sum(g.param_numel for g in engine.layout.groups)
                   + expected["masters"] + expected["gradients"]),
        "first_step": (stepped - built, expected["optimizer"] + expected["buckets"]),
    }  # fmt: skip
    for phase, (measured, predicted) in phases.items():
        result.figure(f"{tag}_allocated_{phase}_bytes", measured)
        result.figure(f"{tag}_allocated_{phase}_formula_bytes", predicted)
        result.figure(f"{tag}_allocated_{phase}_excess_bytes", abs(measured - predicted))
        result.compare(
            f"{tag}_allocated_{phase}", f"{tag}_allocated_{phase}_excess_bytes", "<=", tolerance,
            f"512-byte rounding of {blocks} blocks + 64 KiB of scalars",
        )  # fmt: skip
    initial_values = 4 * sum(g.numel for g in engine.layout.groups)  # the fp32 values the masters start from
    result.figure(f"{tag}_construction_peak_bytes", construction_peak - built_from)
    result.figure(f"{tag}_construction_peak_formula_bytes", built - built_from + initial_values)
    result.figure(f"{tag}_total_bytes", stepped - base)
    result.figure(f"{tag}_total_formula_bytes", sum(expected.values()) + buffers)
    del engine, model


def run(context: Context) -> CheckResult:
    result = CheckResult("memory")
    for stage in (1, 2):
        _measure_stage(context, result, stage)
    return result
