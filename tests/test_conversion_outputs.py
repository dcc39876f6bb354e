"""What a conversion may replace, and that everything zeroshard writes opens with the real
safetensors library (issue 18: Critical 7, Major 3 and the output Minors)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from universal_helpers import save_synthetic

from zeroshard.checkpoint import open_checkpoint, verify_checkpoint
from zeroshard.checkpoint.export.fp32 import to_fp32
from zeroshard.checkpoint.universal import to_universal
from zeroshard.cli.main import main
from zeroshard.layout import ParamSpec, build_layout

LAYOUT = build_layout([[ParamSpec.of("a", (7, 5), "bf16"), ParamSpec.of("b", (13,), "bf16")]], 2)


def _cli(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv] + ["--no-progress"])
    return code, capsys.readouterr().err


def _refused(capsys, *argv, expected: str) -> None:
    code, err = _cli(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and expected in err, err


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def root(tmp_path) -> Path:
    """A checkpoint root with tags t1 and t2 (latest)."""
    save_synthetic(tmp_path / "ck", LAYOUT, tag="t1", block_size=64)
    save_synthetic(tmp_path / "ck", LAYOUT, tag="t2", block_size=64)
    return tmp_path / "ck"


# ---- --overwrite replaces only an output of the same kind, never the input ----------------------


@pytest.mark.parametrize("command", ["to-fp32", "to-universal"])
def test_overwrite_never_replaces_a_checkpoint_tag(root, capsys, command):
    """Every native tag holds model.safetensors: an export onto another tag deleted it."""
    before = _snapshot(root)
    _refused(capsys, command, root / "t2", root / "t1", "--overwrite", expected="is not empty and is not a")
    assert _snapshot(root) == before and verify_checkpoint(open_checkpoint(root / "t1")) == []


@pytest.mark.parametrize("command", ["to-fp32", "to-universal"])
def test_the_input_is_never_the_output_nor_inside_or_around_it(root, capsys, command):
    before = _snapshot(root)
    for out, relation in (
        (root / "t2", "is the input"),
        (root, "is the input"),  # the root the input is read through
        (root / "t2" / "sub", "lies inside the input"),
        (root / "sub", "lies inside the input"),
        (root.parent, "holds the input"),
    ):
        for extra in ([], ["--overwrite"]):
            _refused(capsys, command, root, out, *extra, expected=f"the output directory {relation}")
    link = root.parent / "link"
    link.symlink_to(root / "t2")
    _refused(capsys, command, root / "t2", link, "--overwrite", expected="the output directory is the input")
    assert _snapshot(root) == before and not (root / "sub").exists() and not (root / "t2" / "sub").exists()
    assert not [p for p in root.parent.iterdir() if p.name.startswith(".")]


def test_an_export_into_its_own_universal_input_is_refused(root, tmp_path, capsys):
    universal = to_universal(root, tmp_path / "u", progress=False)
    before = _snapshot(universal)
    _refused(capsys, "to-fp32", universal, universal / "fp32", expected="lies inside the input")
    _refused(capsys, "to-fp32", universal, universal, "--overwrite", expected="is the input")
    with pytest.raises(ValueError, match="lies inside the input"):
        from zeroshard.checkpoint.universal import open_universal

        with open_universal(universal) as opened:
            to_fp32(opened, universal / "fp32", progress=False)
    assert _snapshot(universal) == before


def test_overwrite_replaces_an_output_of_its_own_kind_only(root, tmp_path, capsys):
    fp32 = to_fp32(root, tmp_path / "fp32", progress=False)
    universal = to_universal(root, tmp_path / "u", progress=False)
    assert _cli(capsys, "to-fp32", root, fp32, "--overwrite")[0] == 0
    assert _cli(capsys, "to-fp32", root, fp32, "--overwrite", "--max-shard-size", "200B")[0] == 0  # sharded
    assert len(list(fp32.glob("model-*-of-*.safetensors"))) > 1
    assert _cli(capsys, "to-fp32", root, fp32, "--overwrite")[0] == 0  # and back
    assert _cli(capsys, "to-universal", root, universal, "--overwrite")[0] == 0
    _refused(capsys, "to-fp32", root, universal, "--overwrite", expected="is not a model export")
    _refused(capsys, "to-universal", root, fp32, "--overwrite", expected="is not a universal checkpoint")
    # A Hugging Face folder: model.safetensors beside files an export never writes.
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "config.json").write_text("{}")
    os.link(fp32 / "model.safetensors", hub / "model.safetensors")
    _refused(capsys, "to-fp32", root, hub, "--overwrite", expected="it holds 'config.json'")
    # model.safetensors alone, written by someone else (no zeroshard metadata)
    (hub / "config.json").unlink()
    (hub / "model.safetensors").unlink()
    from safetensors.numpy import save_file

    save_file({"w": np.zeros(3, dtype=np.float32)}, str(hub / "model.safetensors"), metadata={"format": "pt"})
    _refused(capsys, "to-fp32", root, hub, "--overwrite", expected="model.safetensors was not written as a model export")
    assert sorted(p.name for p in hub.iterdir()) == ["model.safetensors"]


def test_an_output_of_dot_is_the_current_directory(root, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    _refused(capsys, "to-fp32", root, ".", expected=f"{work}: exists, is not empty and is not a model export")
    _refused(capsys, "to-universal", root, "..", expected=f"{tmp_path}: the output directory holds the input")
    (work / "notes.txt").unlink()
    assert _cli(capsys, "to-fp32", root, ".") == (0, "")
    assert sorted(p.name for p in work.iterdir()) == ["model.safetensors"]
    _refused(capsys, "to-fp32", root, "/", expected="the root directory cannot be an output directory")
