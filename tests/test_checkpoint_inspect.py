"""``zeroshard inspect``: the summary, and ``--verify`` catching damage."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from zeroshard.checkpoint import run_ranks, save_sharded
from zeroshard.checkpoint.testing import synthesize_state
from zeroshard.cli.main import main
from zeroshard.layout import LayoutPolicy, ParamSpec, build_layout

LAYOUT = build_layout(
    [[ParamSpec.of("a", (7, 5), "bf16"), ParamSpec.of("b", (13,), "bf16")], [ParamSpec.of("c", (9,), "bf16")]],
    12,
    LayoutPolicy.native(compact=True),
)


@pytest.fixture
def saved(tmp_path) -> Path:
    run_ranks(
        12, lambda c: save_sharded(tmp_path, "step7", synthesize_state(LAYOUT, c.rank), coordinator=c, block_size=64)
    )
    return tmp_path


def test_summary(saved, capsys):
    assert main(["inspect", str(saved)]) == 0
    out = capsys.readouterr().out
    for expected in (
        "tag 'step7'",
        "step: 7 (extra['global_step'])",
        "world size: 12",
        "layout policy: compact, 16-byte alignment",
        "group 0 (bfloat16): 2 parameters, 48 elements",
        "parameters: 3 trainable (57 elements)",
        "padding overhead:",
        "12 rank files:",
        "rank-00000-of-00012.safetensors:",
        "... 4 more (--files lists them all)",
    ):
        assert expected in out, expected


def test_summary_reads_the_optimizer_step_when_extra_has_none(tmp_path, capsys):
    def save(coordinator):
        state = dataclasses.replace(synthesize_state(LAYOUT, coordinator.rank), extra={})
        return save_sharded(tmp_path, "t", state, coordinator=coordinator, block_size=64)

    run_ranks(12, save)
    assert main(["inspect", str(tmp_path)]) == 0
    assert "step: 7 (optimizer step of group 0)" in capsys.readouterr().out


def test_verify_passes_on_an_intact_checkpoint(saved, capsys):
    assert main(["inspect", "--verify", str(saved / "step7")]) == 0
    assert "OK, 13 files" in capsys.readouterr().out


def test_verify_catches_a_flipped_byte(saved, capsys):
    path = saved / "step7" / "rank-00011-of-00012.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))
    assert main(["inspect", "--verify", str(saved)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "rank-00011-of-00012.safetensors: checksum mismatch in block" in lines[0]


def test_verify_lists_every_problem(saved, capsys):
    (saved / "step7" / "rank-00003-of-00012.safetensors").unlink()
    truncated = saved / "step7" / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:100])
    (saved / "step7" / "stray.safetensors").write_bytes(b"")
    assert main(["inspect", "--verify", str(saved)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3
    assert "model.safetensors: size 100 bytes" in lines[0]
    assert "rank-00003-of-00012.safetensors: missing" in lines[1]
    assert "stray.safetensors: not listed in the manifest" in lines[2]


def test_not_a_checkpoint(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "none")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err
    assert main(["inspect", "--verify", str(tmp_path / "none")]) == 1
