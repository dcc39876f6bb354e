"""The Checkpointer never loses a save silently nor leaves ranks waiting (issue 18, Majors 1
and 2): an async save in flight when the script exits is finished, or the exit fails loudly;
an ``extra`` that only rank 0 cannot encode fails the save on every rank at once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import checkpointer_workers as workers
import pytest

import zeroshard
from zeroshard.checkpoint import open_checkpoint, verify_checkpoint
from zeroshard.checkpoint.directory import read_latest
from zeroshard.launch import spawn

TESTS = Path(__file__).resolve().parent
SRC = Path(zeroshard.__file__).resolve().parents[1]  # the sources this test runs on

# Saves step 0 asynchronously, slowed down at the commit so it is still in flight, and
# returns from the script without closing the Checkpointer.
SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch
    from zeroshard.checkpoint import Checkpointer
    from zeroshard.engine import ZeroOptimizer

    def fault(point, rank):
        if point == "before_manifest":
            time.sleep(1.0)
            if sys.argv[2] == "fail":
                raise OSError(28, "No space left on device", "simulated")

    engine = ZeroOptimizer(torch.nn.Linear(4, 3), torch.optim.AdamW, lr=1e-3)
    ckpt = Checkpointer(engine, sys.argv[1], fault=fault)
    ckpt.save(0)
    print("in flight at exit:", ckpt.in_flight, flush=True)
    """
)


def _run_script(root: Path, mode: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)]), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root), mode], capture_output=True, text=True, timeout=120, env=env, check=False
    )


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """Both modes of the script started at once (each is one process on one core):
    {mode: (root, future of its result)}."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        started = {}
        for mode in ("ok", "fail"):
            root = tmp_path_factory.mktemp(f"exit_{mode}")
            started[mode] = (root, pool.submit(_run_script, root, mode))
        yield started


def test_a_save_in_flight_at_exit_is_finished(scripts):
    tmp_path, future = scripts["ok"]
    done = future.result()
    assert done.returncode == 0, done.stderr
    assert "in flight at exit: True" in done.stdout
    assert read_latest(tmp_path) == "step-00000000", done.stderr
    assert verify_checkpoint(open_checkpoint(tmp_path)) == []
    assert "finishing the save of" in done.stderr and "step-00000000" in done.stderr


def test_a_save_that_fails_at_exit_fails_the_exit_loudly(scripts):
    tmp_path, future = scripts["fail"]
    done = future.result()
    assert "in flight at exit: True" in done.stdout
    assert done.returncode == 1, (done.returncode, done.stderr)
    line = done.stderr.strip().splitlines()[-1]
    assert f"checkpoint {tmp_path / 'step-00000000'} not saved" in line and "No space left on device" in line, done.stderr
    assert read_latest(tmp_path) is None and not (tmp_path / "step-00000000").exists()


# ---- an extra only rank 0 cannot encode ----------------------------------------------------------


def test_an_extra_only_rank_0_cannot_encode_fails_the_save_on_every_rank(tmp_path):
    results = spawn(workers.unencodable_extra_on_rank_0, 2, (str(tmp_path),), timeout_s=120)
    for rank, result in enumerate(results):
        # Rank 0's own reason on every rank: a rank that had waited out the Checkpointer's
        # timeout (20 s) would report the timeout instead, so no clock is needed to tell.
        assert "cannot save: rank 0: extra" in result.get("error", ""), (rank, result)
    assert read_latest(tmp_path) == "step-00000001"
