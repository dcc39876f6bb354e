"""What the parts of gpu_check.py share: the run's settings, verdicts, timers, error bounds."""

from __future__ import annotations

import math
import operator
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# Unit roundoffs (round to nearest): half the distance from 1 to the next number.
U_FP32 = 2.0**-24
U_BF16 = 2.0**-8
U_FP16 = 2.0**-11
UNIT_ROUNDOFF = {torch.float32: U_FP32, torch.bfloat16: U_BF16, torch.float16: U_FP16}

_OPS: dict[str, Callable[[float, float], bool]] = {"<=": operator.le, ">=": operator.ge, "==": operator.eq}


@dataclass
class Context:
    """Where the checks run and how big they are."""

    device: torch.device
    size: str  # "full" (a GPU) or "small" (the CPU test)
    workdir: str  # a scratch directory for checkpoints
    deepspeed: bool = True  # try DeepSpeed in the step-time check

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


@dataclass
class CheckResult:
    """One check's figures (numbers), its verdicts (comparisons of figures with limits),
    what it skipped and why, and free-text notes."""

    name: str
    figures: dict[str, float] = field(default_factory=dict)
    verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def figure(self, key: str, value: float) -> float:
        """Record a figure. One that is not a finite number (a ratio of no samples, say) is
        listed under ``skipped`` instead, so the report holds numbers only."""
        value = float(value)
        if math.isfinite(value):
            self.figures[key] = value
        else:
            self.skipped[key] = f"not a finite number ({value})"
        return value

    def compare(self, key: str, figure: str, op: str, limit: float, why: str) -> bool:
        """Verdict ``key``: ``figures[figure] op limit``; ``why`` says where the limit comes from.
        Without that figure there is no verdict (the figure's entry in ``skipped`` says why)."""
        if figure not in self.figures:
            self.skipped[key] = f"no figure {figure}"
            return False
        value = self.figures[figure]
        ok = bool(_OPS[op](value, limit))
        self.verdicts[key] = {"figure": figure, "value": value, "op": op, "limit": float(limit), "ok": ok, "why": why}
        return ok

    @property
    def ok(self) -> bool:
        return all(v["ok"] for v in self.verdicts.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "figures": self.figures,
            "verdicts": self.verdicts,
            "skipped": self.skipped,
            "notes": self.notes,
        }


def gamma(n: int, unit: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the first-order bound on the relative error of
    n rounded operations in a chain (a sum of n terms, say)."""
    if n * unit >= 1:
        raise ValueError(f"gamma undefined for n={n}, u={unit}")
    return n * unit / (1 - n * unit)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """||value - reference|| / ||reference|| in float64, on the CPU."""
    value, reference = value.detach().double().cpu(), reference.detach().double().cpu()
    scale = reference.norm().item()
    return (value - reference).norm().item() / scale if scale else (value - reference).norm().item()


class StepTimer:
    """Times a callable: CUDA events on a GPU (the kernels' time, launch included), else
    perf_counter. Returns seconds."""

    def __init__(self, context: Context) -> None:
        self.cuda = context.cuda

    def __call__(self, work: Callable[[], Any]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            work()
            return time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        work()
        end.record()
        torch.cuda.synchronize()  # all streams: nothing the work left running spills into the next timing
        return begin.elapsed_time(end) / 1e3


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
