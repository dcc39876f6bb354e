"""gpu_check.py, check 4: the engine's step against the bare model's, and against DeepSpeed's.

``engine_vs_deepspeed.py``'s variants at D=1 on the device: zeroshard stage 2 (bf16
parameters, fp32 masters, AdamW, clipping), the floor (the bare bf16 model's forward and
backward and torch's AdamW on one fp32 tensor of the model's size), and DeepSpeed 0.19.8
ZeRO-2 with torch's AdamW where DeepSpeed imports. Interleaved rounds in a rotating order;
the median step (forward, backward, step) of each, timed with CUDA events on a GPU.
"""

from __future__ import annotations

import importlib
import os

import torch

import engine_vs_deepspeed as evd
from gpu_check_common import CheckResult, Context, StepTimer, median
from zeroshard.models import GPTConfig

FLOOR_GOAL, DEEPSPEED_GOAL = 1.05, 0.9
FULL = GPTConfig(vocab_size=32768, block_size=512, n_layer=8, n_head=16, n_embd=1024)
SMALL = GPTConfig()
BATCH = {"full": 8, "small": 4}


def model_config(context: Context) -> GPTConfig:
    return FULL if context.size == "full" else SMALL


def _deepspeed(context: Context, config: GPTConfig, batch: int):
    """DeepSpeed's variant, or the reason it could not be made."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if context.cuda else "cpu")
    try:
        import deepspeed

        if not context.cuda:
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # gloo does it all
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
        return evd.DeepSpeedVariant(1, config, batch, str(context.device)), None
    except Exception as err:  # noqa: BLE001 - reported, the other variants still run
        return None, f"{type(err).__name__}: {str(err)[:200]}"


def _batch(config: GPTConfig, batch: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1), generator=torch.Generator().manual_seed(step))
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _one_step(variant, idx: torch.Tensor, targets: torch.Tensor) -> None:
    variant.backward(variant.forward(idx, targets))
    variant.step()


def _time_rounds(context: Context, variants: dict, config: GPTConfig, batch: int, result: CheckResult) -> dict:
    """Step times (s) per variant: one warm-up round, then interleaved rounds in a rotating
    order. A DeepSpeed step that fails drops DeepSpeed (noted in ``skipped``), not the others."""
    rounds, steps = (6, 4) if context.size == "full" else (2, 2)
    timer = StepTimer(context)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(rounds + 1):
        names = list(times)
        for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
            for step in range(steps):
                idx, targets = _batch(config, batch, round_index * steps + step, context.device)
                try:
                    elapsed = timer(lambda: _one_step(variants[name], idx, targets))
                except Exception as err:  # noqa: BLE001 - the engine and the floor are still timed
                    if name != "deepspeed":
                        raise
                    result.skipped["deepspeed"] = f"its step failed: {type(err).__name__}: {str(err)[:200]}"
                    del times[name]
                    break
                if round_index:
                    times[name].append(elapsed)
    result.notes.append(f"{rounds} rounds x {steps} steps after one warm-up round")
    return times


def run(context: Context) -> CheckResult:
    result = CheckResult("step_time")
    config, batch = model_config(context), BATCH[context.size]
    device = str(context.device)
    variants = {
        "engine": evd.ZeroshardVariant(torch.float32, model_config=config, device=device),
        "floor": evd.FloorVariant(1, config, device),
    }
    if context.deepspeed:
        variant, reason = _deepspeed(context, config, batch)
        if variant is not None:
            variants["deepspeed"] = variant
        else:
            result.skipped["deepspeed"] = reason
    else:
        result.skipped["deepspeed"] = "--no-deepspeed"
    times = _time_rounds(context, variants, config, batch, result)
    params = sum(p.numel() for p in variants["engine"].model.parameters())
    result.figure("params", params)
    for name, values in times.items():
        result.figure(f"{name}_step_ms", 1e3 * median(values))
    result.figure("engine_per_floor", result.figures["engine_step_ms"] / result.figures["floor_step_ms"])
    result.compare("engine_vs_floor", "engine_per_floor", "<=", FLOOR_GOAL, "goal: within 1.05x the bare model + AdamW")
    if "deepspeed" in times:
        result.figure("engine_per_deepspeed", result.figures["engine_step_ms"] / result.figures["deepspeed_step_ms"])
        result.compare("engine_vs_deepspeed", "engine_per_deepspeed", "<=", DEEPSPEED_GOAL, "goal: at most 0.9x DeepSpeed")
    result.notes.append(f"TinyGPT {config}, batch {batch}")
    return result
