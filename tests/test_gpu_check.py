"""benchmarks/gpu_check.py: its --cpu mode runs every check and writes a report whose
figures are numbers and whose verdicts are the comparisons they claim to be."""

from __future__ import annotations

import json
import math
import operator
import os
import subprocess
import time
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
CHECKS = ["engine_equal", "grouped_mm", "checkpointer", "memory", "step_time"]
OPS = {"<=": operator.le, ">=": operator.ge, "==": operator.eq}


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory) -> tuple[int, dict, str]:
    out = tmp_path_factory.mktemp("gpu_check") / "report.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--cpu", "--no-deepspeed", "--json", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert out.is_file(), done.stdout[-2000:] + done.stderr[-4000:]
    return done.returncode, json.loads(out.read_text()), done.stdout


def test_every_check_runs_and_reports_numbers(cpu_report):
    returncode, report, stdout = cpu_report
    assert returncode in (0, 1), stdout  # 1: a goal missed (the timing goals are a GPU's); never a crash
    assert [check["name"] for check in report["checks"]] == CHECKS
    assert (report["backend"], report["size"], report["device"], report["complete"]) == ("gloo", "small", "cpu", True)
    for check in report["checks"]:
        assert not check["crashed"], check["notes"]
        assert check["figures"] and check["verdicts"], check["name"]
        for key, value in check["figures"].items():
            assert isinstance(value, float) and math.isfinite(value), (check["name"], key)
        assert sum(line.startswith(check["name"]) for line in stdout.splitlines()) == 1  # one line per check


def test_each_verdict_is_the_comparison_it_states(cpu_report):
    returncode, report, _ = cpu_report
    for check in report["checks"]:
        for key, verdict in check["verdicts"].items():
            assert verdict["value"] == check["figures"][verdict["figure"]], key
            assert verdict["ok"] == OPS[verdict["op"]](verdict["value"], verdict["limit"]), key
        assert check["ok"] == all(v["ok"] for v in check["verdicts"].values())
    assert report["ok"] == all(check["ok"] for check in report["checks"])
    assert returncode == (0 if report["ok"] else 1)


def test_cpu_figures_that_do_not_depend_on_a_gpu(cpu_report):
    """What the CPU can decide: the engine's arithmetic and alignment, grouped_mm against
    the per-expert loop, the rule check's verdict on the compact copy, and tensor bytes
    against the formula, kind by kind."""
    _, report, _ = cpu_report
    checks = {check["name"]: check for check in report["checks"]}
    for name in ("engine_equal", "grouped_mm", "memory"):
        assert checks[name]["ok"], checks[name]["verdicts"]
    grouped = checks["grouped_mm"]
    assert grouped["figures"]["compact_view_address_mod_16"] != 0
    assert grouped["figures"]["compact_refused"] == 0.0  # the CPU kernel does not check
    assert "cuda_refuses_compact" in grouped["skipped"] and "cuda_refuses_compact" not in grouped["verdicts"]
    engine = checks["engine_equal"]
    assert len([k for k in engine["verdicts"] if k.endswith("_masters")]) == 4  # 2 stages x 2 dtypes
    assert [engine["figures"][f"stage{s}_{d}_steps_skipped"] for s in (1, 2) for d in ("bfloat16", "float16")] == [0, 2, 0, 2]
    memory = checks["memory"]["figures"]
    assert memory["stage1_gradients_bytes"] == 2 * memory["stage1_masters_bytes"]  # D=1: partition + full accumulator
    assert memory["stage2_optimizer_bytes"] == 2 * memory["stage2_masters_bytes"]  # AdamW: two fp32 states


def test_without_a_gpu_and_without_cpu_flag_it_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_check
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--json", str(tmp_path / "r.json")]) == 2
    assert "--cpu" in capsys.readouterr().err and not (tmp_path / "r.json").exists()


def test_a_verdict_without_its_figure_is_skipped_not_made(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from gpu_check_common import CheckResult

    result = CheckResult("x")
    result.figure("ratio", float("nan"))
    assert result.compare("goal", "ratio", "<=", 1.0, "why") is False
    assert "ratio" not in result.figures and set(result.skipped) == {"ratio", "goal"} and not result.verdicts
    result.figure("error", 2.0)
    assert result.compare("bound", "error", "<=", 1.0, "why") is False and not result.ok


def test_the_compact_probe_runs_in_a_child_process(monkeypatch):
    """The path CUDA takes (a spawned process, so a kernel fault cannot end the run), on the
    CPU: the copy sits 2 bytes past a 16-byte boundary, the rule check says so, and the CPU
    kernel runs it without complaint."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import torch
    from gpu_check_moe import compact_probe_in_child

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(BENCHMARKS), str(ROOT / "src")]))
    weight = torch.randn(4, 32, 48).to(torch.bfloat16)
    assert compact_probe_in_child(weight, "cpu") == {"address_mod_16": 2, "rule_check_aligned": False, "error": ""}


class _WallClockEvent:
    """torch.cuda.Event's timing calls, on the wall clock."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: "_WallClockEvent") -> float:
        return (end.at - self.at) * 1e3


def test_the_cuda_only_branches_run(monkeypatch, tmp_path):
    """The code that only a GPU run reaches (events, pinned buffers, the allocator's readings,
    the compact refusal's verdict), run on the CPU with torch.cuda's calls stood in for, so
    that it does not rot between GPU runs. The readings are fake; what is checked is that
    every CUDA-only figure and verdict is produced."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import torch
    import torch.distributed as dist

    import gpu_check_checkpoint
    import gpu_check_common
    import gpu_check_memory
    import gpu_check_moe
    import gpu_check_step
    from zeroshard.launch import import_group_binding_modules

    allocated = iter(range(0, 1 << 40, 4096))
    real_empty = torch.empty
    for name, stand_in in {
        "Event": _WallClockEvent, "synchronize": lambda *a, **k: None, "empty_cache": lambda: None,
        "memory_allocated": lambda *a: next(allocated), "max_memory_allocated": lambda *a: next(allocated),
        "reset_peak_memory_stats": lambda *a: None,
    }.items():  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, stand_in)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    monkeypatch.setattr(gpu_check_common.Context, "cuda", property(lambda self: True))
    monkeypatch.setattr(gpu_check_moe, "compact_probe_in_child", lambda weight, device: gpu_check_moe.compact_probe(weight, "cpu"))
    import_group_binding_modules()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        context = gpu_check_common.Context(torch.device("cpu"), "small", str(tmp_path), deepspeed=False)
        results = {module.__name__: module.run(context) for module in (gpu_check_moe, gpu_check_checkpoint, gpu_check_memory, gpu_check_step)}
    finally:
        dist.destroy_process_group()
    moe, checkpoint, memory, step = results.values()
    assert moe.verdicts["cuda_refuses_compact"]["ok"] is False  # made, and the CPU kernel did not refuse
    assert checkpoint.figures["plain_copy_s"] > 0 and "stall_vs_copy" in checkpoint.verdicts
    for stage in (1, 2):
        for phase in ("model", "engine", "first_step"):
            assert f"stage{stage}_allocated_{phase}" in memory.verdicts
        assert f"stage{stage}_construction_peak_bytes" in memory.figures
    assert step.figures["engine_step_ms"] > 0 and step.figures["floor_step_ms"] > 0
