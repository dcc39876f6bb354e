"""Checkpoints that used to be silently wrong, half-cleaned or unloadable (issue 18): each test
reproduces one measured fact and pins the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from universal_helpers import save_synthetic

from zeroshard.checkpoint import load_sharded, run_ranks, save_sharded
from zeroshard.checkpoint.native import save as save_module
from zeroshard.checkpoint.testing import expected_partition, synthesize_state
from zeroshard.checkpoint.universal import load_universal, to_universal
from zeroshard.cli.main import main
from zeroshard.layout import ParamSpec, build_layout

LAYOUT = build_layout([[ParamSpec.of("a", (7, 5), "bf16"), ParamSpec.of("b", (13,), "bf16")]], 2)


def _cli(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def _one_line(code: int, err: str, *expected: str) -> None:
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err


# ---- an optimizer state named "fp32" ----------------------------------------------------------


def _states_with_a_state_named_fp32() -> list:
    states = []
    for rank in range(2):
        state = synthesize_state(LAYOUT, rank)
        # values unlike the master's, so a reader returning the master instead is caught
        state.optimizer_states[0]["fp32"] = expected_partition(LAYOUT, rank, 0, "exp_avg") + 0.5
        states.append(state)
    return states


def test_a_state_named_fp32_is_refused_at_save_on_every_rank(tmp_path):
    states = _states_with_a_state_named_fp32()

    def one_rank(coord):
        return save_sharded(tmp_path, "t", states[coord.rank], coordinator=coord, block_size=64)

    errors = run_ranks(2, one_rank, return_exceptions=True)
    for error in errors:
        assert isinstance(error, ValueError) and "named 'fp32', the name of the fp32 master weights" in str(error)
    assert not (tmp_path / "t").exists() and not (tmp_path / "latest").exists()


def test_every_reader_refuses_a_checkpoint_with_a_state_named_fp32(tmp_path, monkeypatch, capsys):
    """A checkpoint the old code wrote: every reader handed out the master in the state's place."""
    with monkeypatch.context() as patch:
        patch.setattr(save_module, "state_name_problem", lambda name: None, raising=False)
        patch.setattr(save_module, "_combined_digests", lambda *args: None)  # version 1: no digests
        saved = save_synthetic(tmp_path / "ck", LAYOUT, states=_states_with_a_state_named_fp32(), block_size=64)
    manifest = saved / "manifest.json"
    with pytest.raises(ValueError, match=f"{manifest}: group 0: an optimizer state is named 'fp32'"):
        load_sharded(saved, LAYOUT, 0)
    for argv in (["inspect", saved], ["to-universal", saved, tmp_path / "u"], ["to-fp32", saved, tmp_path / "f"]):
        _one_line(*_cli(capsys, *argv, *(["--no-progress"] if argv[0] != "inspect" else [])), str(manifest), "'fp32'")
    assert not (tmp_path / "u").exists() and not (tmp_path / "f").exists()


def test_a_universal_checkpoint_listing_a_state_named_fp32_is_refused(tmp_path, capsys):
    universal = to_universal(save_synthetic(tmp_path / "ck", LAYOUT, block_size=64), tmp_path / "u", progress=False)
    path = universal / "universal.json"
    data = json.loads(path.read_text())
    data["params"]["a"]["states"].append("fp32")  # its tensor key is the master's: the weight map still matches
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"{path}: inconsistent manifest: parameter 'a': an optimizer state is named 'fp32'"):
        load_universal(universal, LAYOUT, 0)
    _one_line(*_cli(capsys, "to-fp32", universal, tmp_path / "f", "--no-progress"), str(path), "'fp32'")


def test_a_source_cannot_describe_a_state_named_fp32():
    from zeroshard.checkpoint.source import SourceInfo

    with pytest.raises(ValueError, match="layout group 0: an optimizer state is named 'fp32'"):
        SourceInfo(LAYOUT, "torch.optim.SGD", [], [["exp_avg", "fp32"]], [])


# ---- retention runs under the root's writer lock -------------------------------------------------


def _hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_retention_holds_the_lock_so_a_second_writer_cannot_slip_in(tmp_path, monkeypatch):
    """A second writer (a restarted duplicate job) published between the commit and the
    retention that followed it; retention then deleted the tag ``latest`` had come to name."""
    import checkpoint_workers

    from zeroshard.checkpoint import Checkpointer, SingleProcessCoordinator
    from zeroshard.checkpoint import retention as retention_module
    from zeroshard.checkpoint.directory import read_latest
    from zeroshard.io.writer_lock import WriterLockedError

    _, engine = checkpoint_workers.build(seed=0, stage=2)
    second_writer: list[object] = []
    original = retention_module.read_latest

    def read_latest_then_let_another_writer_in(root):
        tag = original(root)
        if not second_writer:
            try:
                second_writer.append(
                    save_sharded(root, "step-00000001", engine.export_state(), coordinator=SingleProcessCoordinator())
                )
            except WriterLockedError as err:
                second_writer.append(err)
        return tag

    with Checkpointer(engine, tmp_path, keep_last=3, async_save=False) as ckpt:
        ckpt.save(0)
        ckpt.save(1)
        ckpt.keep_last = 1
        # The duplicate job re-saves step 1 after this retention read `latest` (step 2).
        monkeypatch.setattr(retention_module, "read_latest", read_latest_then_let_another_writer_in)
        stats = ckpt.save(2)
    latest = read_latest(tmp_path)
    assert (tmp_path / latest / "manifest.json").is_file(), (latest, sorted(p.name for p in tmp_path.iterdir()))
    assert isinstance(second_writer[0], WriterLockedError), second_writer  # refused: retention held the lock
    assert latest == "step-00000002" and stats.deleted == ("step-00000000", "step-00000001")
    assert _hidden(tmp_path) == []


def test_retention_leaves_symlinked_tags_alone_and_reports_only_what_it_deleted(tmp_path):
    import checkpoint_workers

    from zeroshard.checkpoint import Checkpointer, list_tags
    from zeroshard.checkpoint.directory import delete_tag

    elsewhere = save_synthetic(tmp_path / "elsewhere", LAYOUT, tag="t", block_size=64)
    root = tmp_path / "root"
    root.mkdir()
    (root / "step-00000000").symlink_to(elsewhere)
    _, engine = checkpoint_workers.build(seed=0, stage=2)
    with Checkpointer(engine, root, keep_last=1, async_save=False) as ckpt:
        ckpt.save(1)
        stats = ckpt.save(2)
    assert stats.deleted == ("step-00000001",)
    assert _hidden(root) == [] and (root / "step-00000000").is_symlink()
    assert list_tags(root) == ["step-00000002"] and (elsewhere / "manifest.json").is_file()
    with pytest.raises(ValueError, match="a symbolic link, not a checkpoint directory"):
        delete_tag(root, "step-00000000")
    assert _hidden(root) == [] and (root / "step-00000000").is_symlink()


# ---- a shard group other than "dp" is an expert group ---------------------------------------------


def _moe_checkpoint(tmp_path: Path) -> Path:
    from zeroshard.layout import ExpertMesh

    experts = ExpertMesh(4, 2).expert_group([ParamSpec.of("moe.w1", (2, 3, 4), "bf16")], 4)
    layout = build_layout([[ParamSpec.of("embed", (9, 4), "bf16")], experts], 4)
    root = tmp_path / "moe"
    run_ranks(4, lambda c: save_sharded(root, "t", synthesize_state(layout, c.rank), coordinator=c, block_size=64))
    return root / "t"


def test_a_manifest_without_its_expert_map_is_refused_by_every_reader(tmp_path, capsys):
    """Without ``expert_map`` the expert group read as a dense group over expert_dp: verify and
    both converters passed and exported only EP rank 0's experts."""
    tag = _moe_checkpoint(tmp_path)
    manifest = tag / "manifest.json"
    data = json.loads(manifest.read_text())
    del data["layout"]["groups"][1]["expert_map"]
    manifest.write_text(json.dumps(data))
    expected = "group 1: shard group 'expert_dp' of 2 ranks holds no expert map"
    assert main(["inspect", str(tag), "--verify"]) == 1  # damage found
    found = capsys.readouterr().out
    assert found.count("\n") == 1 and str(manifest) in found and expected in found, found
    for argv in (["to-universal", tag, tmp_path / "u"], ["to-fp32", tag, tmp_path / "f"], ["inspect", tag]):
        _one_line(*_cli(capsys, *argv, *(["--no-progress"] if argv[0] != "inspect" else [])), str(manifest), expected)
    assert not (tmp_path / "u").exists() and not (tmp_path / "f").exists()


@pytest.mark.parametrize("edit", ["no_map", "map_too_short", "dp_with_map"])
def test_layout_json_ties_shard_groups_to_expert_maps(edit):
    from zeroshard.layout import ExpertMesh, Layout

    experts = ExpertMesh(4, 2).expert_group([ParamSpec.of("moe.w1", (2, 3, 4), "bf16")], 4)
    data = build_layout([[ParamSpec.of("embed", (9, 4), "bf16")], experts], 4).to_dict()
    group = data["groups"][1]
    if edit == "no_map":
        del group["expert_map"]
        message = "shard group 'expert_dp' of 2 ranks holds no expert map"
    elif edit == "map_too_short":
        group["expert_map"] = [[0, 1, 2, 3]]
        message = "1 expert-parallel ranks x 2 ranks per shard group is not the world size 4"
    else:
        group["shard_group"] = "dp"
        message = "shard group 'dp' is all 4 ranks, without experts"
    with pytest.raises(ValueError, match=message):
        Layout.from_dict(data)


# ---- a disk that fills at the commit --------------------------------------------------------------


def _save(root: Path, tag: str, step: int) -> list:
    def one_rank(coord):
        return save_sharded(root, tag, synthesize_state(LAYOUT, coord.rank, step=step), coordinator=coord, block_size=64)

    return run_ranks(2, one_rank, return_exceptions=True)


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


@pytest.mark.parametrize(
    "call, victim, published",
    [
        ("fsync", "manifest.json", False),  # the manifest, in the staging directory
        ("fsync", ".latest.tmp-", True),  # the new latest, written next to it
        ("replace", "latest", True),  # latest replaced
    ],
)
def test_a_disk_full_at_the_commit_leaves_nothing_behind_and_names_the_file(tmp_path, monkeypatch, call, victim, published):
    import errno

    assert not any(isinstance(r, Exception) for r in _save(tmp_path, "step1", 1))
    real = getattr(os, call)

    def full(*args, **kwargs):
        target = _fd_path(args[0]) if call == "fsync" else str(args[1])
        if Path(target).name.startswith(victim):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, call, full)
    results = _save(tmp_path, "step2", 2)
    monkeypatch.setattr(os, call, real)
    for error in results:
        assert isinstance(error, OSError) and "No space left on device" in str(error), error
        named = str(tmp_path / "latest") if victim == "latest" else str(tmp_path)
        assert named in str(error) and victim.strip(".") in str(error), error
    assert _hidden(tmp_path) == []  # no staging directory, no .latest.tmp-*
    from zeroshard.checkpoint import list_tags
    from zeroshard.checkpoint.directory import read_latest

    assert read_latest(tmp_path) == "step1"
    assert list_tags(tmp_path) == (["step1", "step2"] if published else ["step1"])
    assert load_sharded(tmp_path, LAYOUT, 0).extra["global_step"] == 1


def test_a_disk_full_in_the_model_file_names_that_file_once(tmp_path, monkeypatch):
    """The error named the rank file and then the model file's path, as if both were written."""
    import errno
    import re

    from zeroshard.io import safetensors_io

    real = safetensors_io._write_all

    def full(out, data, hasher):
        if Path(out.name).name == "model.safetensors":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(out, data, hasher)

    monkeypatch.setattr(safetensors_io, "_write_all", full)
    for error in _save(tmp_path, "step1", 1):
        assert isinstance(error, OSError), error
        staged = re.escape(str(tmp_path)) + r"/\.step1\.tmp-[0-9a-f]{12}/model\.safetensors"
        assert re.fullmatch(rf"checkpoint \S+ not saved: rank 0: {staged}: No space left on device", str(error)), error
    assert _hidden(tmp_path) == []


def test_recovery_removes_a_latest_temporary_file_a_crash_left(tmp_path):
    assert not any(isinstance(r, Exception) for r in _save(tmp_path, "step1", 1))
    (tmp_path / ".latest.tmp-0123456789ab").write_text("step9\n")  # what a death mid-replace leaves
    assert not any(isinstance(r, Exception) for r in _save(tmp_path, "step2", 2))
    assert _hidden(tmp_path) == []


# ---- FIFOs where files belong: refused, never waited on ------------------------------------------

_LOAD_SCRIPT = """
import sys, torch
from zeroshard.checkpoint import Checkpointer
from zeroshard.engine import ZeroOptimizer

engine = ZeroOptimizer(torch.nn.Linear(4, 3), torch.optim.AdamW, lr=1e-3)
with Checkpointer(engine, sys.argv[1]) as ckpt:
    try:
        ckpt.load()
    except ValueError as err:
        print("refused:", err)
"""


def test_a_fifo_named_latest_is_refused_without_waiting(tmp_path, capsys):
    import subprocess
    import sys

    os.mkfifo(tmp_path / "latest")
    import zeroshard

    src = Path(zeroshard.__file__).resolve().parents[1]  # the sources this test runs on
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert f"refused: {tmp_path / 'latest'}: not a regular file" in done.stdout
    # the converters (a root with `latest` is a native checkpoint) and inspect say so too
    code, err = _cli(capsys, "to-fp32", tmp_path, tmp_path.parent / "f", "--no-progress")
    assert code == 2 and err.count("\n") == 1, err


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_fifo_named_lock_is_refused_and_leaks_no_descriptor(tmp_path, capsys):
    from zeroshard.io.writer_lock import WriterLock

    lock = tmp_path / ".lock"
    os.mkfifo(lock)
    before = _open_descriptors()
    for _ in range(3):
        with pytest.raises(OSError, match="not a regular file, so it cannot be a writer lock; remove it"):
            WriterLock(lock, "saving").acquire()
    errors = _save(tmp_path, "t", 1)
    for error in errors:
        assert isinstance(error, OSError) and f"{lock}" in str(error) and "not a regular file" in str(error), error
    assert _open_descriptors() == before and not (tmp_path / "t").exists()
    root = save_synthetic(tmp_path / "ck", LAYOUT, block_size=64)
    os.mkfifo(tmp_path / ".out.lock")  # a conversion's lock, next to OUT
    code, err = _cli(capsys, "to-fp32", root, tmp_path / "out", "--no-progress")
    assert code == 2 and "not a regular file" in err and str(tmp_path / ".out.lock") in err, err
    assert _open_descriptors() == before


# ---- two param groups claiming one layout group -----------------------------------------------------


def test_a_layout_group_claimed_by_two_param_groups_is_refused_on_load(tmp_path, capsys):
    """It loaded with the last claimant's hyperparameters; to-universal already refused it."""
    layout = build_layout([[ParamSpec.of("a", (7, 5), "bf16")], [ParamSpec.of("b", (13,), "bf16")]], 2)
    saved = save_synthetic(tmp_path / "ck", layout, block_size=64)
    path = saved / "manifest.json"
    data = json.loads(path.read_text())
    data["optimizer"]["param_groups"][1]["layout_groups"] = [0, 1]  # group 0 also claimed by param group 1
    path.write_text(json.dumps(data))
    for options in ({}, {"load_optimizer_states": False}):
        with pytest.raises(ValueError, match=f"{saved}: layout group 0 is in param groups 0 and 1"):
            load_sharded(saved, layout, 0, **options)
    _one_line(*_cli(capsys, "to-universal", saved, tmp_path / "u", "--no-progress"), "layout group 0 is in param groups 0 and 1")
