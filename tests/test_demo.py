"""The main job end to end: `zeroshard demo`, spawned and under torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


def test_demo_trains_resumes_at_another_world_size_and_exports_exactly(tmp_path):
    result = _run([str(BIN / "zeroshard"), "demo", "--steps", "8", "--out", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "load it at D=3 (resharded)" in out
    # the resume's attestation: every parameter's master and Adam states, as saved at D=2
    assert re.search(r"zeroshard demo: resumed at D=3: attested: \d+ digests of 28 parameters match the digests saved in ", out)
    saves = re.findall(r"saved (step-\d+): training stalled [\d.]+ ms, written in the background in [\d.]+ ms", out)
    assert saves == ["step-00000003", "step-00000007"]  # the last step of each phase
    assert re.search(r"28 of 28 parameters bit-for-bit equal to the live fp32 masters", out)
    assert "28 of 28 parameters start on a 16-byte boundary" in out
    assert (tmp_path / "universal" / "universal.json").is_file()
    assert (tmp_path / "fp32" / "model.safetensors").is_file()


def test_demo_phase_under_torchrun_saves_then_resumes(tmp_path):
    command = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(BIN / "zeroshard"), "demo", "--steps", "4", "--out", str(tmp_path)]
    first = _run(command)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "D=2 (gloo)" in first.stdout
    second = _run(command)  # finds the checkpoint and resumes from it
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" not in first.stdout
    assert f"resumed from {tmp_path / 'checkpoints' / 'step-00000001'} at step 2" in second.stdout, "and says so"
    assert "zeroshard demo: resumed at D=2: attested: " in second.stdout
    # An exit that aborted (the process group torn down at interpreter shutdown) said so here.
    assert "terminate called" not in first.stderr + second.stderr
    tags = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert tags == ["step-00000001", "step-00000003"]  # saved after steps 1 and 3
