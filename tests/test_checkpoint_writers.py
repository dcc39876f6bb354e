"""One writer per checkpoint root and per conversion output: the lock, and writers racing.

Two processes saving into one root (a requeued job racing its predecessor) used to both
report success while each deleted the other's live staging directory; two conversions into
one OUT failed with a raw ENOENT on a ``.tmp-`` path. Now the second writer is refused with
an error naming the first, and everything published verifies.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from universal_helpers import save_synthetic

import zeroshard
from zeroshard.checkpoint import (
    list_tags,
    open_checkpoint,
    resolve_checkpoint,
    run_ranks,
    save_sharded,
    verify_checkpoint,
)
from zeroshard.checkpoint.export.fp32 import to_fp32
from zeroshard.checkpoint.output_dir import output_lock
from zeroshard.checkpoint.testing import synthesize_state
from zeroshard.checkpoint.universal.write import to_universal
from zeroshard.io.writer_lock import WriterLock, WriterLockedError
from zeroshard.cli.main import main
from zeroshard.layout import ParamSpec, build_layout

LAYOUT = build_layout([[ParamSpec.of("a", (7, 5), "bf16"), ParamSpec.of("b", (13,), "bf16")]], 2)
WORKERS = Path(__file__).with_name("writer_workers.py")
HOLDER = f"held by pid {os.getpid()} on host {socket.gethostname()} since "


def save_at(root: Path, tag: str) -> list:
    return run_ranks(
        2,
        lambda c: save_sharded(root, tag, synthesize_state(LAYOUT, c.rank), coordinator=c, block_size=128),
        return_exceptions=True,
    )


# ---- the lock ---------------------------------------------------------------------------------


def test_a_held_lock_refuses_a_second_writer_naming_the_holder(tmp_path):
    path = tmp_path / ".lock"
    with WriterLock(path, "saving tag 'a'"):
        record = json.loads(path.read_text())
        assert record["pid"] == os.getpid() and record["what"] == "saving tag 'a'"
        with pytest.raises(WriterLockedError) as info:
            WriterLock(path, "saving tag 'b'").acquire()
        message = str(info.value)
        assert message.startswith(f"{path}: {HOLDER}")
        assert "(saving tag 'a'); refusing to start saving tag 'b': one writer at a time" in message
    assert not path.exists(), "the lock file goes with its holder"
    with WriterLock(path, "saving tag 'b'") as again:
        assert again.held


def test_a_bounded_wait(tmp_path):
    path = tmp_path / ".lock"
    first = WriterLock(path, "first").acquire()
    started = time.monotonic()
    with pytest.raises(WriterLockedError):
        WriterLock(path, "second", wait=0.3).acquire()
    assert time.monotonic() - started >= 0.3
    threading.Timer(0.2, first.release).start()
    with WriterLock(path, "second", wait=10) as second:
        assert second.held and json.loads(path.read_text())["what"] == "second"


def test_the_lock_of_a_killed_holder_is_reclaimed(tmp_path):
    path = tmp_path / ".lock"
    script = (
        "import sys, time; from pathlib import Path; from zeroshard.io.writer_lock import WriterLock; "
        f"WriterLock(Path({str(path)!r}), 'saving tag \\'old\\'').acquire(); print('held', flush=True); time.sleep(120)"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(WriterLockedError, match=f"held by pid {child.pid} on host"):
            WriterLock(path, "saving tag 'new'").acquire()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert json.loads(path.read_text())["pid"] == child.pid, "a dead holder leaves its file behind"
    with WriterLock(path, "saving tag 'new'") as lock:
        assert lock.held and json.loads(path.read_text())["pid"] == os.getpid()


# ---- saves --------------------------------------------------------------------------------------


def test_a_save_into_a_locked_root_fails_on_every_rank_and_spares_the_live_staging(tmp_path):
    live = tmp_path / ".t.tmp-0123456789ab"  # the other job's save in progress
    live.mkdir()
    (live / "rank-00000-of-00002.safetensors").write_bytes(b"being written")
    with WriterLock(tmp_path / ".lock", "saving tag 't'"):
        results = save_at(tmp_path, "u")
    assert all(isinstance(r, WriterLockedError) for r in results), results
    assert len({str(r) for r in results}) == 1 and HOLDER in str(results[0])
    assert str(results[0]).startswith("checkpoint save refused: ")
    assert live.is_dir() and list_tags(tmp_path) == []
    # The holder is gone: its staging directory is a dead save's, cleaned by the next save.
    assert save_at(tmp_path, "u")[0] == tmp_path / "u"
    assert not live.exists() and not (tmp_path / ".lock").exists()


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(zeroshard.__file__).parents[1]), env.get("PYTHONPATH", "")])
    return env


def race(mode: str, first: Path, seconds: float, tmp_path: Path) -> list[dict]:
    """Run two workers of ``mode`` at once; their reports."""
    go = tmp_path / "go"
    names = ["a", "b"] if mode == "save" else [str(tmp_path / "out")] * 2
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKERS), mode, str(first), name, str(seconds), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for name in names
    ]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("go.ready-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    go.touch()
    reports = []
    for worker in workers:
        out, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def check_race(reports: list[dict]) -> None:
    """No error but refusals; each refusal names the other worker; both wrote; they met."""
    for report, other in zip(reports, reversed(reports)):
        assert report["failed"] == [], report["failed"][:3]
        assert report["done"], "each worker published at least once"
        for message in report["refused"]:
            assert f"held by pid {other['pid']} on host " in message, message
    assert sum(len(r["refused"]) for r in reports) > 0, "the workers never met"


def test_a_root_rank_0_cannot_create_fails_the_save_on_every_rank(tmp_path):
    """Rank 0 makes the root and takes its lock; an error there must reach rank 1 as the
    same error, not leave it waiting in the broadcast (run_ranks turns a wait on a rank that
    raised alone into RankFailedError)."""
    (tmp_path / "a-file").write_text("not a directory")
    outcomes = save_at(tmp_path / "a-file" / "ckpt", "t")
    assert [type(error) for error in outcomes] == [OSError, OSError], outcomes
    assert all("checkpoint save failed on rank 0" in str(error) for error in outcomes), outcomes
    assert all("a-file" in str(error) for error in outcomes), outcomes


def test_two_save_loops_into_one_root_publish_only_intact_checkpoints(tmp_path):
    root = tmp_path / "root"
    reports = race("save", root, 2.5, tmp_path)
    check_race(reports)
    published = sorted(tag for report in reports for tag in report["done"])
    assert list_tags(root) == published
    for tag in published:
        assert verify_checkpoint(open_checkpoint(root / tag)) == [], tag
    assert resolve_checkpoint(root).name in published
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == [], "no staging or lock left"
    assert main(["inspect", "--verify", str(root)]) == 0


# ---- conversions ------------------------------------------------------------------------------


def test_a_conversion_into_a_locked_output_is_refused_with_one_line(tmp_path):
    source = save_synthetic(tmp_path / "ck", LAYOUT, block_size=64)
    out = tmp_path / "out"
    live = tmp_path / ".out.tmp-0123456789ab"  # a live conversion's staging directory
    live.mkdir()
    with output_lock(out, "universal checkpoint"):
        with pytest.raises(WriterLockedError, match=HOLDER):
            to_universal(source, out, progress=False)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert main(["to-fp32", str(source), str(out), "--no-progress"]) == 2
    line = err.getvalue()
    assert line.count("\n") == 1 and HOLDER in line and "refusing to start writing a model export" in line, line
    assert live.is_dir() and not out.exists()
    to_universal(source, out, progress=False)
    assert not live.exists() and not (tmp_path / ".out.lock").exists()


def test_two_conversion_loops_into_one_output(tmp_path):
    source = save_synthetic(tmp_path / "ck", LAYOUT, block_size=64)
    reference = tmp_path / "reference"
    to_universal(source, reference / "u", progress=False)
    to_fp32(source, reference / "f", progress=False)
    reports = race("convert", source, 2.0, tmp_path)
    check_race(reports)
    out = tmp_path / "out"
    for kind in ("u", "f"):
        expected = {p.name: p.read_bytes() for p in (reference / kind).iterdir()}
        assert {p.name: p.read_bytes() for p in (out / kind).iterdir()} == expected
    assert sorted(p.name for p in out.iterdir()) == ["f", "u"], "no staging or lock left"
