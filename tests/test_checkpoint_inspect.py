"""``zeroshard inspect``: the summary of every kind of checkpoint, and ``--verify`` catching damage."""

from __future__ import annotations

import dataclasses
import shutil
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from deepspeed_fixtures import deepspeed_universal_folder

from zeroshard.checkpoint import SourceFormat, register_format, run_ranks, save_sharded, unregister_format
from zeroshard.checkpoint.native.source import NativeSource
from zeroshard.checkpoint.testing import synthesize_state
from zeroshard.checkpoint.universal import to_universal
from zeroshard.cli.main import main
from zeroshard.layout import LayoutPolicy, ParamSpec, build_layout
from zeroshard.state import ParamGroupState

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
        "step: 7 optimizer steps taken (extra['global_step'])",
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
    assert "step: 7 optimizer steps taken (the optimizer step count of group 0)" in capsys.readouterr().out


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


@pytest.mark.parametrize("verify", [[], ["--verify"]])
def test_not_a_checkpoint_is_bad_input_not_damage(tmp_path, capsys, verify):
    """Exit 1 is damage --verify found in a checkpoint; a path that is none is exit 2, on stderr."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("x")
    (tmp_path / "file").write_text("x")
    for name, message in (
        ("none", "no such checkpoint directory"),
        ("plain", "no manifest.json: not a checkpoint"),
        ("file", "not a directory"),
    ):
        assert main(["inspect", *verify, str(tmp_path / name)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured
        assert f"error: {tmp_path / name}: {message}" in captured.err


def test_a_root_whose_latest_names_a_missing_tag_is_damage(saved, capsys):
    shutil.rmtree(saved / "step7")
    assert main(["inspect", "--verify", str(saved)]) == 1
    assert f"{saved / 'latest'}: names tag 'step7' but" in capsys.readouterr().out


def _param_groups_to_universal_refuses(tmp_path: Path, case: str) -> Path:
    """Saved (every checksum and digest right) with param groups to-universal cannot store."""
    def state(rank):
        synthesized = synthesize_state(LAYOUT, rank)
        if case == "scalars":  # one param group whose two layout groups took different steps
            scalars = [{"step": torch.tensor(7.0)}, {"step": torch.tensor(5.0)}]
            groups = [ParamGroupState({"lr": 1e-3}, [0, 1])]
            return dataclasses.replace(synthesized, param_groups=groups, optimizer_scalars=scalars)
        return dataclasses.replace(synthesized, param_groups=[ParamGroupState({"lr": 1e-3}, [0])])  # group 1 in none

    root = tmp_path / case
    run_ranks(12, lambda c: save_sharded(root, "t", state(c.rank), coordinator=c, block_size=64))
    return root


@pytest.mark.parametrize("case", ["scalars", "orphan"])
def test_verify_reports_the_param_groups_to_universal_refuses(tmp_path, capsys, case):
    """One check, shared: a checkpoint --verify passes converts, and the line is the same."""
    root = _param_groups_to_universal_refuses(tmp_path, case)
    assert main(["to-universal", str(root), str(tmp_path / "u"), "--no-progress"]) == 2
    refusal = capsys.readouterr().err.strip().removeprefix("zeroshard to-universal: error: ")
    assert main(["inspect", "--verify", str(root)]) == 1
    assert capsys.readouterr().out.strip().splitlines() == [refusal]
    expected = "layout groups 0 and 1 hold different" if case == "scalars" else "layout groups [1] belong to no"
    assert expected in refusal


# ---- the other kinds: universal, DeepSpeed, DeepSpeed's universal format ------------------------


def _lines(capsys) -> list[str]:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.out.strip().splitlines() + captured.err.strip().splitlines()


@pytest.fixture
def universal(saved, tmp_path_factory) -> Path:
    # not under the root `saved`: a conversion never writes inside its input
    return to_universal(saved, tmp_path_factory.mktemp("converted") / "universal", progress=False)


def test_universal_summary(universal, capsys):
    assert main(["inspect", str(universal)]) == 0
    out = "\n".join(_lines(capsys))
    padding = LAYOUT.padding()
    for expected in (
        f"checkpoint {universal}",
        "kind: zeroshard universal checkpoint (format version 4,",
        "converted from a zeroshard run",
        "step: 7 optimizer steps taken (extra['global_step'])",
        "world size: any (converted from world size 12)",
        "layout policy: none stored",
        "group 0: 2 parameters, 48 elements (trained in bfloat16); state exp_avg, exp_avg_sq; scalars step",
        "parameters: 3 trainable (57 elements)",
        f"padding overhead: none; the source run (compact, 16-byte alignment, world size 12) had "
        f"{padding.padding_elements:,} elements, {100 * padding.fraction:.3f}%",
        "  universal.json: ",
        "1 shards: ",
    ):
        assert expected in out, expected


def test_universal_verify(universal, capsys):
    assert main(["inspect", "--verify", str(universal)]) == 0
    assert _lines(capsys) == [f"{universal}: OK, universal checkpoint, 1 shards, {_shard_bytes(universal):,} bytes, every checksum and digest matches"]
    shard = universal / "universal-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10
    shard.write_bytes(bytes(data))
    (universal / "universal-00002-of-00002.safetensors").write_bytes(b"")
    assert main(["inspect", "--verify", str(universal)]) == 1
    lines = _lines(capsys)
    assert len(lines) == 2
    assert f"{shard}: checksum mismatch in block" in lines[0]
    assert "universal-00002-of-00002.safetensors: not listed in the manifest" in lines[1]


def _shard_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


@pytest.fixture(scope="module")
def deepspeed_run(deepspeed_runs):
    return deepspeed_runs["w2_s2"]


@pytest.mark.parametrize("where", ["root", "tag"])
def test_deepspeed_summary(deepspeed_run, where, capsys):
    from zeroshard.deepspeed.checkpoint import open_deepspeed

    path = deepspeed_run.save_dir if where == "root" else deepspeed_run.tag_dir
    assert main(["inspect", str(path)]) == 0
    lines = _lines(capsys)
    named_by = f" (named by {deepspeed_run.save_dir / 'latest'})" if where == "root" else ""
    assert lines[0] == f"checkpoint {deepspeed_run.tag_dir}{named_by}"
    assert lines[1].startswith("kind: DeepSpeed ZeRO stage 2 checkpoint (DeepSpeed 0.")
    assert lines[2:6] == ["step: 3 optimizer steps taken (extra['global_steps'])", "world size: 2", "ZeRO stage: 2", "layout policy: deepspeed"]
    with open_deepspeed(path) as source:
        padding = source.layout.padding()
        groups = source.layout.groups
    out = "\n".join(lines)
    assert f"padding overhead: {padding.padding_elements:,} elements, {padding.padding_bytes:,} bytes" in out
    for group in groups:
        assert f"{group.partition_numel:,} elements per rank, {group.inter_param_padding + group.tail_padding:,} padding" in out
    sizes = [p.stat().st_size for p in sorted(deepspeed_run.tag_dir.glob("*optim_states.pt"))]
    assert f"2 rank files: {sum(sizes):,} bytes" in out
    assert "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt: " in out and "mp_rank_00_model_states.pt: " in out


def test_deepspeed_verify_reads_every_tensor(deepspeed_run, tmp_path, capsys):
    assert main(["inspect", "--verify", str(deepspeed_run.save_dir)]) == 0
    [line] = _lines(capsys)
    assert line.startswith(f"{deepspeed_run.tag_dir}: OK, DeepSpeed checkpoint, 3 files, ")
    assert line.endswith("every rank file agrees with the model states and every tensor reads")

    damaged = tmp_path / "damaged"
    shutil.copytree(deepspeed_run.tag_dir, damaged)
    rank_file = damaged / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    record = _flip_a_byte_in_the_largest_record(rank_file)
    assert main(["inspect", str(damaged)]) == 0  # the summary reads no tensor
    capsys.readouterr()
    assert main(["inspect", "--verify", str(damaged)]) == 1
    [line] = _lines(capsys)
    assert f"{rank_file}: record {record} is corrupt: its CRC-32 is " in line, line

    rank_file.write_bytes(rank_file.read_bytes()[: rank_file.stat().st_size // 2])
    assert main(["inspect", "--verify", str(damaged)]) == 1
    [line] = _lines(capsys)
    assert str(rank_file) in line
    assert main(["inspect", str(damaged)]) == 2
    [line] = _lines(capsys)
    assert line.startswith("zeroshard inspect: error: ") and str(rank_file) in line

    (damaged / "mp_rank_00_model_states.pt").unlink()  # optimizer files alone: still DeepSpeed's
    assert main(["inspect", str(damaged)]) == 2
    [line] = _lines(capsys)
    assert line == f"zeroshard inspect: error: {damaged}: mp_rank_00_model_states.pt is missing"


def _flip_a_byte_in_the_largest_record(path: Path) -> str:
    """Flip one bit in the middle of the biggest tensor record of a torch.save zip; its name."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
    data[info.header_offset + 30 + name_length + extra_length + info.file_size // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return info.filename


@pytest.mark.parametrize("where", ["folder", "root"])
def test_deepspeed_universal_format_is_named_and_refused(deepspeed_run, tmp_path, where, capsys):
    folder = deepspeed_universal_folder(deepspeed_run, tmp_path / "ds")
    path = folder if where == "folder" else folder.parent
    expected = f"zeroshard inspect: error: {path}: a DeepSpeed universal checkpoint (ds_to_universal output), which zeroshard does not read"
    for args in (["inspect", str(path)], ["inspect", "--verify", str(path)]):
        assert main(args) == 2
        [line] = _lines(capsys)
        assert line.startswith(expected), line
    assert main(["to-universal", str(path), str(tmp_path / "out")]) == 2
    [line] = _lines(capsys)
    assert "a DeepSpeed universal checkpoint" in line and not (tmp_path / "out").exists()


def test_inspect_goes_by_the_registered_formats(saved, tmp_path, capsys):
    """The kind is the registry's word: a format registered first claims the path."""
    register_format(SourceFormat("pointer", lambda path: path == saved, NativeSource, "pointer checkpoint"))
    try:
        assert main(["inspect", str(saved)]) == 2
        [line] = _lines(capsys)
        assert line == f"zeroshard inspect: error: {saved}: a pointer checkpoint, which inspect does not describe; " + (
            "open_source reads it"
        )
    finally:
        unregister_format("pointer")
    assert main(["inspect", str(saved)]) == 0


def test_inspect_every_kind_without_torch(deepspeed_run, universal, saved):
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any import of torch fails
        from zeroshard.cli.main import main
        for path in ({str(deepspeed_run.save_dir)!r}, {str(universal)!r}, {str(saved)!r}):
            assert main(["inspect", path]) == 0 and main(["inspect", "--verify", path]) == 0
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(": OK, ") == 3 and "kind: DeepSpeed ZeRO stage 2" in done.stdout
