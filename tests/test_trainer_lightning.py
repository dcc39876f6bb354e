"""ZeroShardStrategy (zeroshard.integrations.lightning) as a user runs it: the example at 2
ranks against the bare zeroshard loop, every rank's state in its directory checkpoints, a
resume at 1 rank with ckpt_path=; and what it refuses."""

from __future__ import annotations

import re
import shutil

import pytest

pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[lightning]')")
pytest.importorskip("transformers", reason="the example's model is transformers' GPT-2")

import trainer_workers  # noqa: E402
from zeroshard.integrations.saves import FolderSaves  # noqa: E402
from zeroshard.launch import spawn  # noqa: E402

STEPS = 4  # 2 epochs of 2 steps, a checkpoint after each
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)$", re.MULTILINE)


def test_lightning_matches_the_bare_loop_saves_every_rank_and_resumes_at_one(tmp_path):
    out = tmp_path / "run"
    results = spawn(trainer_workers.lightning_run, 2, (str(out), STEPS), timeout_s=600)
    bare, logged = results[0]["bare"], results[0]["lightning"]
    # Bit for bit at the same world size: the same engine, rows, optimizer, schedule and clip;
    # Lightning divides the loss by 1 accumulation step, and adds no scale (bf16).
    assert len(logged) == len(bare) == STEPS
    assert max(abs(a - b) for a, b in zip(logged, bare)) == 0.0, (logged, bare)

    folder = out / "checkpoints" / "epoch=1-step=4.ckpt"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "lightning.ckpt", "zeroshard"]
    assert sorted(p.name for p in (folder / "zeroshard").glob("rank-*")) == [
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    ]
    engine = trainer_workers.bare_engine(fused=False, wrapped=True)  # world size 1, the module's names
    FolderSaves(engine).load(folder)
    assert trainer_workers.state_difference(engine, results[0]["state"]) == 0.0

    # Resume epoch=0-step=2.ckpt at 1 rank (accumulating 2 micro-batches): the first step after
    # it runs the loaded weights on the same 8 rows, so its loss is bit for bit the 2-rank run's.
    shutil.rmtree(folder)
    done = trainer_workers.torchrun(1, "examples/trainer_lightning.py", "--out", str(out), "--steps", str(STEPS))
    resumed = {int(step): float(loss) for step, loss in STEP_LINE.findall(done.stdout)}
    assert sorted(resumed) == [3, 4], done.stdout[-2000:] + done.stderr[-2000:]
    assert resumed[3] - logged[2] == 0.0

    # Outside fit (validate, test, predict with ckpt_path=) the weights come from the module
    # file, tied names included: the LightningModule takes them with strict=True.
    from zeroshard.integrations.lightning import _module_state

    step2 = out / "checkpoints" / "epoch=0-step=2.ckpt"
    module = trainer_workers.example("trainer_lightning").TinyLM(None)
    weights = _module_state(step2 / "zeroshard", module.state_dict())
    module.load_state_dict(weights, strict=True)
    assert module.model.lm_head.weight.data_ptr() == module.model.transformer.wte.weight.data_ptr()
    FolderSaves(engine).load(step2)  # the same checkpoint through the engine: its bf16 parameters
    loaded = engine.model.state_dict()
    assert sorted(weights) == sorted(loaded)
    assert max(float((weights[name] - loaded[name]).abs().max()) for name in weights) == 0.0
