"""Where a conversion stages its output: an OUT below a loop of links is one line, exit 2; an
OUT that is a mount point is staged on its own file system and published into it (issue 28,
M9 and M10)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from universal_helpers import save_synthetic

from zeroshard.checkpoint.output_dir import OutputKind, staged_output
from zeroshard.cli.main import main
from zeroshard.layout import ParamSpec, build_layout

LAYOUT = build_layout([[ParamSpec.of("a", (7, 5), "bf16"), ParamSpec.of("b", (13,), "bf16")]], 2)
SRC = Path(__file__).resolve().parents[1] / "src"
KIND = OutputKind("test output", r"part-\d|done", ("done",))


@pytest.fixture
def ckpt(tmp_path) -> Path:
    save_synthetic(tmp_path / "ck", LAYOUT, tag="t", block_size=64)
    return tmp_path / "ck"


def _cli(capsys, *argv) -> tuple[int, str, str]:
    extra = ["--no-progress"] if argv[0] != "inspect" else []
    code = main([str(a) for a in argv] + extra)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _entries(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir())


# ---- M9: an OUT below a loop of symbolic links -----------------------------------------------------


@pytest.mark.parametrize("command", ["to-fp32", "to-universal"])
def test_an_output_below_a_loop_of_links_is_one_line_exit_2(ckpt, tmp_path, capsys, command):
    (tmp_path / "loop").symlink_to("loop")
    before = _entries(tmp_path)
    for out in (tmp_path / "loop" / "out", tmp_path / "loop"):
        code, _, err = _cli(capsys, command, ckpt, out)
        assert code == 2 and err.count("\n") == 1 and "internal error" not in err, err
        assert f"error: {out}: {os.strerror(errno.ELOOP)}" in err, err
    assert _entries(tmp_path) == before


# ---- M10: an OUT that is a mount point -------------------------------------------------------------


@pytest.fixture
def mount_point(tmp_path, monkeypatch) -> Path:
    """An empty directory that behaves as a mount point: os.path.ismount says so, and no
    directory can be renamed over it or moved away (EBUSY, as Linux answers)."""
    point = tmp_path / "volume"
    point.mkdir()
    real_ismount, real_rename = os.path.ismount, os.rename

    def ismount(path) -> bool:
        return Path(path) == point or real_ismount(path)

    def rename(src, dst, **kwargs) -> None:
        if point in (Path(src), Path(dst)):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(src), None, str(dst))
        real_rename(src, dst, **kwargs)

    monkeypatch.setattr(os.path, "ismount", ismount)
    monkeypatch.setattr(os, "rename", rename)
    return point


def test_a_mount_point_is_staged_inside_itself_and_published_into_it(mount_point):
    with staged_output(mount_point, kind=KIND, overwrite=False) as staging:
        assert staging.parent == mount_point  # on the mount's own file system, not its parent's
        for name in ("part-1", "part-2", "done"):
            (staging / name).write_text(name)
    assert _entries(mount_point) == ["done", "part-1", "part-2"]
    assert [name for name in _entries(mount_point.parent) if name.startswith(".")] == []


@pytest.mark.parametrize("command, marker", [("to-fp32", "model.safetensors"), ("to-universal", "universal.json")])
def test_a_conversion_into_an_empty_mount_point_works(ckpt, mount_point, capsys, command, marker):
    code, out, err = _cli(capsys, command, ckpt, mount_point)
    assert code == 0 and out.startswith(f"wrote {mount_point}:"), err
    assert marker in _entries(mount_point) and not [n for n in _entries(mount_point) if n.startswith(".")]
    assert _cli(capsys, "inspect", "--verify", mount_point)[0] == 0


def test_a_complete_output_in_a_mount_point_is_not_replaced(ckpt, mount_point, capsys):
    assert _cli(capsys, "to-universal", ckpt, mount_point)[0] == 0
    before = {name: (mount_point / name).read_bytes() for name in _entries(mount_point)}
    code, _, err = _cli(capsys, "to-universal", ckpt, mount_point, "--overwrite")
    assert code == 2 and err.count("\n") == 1 and "a mount point holding a universal checkpoint" in err, err
    assert {name: (mount_point / name).read_bytes() for name in _entries(mount_point)} == before


def test_a_failed_publish_into_a_mount_point_leaves_it_empty(mount_point):
    def fail(point: str) -> None:
        if point == "mid_publish":
            raise OSError(errno.EIO, "simulated", "x")

    output = staged_output(mount_point, kind=KIND, overwrite=False, fault=fail)
    with pytest.raises(OSError, match="simulated"), output as staging:
        for name in ("part-1", "done"):
            (staging / name).write_text(name)
    assert _entries(mount_point) == []


def test_the_next_conversion_removes_what_a_crash_left_in_a_mount_point(mount_point):
    """A conversion that died publishing: its staging directory inside OUT, one file moved in
    before the marker. Holding the lock, the next one removes both, then writes its own."""
    dead = mount_point / ".volume.tmp-0123456789ab"
    dead.mkdir()
    (dead / "done").write_text("old")
    (mount_point / "part-1").write_text("old")
    with staged_output(mount_point, kind=KIND, overwrite=False) as staging:
        (staging / "done").write_text("new")
    assert _entries(mount_point) == ["done"] and (mount_point / "done").read_text() == "new"


def test_a_mount_point_holding_something_else_is_left_alone(mount_point):
    (mount_point / ".volume.tmp-0123456789ab").mkdir()  # a staging directory: ours
    (mount_point / "notes.txt").write_text("theirs")
    output = staged_output(mount_point, kind=KIND, overwrite=True)
    with pytest.raises(FileExistsError, match="is not a test output"), output:
        pass
    assert _entries(mount_point) == ["notes.txt"]


def _can_mount() -> bool:
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "--map-root-user", "true"], capture_output=True, timeout=30, check=False
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount(), reason="no mount namespace to mount a tmpfs in")
def test_a_real_tmpfs_mount_point(ckpt, tmp_path):
    """The same, on a tmpfs mounted at OUT in a private mount namespace."""
    out = tmp_path / "volume"
    out.mkdir()
    zeroshard = f'"{sys.executable}" -m zeroshard'
    script = (
        f'mount -t tmpfs -o size=4m tmpfs "{out}" && {zeroshard} to-fp32 "{ckpt}" "{out}" --no-progress'
        f' && {zeroshard} inspect --verify "{out}" && ls -A "{out}" && ls -A "{tmp_path}"'
    )
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    command = ["unshare", "--mount", "--map-root-user", "sh", "-c", script]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environ, check=False)
    assert done.returncode == 0, done.stderr
    listed = done.stdout.splitlines()
    assert "model.safetensors" in listed and not [line for line in listed if line.startswith(".")], listed
    assert _entries(out) == []  # the tmpfs was in the namespace only
