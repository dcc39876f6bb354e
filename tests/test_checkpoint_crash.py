"""A crash at any point of a save leaves the previous checkpoint loadable and nothing half-done visible."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroshard.checkpoint import FAULT_POINTS, list_tags, load_sharded, open_checkpoint, run_ranks, save_sharded
from zeroshard.checkpoint.output_dir import OutputKind, staged_output
from zeroshard.checkpoint.testing import synthesize_state
from zeroshard.layout import ParamSpec, build_layout

LAYOUT = build_layout([[ParamSpec.of("a", (7, 5), "bf16"), ParamSpec.of("b", (13,), "bf16")]], 3)


class SimulatedCrash(RuntimeError):
    pass


def crash_at(point: str, crashing_rank: int):
    def fault(where: str, rank: int) -> None:
        if where == point and rank == crashing_rank:
            raise SimulatedCrash(f"rank {rank} killed at {point}")

    return fault


def save(root: Path, tag: str, step: int, fault=None) -> list:
    def one_rank(coord):
        state = synthesize_state(LAYOUT, coord.rank, step=step)
        return save_sharded(root, tag, state, coordinator=coord, fault=fault, block_size=256)

    return run_ranks(LAYOUT.world_size, one_rank, return_exceptions=True)


def loaded_step(path: Path) -> int:
    return load_sharded(path, LAYOUT, 1).extra["global_step"]


def hidden_entries(root: Path) -> list[str]:
    return sorted(entry.name for entry in root.iterdir() if entry.name.startswith("."))


@pytest.mark.parametrize("point", [p for p in FAULT_POINTS if p != "mid_replace"])
def test_crash_while_saving_a_new_tag(tmp_path, point):
    assert not any(isinstance(r, Exception) for r in save(tmp_path, "step1", 1))
    crashing_rank = 2 if point == "after_rank_file" else 0
    results = save(tmp_path, "step2", 2, crash_at(point, crashing_rank))
    assert isinstance(results[crashing_rank], SimulatedCrash)

    assert loaded_step(tmp_path) == 1  # through latest
    assert loaded_step(tmp_path / "step1") == 1
    if point == "before_latest":
        # Published (the rename is the commit point) but not yet the latest: complete and loadable.
        assert list_tags(tmp_path) == ["step1", "step2"] and loaded_step(tmp_path / "step2") == 2
    else:
        assert list_tags(tmp_path) == ["step1"] and not (tmp_path / "step2").exists()
        assert [name.split(".tmp-")[0] for name in hidden_entries(tmp_path)] == [".step2"]
        with pytest.raises(FileNotFoundError):
            load_sharded(tmp_path / "step2", LAYOUT, 0)

    # The next save cleans up what the crash left and publishes normally.
    assert not any(isinstance(r, Exception) for r in save(tmp_path, "step3", 3))
    assert hidden_entries(tmp_path) == [] and loaded_step(tmp_path) == 3


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_crash_while_overwriting_a_tag(tmp_path, point):
    save(tmp_path, "best", 1)
    crashing_rank = 1 if point == "after_rank_file" else 0
    save(tmp_path, "best", 2, crash_at(point, crashing_rank))
    expected = 2 if point == "before_latest" else 1
    assert loaded_step(tmp_path) == expected
    assert loaded_step(tmp_path / "best") == expected
    save(tmp_path, "other", 3)
    assert hidden_entries(tmp_path) == []
    assert loaded_step(tmp_path / "best") == expected


def test_overwriting_a_tag(tmp_path):
    save(tmp_path, "best", 1)
    save(tmp_path, "best", 2)
    assert loaded_step(tmp_path / "best") == 2 and hidden_entries(tmp_path) == []


def test_a_staging_directory_is_never_loaded(tmp_path):
    save(tmp_path, "step2", 2, crash_at("before_rename", 0))  # complete, manifest included, not published
    (staging,) = hidden_entries(tmp_path)
    assert (tmp_path / staging / "manifest.json").exists()
    with pytest.raises(ValueError, match="empty directory|no manifest"):
        open_checkpoint(tmp_path)


def _convert(out: Path, text: str, overwrite: bool, fault=None) -> None:
    with staged_output(out, kind=OutputKind("test output", "done", ("done",)), overwrite=overwrite, fault=fault) as staging:
        (staging / "done").write_text(text)


@pytest.mark.parametrize("point", ["before_rename", "mid_replace"])
def test_a_conversion_crash_keeps_the_previous_output(tmp_path, point):
    """Conversions publish as saves do: after a crash while replacing an output, the next
    write puts the previous output back (it used to delete it when moved aside)."""
    out = tmp_path / "out"
    _convert(out, "old", overwrite=False)
    with pytest.raises(SimulatedCrash):
        _convert(out, "new", overwrite=True, fault=lambda where: crash_at(point, 0)(where, 0))
    with pytest.raises(FileExistsError, match="already holds a complete test output"):
        _convert(out, "new", overwrite=False)
    assert (out / "done").read_text() == "old" and hidden_entries(tmp_path) == []
    _convert(out, "new", overwrite=True)
    assert (out / "done").read_text() == "new" and hidden_entries(tmp_path) == []
