"""examples/train.py, as a user runs it: torchrun at 2 ranks, then resumed at 1 rank."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
STEP_LINE = re.compile(r"^step (\d+) loss ([\d.]+) lr ([\d.]+)$", re.MULTILINE)


def _example():
    spec = importlib.util.spec_from_file_location("example_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torchrun(ranks: int, out: Path, steps: int) -> subprocess.CompletedProcess:
    command = [
        str(TORCHRUN),
        "--standalone",
        "--nproc_per_node",
        str(ranks),
        str(SCRIPT),
        "--out",
        str(out),
        "--steps",
        str(steps),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "terminate called" not in done.stderr
    return done


def test_train_example_runs_at_two_ranks_and_resumes_at_one(tmp_path):
    example = _example()
    first = _torchrun(2, tmp_path, 10)
    second = _torchrun(1, tmp_path, 20)
    assert "no checkpoint under" in first.stderr and "training from step 0 on 2 ranks" in first.stderr
    assert f"resumed from {tmp_path / 'checkpoints' / 'step-00000009'}: training goes on at step 10" in second.stderr

    steps = [(int(s), float(loss), lr) for s, loss, lr in STEP_LINE.findall(first.stderr + second.stderr)]
    assert [s for s, _, _ in steps] == list(range(20)), "each step logged once, by rank 0"
    # The lr schedule was saved and restored across the change of world size: the lr of every
    # step, printed to 8 decimals, is the schedule's at that step.
    assert [lr for _, _, lr in steps] == [f"{3e-3 * example.lr_factor(s, 5, 40):.8f}" for s in range(20)]
    losses = [loss for _, loss, _ in steps]
    assert sum(losses[-5:]) < sum(losses[:5]) - 0.5, losses  # it learns (about ln 10 = 2.30 at the start)

    export = tmp_path / "model" / "model.safetensors"
    assert f"exported {tmp_path / 'checkpoints' / 'step-00000019'} to {tmp_path / 'model'}" in second.stderr
    with safe_open(str(export), framework="pt") as exported:
        assert sorted(exported.keys()) == sorted(example.MLP().state_dict())
        assert all(exported.get_tensor(name).dtype == torch.float32 for name in exported.keys())
    tags = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert tags == ["step-00000014", "step-00000019"], "keep_last=2"
