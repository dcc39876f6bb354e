"""A Checkpointer root holding something other than its own tags is refused, never treated as
empty; ``load(warm_start=...)`` starts from a checkpoint of any kind elsewhere; every load says
where it resumed from. And a collective method called on one rank fails in one line.

Before: a root holding a universal checkpoint made ``load()`` return 0 with no word, and the run
started from scratch and saved its own tags into that folder.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from deepspeed_fixtures import deepspeed_universal_folder

from zeroshard.checkpoint import Checkpointer, CheckpointDamagedError
from zeroshard.checkpoint.export.fp32 import to_fp32
from zeroshard.checkpoint.universal import to_universal
from zeroshard.comm import CollectiveCallError
from zeroshard.engine import ZeroOptimizer
from zeroshard.launch import spawn


def make_engine() -> tuple[torch.nn.Module, ZeroOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    return model, ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2)


def train(model: torch.nn.Module, engine: ZeroOptimizer, steps: int) -> None:
    for step in range(steps):
        model(torch.randn(2, 4, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        engine.step()
        engine.zero_grad()


def snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


@pytest.fixture
def saved(tmp_path) -> Path:
    """A Checkpointer root after training steps 0-2 and saving after step 2."""
    model, engine = make_engine()
    with Checkpointer(engine, tmp_path / "ckpt", async_save=False) as ckpt:
        train(model, engine, 3)
        ckpt.save(2)
    return tmp_path / "ckpt"


@pytest.fixture
def foreign_roots(saved, tmp_path) -> dict[str, tuple[Path, str]]:
    """Folders that hold checkpoints, but not a Checkpointer's tags: (path, what the refusal says)."""
    universal = to_universal(saved, tmp_path / "universal", progress=False)
    exported = to_fp32(saved, tmp_path / "fp32", progress=False)
    return {
        "universal": (universal, "holds a zeroshard universal checkpoint, not checkpoints of the Checkpointer's own"),
        "fp32 export": (exported, "holds an fp32 export (to-fp32 output: model weights only)"),
        "tag": (saved / "step-00000002", "is a checkpoint tag, not a root of tags; give the Checkpointer its parent"),
    }


@pytest.mark.parametrize("kind", ["universal", "fp32 export", "tag"])
def test_a_root_of_another_kind_is_refused_and_left_alone(foreign_roots, kind):
    root, expected = foreign_roots[kind]
    before = snapshot(root)
    _, engine = make_engine()
    with pytest.raises(ValueError) as error:
        Checkpointer(engine, root)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"checkpoint root {root}: ") and expected in message
    assert snapshot(root) == before, "nothing written there"


def test_deepspeed_roots_are_refused(deepspeed_runs, tmp_path):
    run = deepspeed_runs["w2_s2"]
    _, engine = make_engine()
    for root in (run.save_dir, run.tag_dir, deepspeed_universal_folder(run, tmp_path)):
        with pytest.raises(
            ValueError,
            match=r"holds a DeepSpeed ZeRO stage 1/2 checkpoint, not checkpoints of the Checkpointer's own; to start from it, .*load\(warm_start=",
        ):
            Checkpointer(engine, root)


def test_a_root_with_other_files_or_nothing_is_a_root(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "train.log").write_text("x")
    _, engine = make_engine()
    with Checkpointer(engine, tmp_path) as ckpt:
        assert ckpt.load() == 0 and ckpt.resumed_from is None
    with Checkpointer(engine, tmp_path / "absent") as ckpt:
        assert ckpt.load() == 0


def test_warm_start_from_a_universal_checkpoint_then_own_checkpoints_win(foreign_roots, tmp_path, caplog):
    universal, _ = foreign_roots["universal"]
    model, engine = make_engine()
    reference, reference_engine = make_engine()
    train(reference, reference_engine, 3)
    caplog.set_level(logging.INFO, logger="zeroshard.checkpoint.checkpointer")
    with Checkpointer(engine, tmp_path / "mine", async_save=False) as ckpt:
        assert ckpt.load(warm_start=universal) == 3
        assert ckpt.resumed_from == universal
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
        train(model, engine, 1)
        ckpt.save(3)
    assert (
        f"warm start (no checkpoint in {tmp_path / 'mine'} yet) from {universal}: training goes on at step 3"
        in caplog.text
    )
    with Checkpointer(engine, tmp_path / "mine") as ckpt:
        assert ckpt.load(warm_start=universal) == 4, "its own latest, not the warm start"
        assert ckpt.resumed_from == tmp_path / "mine" / "step-00000003"
    assert f"resumed from {tmp_path / 'mine' / 'step-00000003'}: training goes on at step 4" in caplog.text


def test_an_fp32_export_is_no_warm_start(foreign_roots, tmp_path):
    exported, _ = foreign_roots["fp32 export"]
    _, engine = make_engine()
    with Checkpointer(engine, tmp_path / "mine") as ckpt:
        with pytest.raises(ValueError, match=r"an fp32 export \(to-fp32 output\) holds model weights only"):
            ckpt.load(warm_start=exported)
        assert ckpt.resumed_from is None


# ---- a root whose latest is missing, damaged, or older than its newest tag -------------------------


@pytest.fixture
def three_saves(tmp_path) -> Path:
    """A Checkpointer root saved after steps 0, 1 and 2 (latest: step 2)."""
    model, engine = make_engine()
    with Checkpointer(engine, tmp_path / "ckpt", keep_last=None, async_save=False) as ckpt:
        for step in range(3):
            train(model, engine, 1)
            ckpt.save(step)
    return tmp_path / "ckpt"


def test_a_root_whose_latest_is_missing_resumes_its_newest_checkpoint_saying_so(three_saves, caplog):
    """Before (issue 28, N1): load() returned 0 with no word, training restarted at step 0 and
    its saves replaced the tags of the same steps."""
    root = three_saves
    (root / "latest").unlink()
    before = snapshot(root)
    model, engine = make_engine()
    caplog.set_level(logging.INFO, logger="zeroshard.checkpoint.checkpointer")
    with Checkpointer(engine, root, keep_last=None, async_save=False) as ckpt:
        assert ckpt.load() == 3 and ckpt.resumed_from == root / "step-00000002"
        train(model, engine, 1)
        ckpt.save(3)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [f"{root / 'latest'} is missing; resuming the newest checkpoint, step-00000002"]
    assert f"resumed from {root / 'step-00000002'}: training goes on at step 3" in caplog.text
    after = snapshot(root)
    assert {name: size for name, size in after.items() if name in before} == before, "nothing replaced"
    assert (root / "latest").read_text() == "step-00000003\n"


def test_without_latest_a_damaged_newest_checkpoint_is_refused_or_falls_back(three_saves, caplog):
    root = three_saves
    (root / "latest").unlink()
    (root / "step-00000002" / "manifest.json").write_text("{")
    _, engine = make_engine()
    with Checkpointer(engine, root) as ckpt:
        with pytest.raises(CheckpointDamagedError, match=r"step-00000002/manifest.json: corrupted: not valid JSON"):
            ckpt.load()
    with Checkpointer(engine, root, fallback=True) as ckpt, caplog.at_level(logging.WARNING):
        assert ckpt.load() == 2 and ckpt.resumed_from == root / "step-00000001"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        "step-00000000",
        "step-00000001",
        "step-00000002.damaged",
    ]


def test_a_latest_that_names_no_tag_is_damage_the_fallback_takes(three_saves, caplog):
    root = three_saves
    (root / "latest").write_bytes(b"step-0000\xa02\n")
    _, engine = make_engine()
    with Checkpointer(engine, root) as ckpt:
        with pytest.raises(CheckpointDamagedError, match=rf"^{root / 'latest'}: holds .*, not a checkpoint tag$"):
            ckpt.load()
    with Checkpointer(engine, root, fallback=True) as ckpt, caplog.at_level(logging.WARNING):
        assert ckpt.load() == 3 and ckpt.resumed_from == root / "step-00000002"
    assert "not a checkpoint tag; resuming the newest checkpoint, step-00000002" in caplog.text


def test_a_checkpoint_newer_than_the_one_latest_names_refuses_the_resume(three_saves):
    """latest moved back by hand, or a save that stopped before moving it: resuming step 1
    would come to save step 2 again, over the checkpoint there. Before: it resumed, and the
    save replaced it."""
    root = three_saves
    (root / "latest").write_text("step-00000000\n")
    model, engine = make_engine()
    fresh = {name: value.clone() for name, value in model.state_dict().items()}
    with Checkpointer(engine, root, fallback=True) as ckpt:
        with pytest.raises(ValueError) as refused:
            ckpt.load()
        assert ckpt.resumed_from is None
    assert str(refused.value) == (
        f"checkpoint root {root}: latest names step-00000000, but newer checkpoints are there (step-00000001, "
        "step-00000002); resuming step-00000000 would save over them, which a Checkpointer never does: point "
        f"latest at the one to resume (echo step-00000002 > {root / 'latest'}), or move the newer ones out of {root}"
    )
    assert all(torch.equal(fresh[name], value) for name, value in model.state_dict().items()), "nothing loaded"


# The resume line without any logging configured (a subprocess: pytest configures logging).
RESUME_SCRIPT = """
import sys, torch
from zeroshard.checkpoint import Checkpointer, CheckpointDamagedError
from zeroshard.engine import ZeroOptimizer

engine = ZeroOptimizer(torch.nn.Linear(4, 3), torch.optim.AdamW, lr=1e-3)
with Checkpointer(engine, sys.argv[1], async_save=False) as ckpt:
    ckpt.save(0)
with Checkpointer(engine, sys.argv[1]) as ckpt:
    print("start", ckpt.load(), flush=True)
"""


def test_the_resume_line_reaches_a_user_who_configured_no_logging(tmp_path):
    """Before (issue 28, N4): it was logged at INFO only, which nobody sees by default."""
    import os
    import subprocess
    import sys

    import zeroshard

    src = Path(zeroshard.__file__).resolve().parents[1]  # the sources this test runs on
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", RESUME_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0 and done.stdout == "start 1\n", done.stderr
    assert done.stderr.startswith(
        f"zeroshard: resumed from {tmp_path / 'step-00000000'}: training goes on at step 1; "
    ), done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


# ---- on two ranks: the refusal on every rank, and a collective method called on one -------------------


def two_ranks(rank: int, world_size: int, universal: str) -> dict:
    model, engine = make_engine()
    outcome = {}
    try:
        Checkpointer(engine, universal)
    except ValueError as err:
        outcome["root"] = str(err)
    if rank == 0:
        try:
            engine.get_full_fp32_param("0.weight")  # rank 1 never calls it: it returns and leaves
        except CollectiveCallError as err:
            outcome["alone"] = str(err)
    return outcome


def test_every_rank_refuses_the_root_and_a_lone_collective_call_fails_in_one_line(foreign_roots):
    universal, expected = foreign_roots["universal"]
    outcomes = spawn(two_ranks, 2, (str(universal),), timeout_s=240)
    assert all(expected in outcome["root"] for outcome in outcomes)
    alone = outcomes[0]["alone"]
    assert "\n" not in alone and alone.startswith(
        "get_full_fp32_param('0.weight') is collective: every rank must call it, with the same arguments, "
        "but the other ranks did not join it ("
    )
