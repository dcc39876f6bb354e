"""Where a conversion stages its output: an OUT below a loop of links is one line, exit 2
(issue 28, M9)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from universal_helpers import save_synthetic

from zeroshard.cli.main import main
from zeroshard.layout import ParamSpec, build_layout

LAYOUT = build_layout([[ParamSpec.of("a", (7, 5), "bf16"), ParamSpec.of("b", (13,), "bf16")]], 2)


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
