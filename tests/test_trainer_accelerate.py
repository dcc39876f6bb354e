"""prepare_zeroshard (zeroshard.integrations.accelerate) as a user runs it: the example at 2
ranks against the bare zeroshard loop, every rank's state in save_state's folder, a
load_state at 1 rank; and what it refuses."""

from __future__ import annotations

import re
import shutil

import pytest

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[accelerate]')")
pytest.importorskip("transformers", reason="the example's model is transformers' GPT-2")

import trainer_workers  # noqa: E402
from zeroshard.integrations.saves import FolderSaves  # noqa: E402
from zeroshard.launch import spawn  # noqa: E402

STEPS = 4  # save_state at steps 2 and 4
STEP_LINE = re.compile(r"^step (\d+) loss (\S+) grad_norm", re.MULTILINE)


def test_accelerate_matches_the_bare_loop_saves_every_rank_and_loads_at_one(tmp_path):
    out = tmp_path / "run"
    results = spawn(trainer_workers.accelerate_run, 2, (str(out), STEPS), timeout_s=600)
    bare, logged = results[0]["bare"], results[0]["accelerate"]
    # Bit for bit at the same world size: the same engine, rows, optimizer and schedule; the
    # loss divided by 1 accumulation step; the lr schedule stepped twice (once per process)
    # over twice the steps is the same linear decay.
    assert len(logged) == len(bare) == STEPS
    assert max(abs(a - b) for a, b in zip(logged, bare)) == 0.0, (logged, bare)

    folder = out / "checkpoint-4"
    assert sorted(p.name for p in (folder / "zeroshard").glob("rank-*")) == [
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    ]
    assert not (folder / "model.safetensors").exists(), "no rank-0 copy of the weights beside the shards"
    engine = trainer_workers.bare_engine(fused=False)  # world size 1, as the example builds it
    FolderSaves(engine).load(folder)
    assert trainer_workers.state_difference(engine, results[0]["state"]) == 0.0

    # load_state of checkpoint-2 at 1 rank (2 micro-batches per step): the first step after it
    # runs the loaded weights on the same 8 rows, so its loss is bit for bit the 2-rank run's.
    shutil.rmtree(folder)
    done = trainer_workers.torchrun(1, "examples/trainer_accelerate.py", "--out", str(out), "--steps", str(STEPS))
    resumed = {int(step): float(loss) for step, loss in STEP_LINE.findall(done.stdout)}
    assert sorted(resumed) == [3, 4], done.stdout[-2000:]
    assert resumed[3] - logged[2] == 0.0
