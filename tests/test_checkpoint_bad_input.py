"""Bad checkpoints and mismatched runs: one-line errors naming the file or parameter; nothing loaded."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from zeroshard.checkpoint import load_sharded, open_checkpoint, run_ranks, save_sharded
from zeroshard.checkpoint.testing import synthesize_state
from zeroshard.layout import LayoutPolicy, ParamSpec, build_layout

SPECS = [[ParamSpec.of("a", (7, 5), "bf16"), ParamSpec.of("b", (13,), "bf16")], [ParamSpec.of("c", (9,), "bf16")]]
LAYOUT = build_layout(SPECS, 2)


@pytest.fixture
def saved(tmp_path) -> Path:
    run_ranks(2, lambda c: save_sharded(tmp_path, "t", synthesize_state(LAYOUT, c.rank), coordinator=c, block_size=128))
    return tmp_path


def load_error(path, layout=LAYOUT, rank=0, error=ValueError, **kwargs) -> str:
    with pytest.raises(error) as info:
        load_sharded(path, layout, rank, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def edit_manifest(root: Path, change) -> None:
    path = root / "t" / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_absent_directory(tmp_path):
    assert "no such checkpoint directory" in load_error(tmp_path / "nope", error=FileNotFoundError)


def test_empty_directory(tmp_path):
    assert f"{tmp_path}: empty directory" in load_error(tmp_path)


def test_latest_pointing_nowhere(saved):
    (saved / "latest").write_text("gone\n")
    assert "latest: names tag 'gone' but" in load_error(saved, error=FileNotFoundError)


def test_root_without_latest_names_its_tags(saved):
    (saved / "latest").unlink()
    assert "no latest file; name one of its checkpoints: t" in load_error(saved)


def test_missing_rank_file(saved):
    (saved / "t" / "rank-00001-of-00002.safetensors").unlink()
    # Every rank fails the same way, also those that would not read the file.
    assert "rank-00001-of-00002.safetensors: missing" in load_error(saved, rank=0, error=FileNotFoundError)


def test_truncated_file(saved):
    path = saved / "t" / "rank-00000-of-00002.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    message = load_error(saved)
    assert "rank-00000-of-00002.safetensors: truncated or altered" in message and "the manifest says" in message


def test_flipped_byte_in_data(saved):
    path = saved / "t" / "rank-00000-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))
    assert "rank-00000-of-00002.safetensors: checksum mismatch in block" in load_error(saved, rank=0)


def test_flipped_byte_in_model_file(saved):
    path = saved / "t" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    assert "model.safetensors: checksum mismatch" in load_error(saved, rank=1)


def test_corrupted_header(saved):
    path = saved / "t" / "rank-00001-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[9] = ord("[")
    path.write_bytes(bytes(data))
    assert "rank-00001-of-00002.safetensors: corrupted: the safetensors header is not valid JSON" in load_error(
        saved, rank=1
    )


def test_corrupted_manifest(saved):
    (saved / "t" / "manifest.json").write_text('{"format": "zeroshard.checkpoint", ')
    assert "manifest.json: corrupted: not valid JSON" in load_error(saved)


def test_newer_format_version(saved):
    edit_manifest(saved, lambda d: d.update(version=99))
    assert "manifest.json: format version 99 is newer than this zeroshard reads (4)" in load_error(saved)


def _retyped(path: tuple, retype):
    """An edit of the manifest: the number at ``path`` given the same value in another JSON type."""

    def change(data: dict) -> None:
        for key in path[:-1]:
            data = data[key]
        data[path[-1]] = retype(data[path[-1]])

    return change


@pytest.mark.parametrize(
    "path, retype, message",
    [
        (("layout", "version"), bool, "layout format version True is not supported"),
        (("layout", "groups", 0, "params", 1, "offset"), float, "layout JSON is inconsistent"),
        (("layout", "groups", 0, "buckets", 0, "start"), bool, "layout JSON is inconsistent"),
        (("layout", "policy", "parameter_alignment"), int, "parameter_alignment must be true or false, got 0"),
        (("files", "model.safetensors", "size"), str, "file record's size is '"),
        (("files", "model.safetensors", "block_size"), float, "file record's block_size is 128.0, expected an integer"),
        (("files", "model.safetensors", "crc32", 0), float, "file record's crc32 is ["),
        (("optimizer", "param_groups", 1, "layout_groups", 0), bool, "param group 1 has a layout group that is True"),
    ],
)
def test_a_number_of_the_wrong_json_type_is_refused(saved, path, retype, message):
    """JSON true is not 1, nor 16.0 or "498" an integer, though Python's == and int() say so."""
    edit_manifest(saved, _retyped(path, retype))
    error = load_error(saved)
    assert error.startswith(str(saved / "t" / "manifest.json")) and message in error, error


def test_manifest_with_inconsistent_layout(saved):
    edit_manifest(saved, lambda d: d["layout"]["groups"][0]["params"][1].update(offset=3))
    assert "manifest.json: layout JSON is inconsistent" in load_error(saved)


def test_another_model_lists_every_difference(saved):
    other = build_layout(
        [[ParamSpec.of("a", (5, 7), "bf16"), ParamSpec.of("z", (4,), "bf16")], [ParamSpec.of("c", (9,), "bf16")]], 2
    )
    message = load_error(saved, layout=other)
    assert "checkpoint does not match the run's parameters" in message
    assert "1 missing from the checkpoint: z" in message
    assert "1 not in the run: b" in message
    assert "1 with another shape: a (checkpoint [7, 5], run [5, 7])" in message


def test_non_strict_loads_the_intersection_with_a_warning(saved):
    other = build_layout(
        [[ParamSpec.of("a", (7, 5), "bf16")], [ParamSpec.of("c", (9,), "bf16"), ParamSpec.of("d", (3,), "bf16")]], 1
    )
    with pytest.warns(UserWarning, match="1 missing from the checkpoint: d; 1 not in the run: b"):
        state = load_sharded(saved, other, 0, strict=False)
    group = other.groups[1]
    d = next(f for f in group.fragments(0) if f.name == "d")
    assert torch.count_nonzero(state.fp32_partitions[1][d.partition_start : d.partition_start + d.length]) == 0


@pytest.mark.parametrize(
    "name, kind, message",
    [
        ("a", "weird", "module tensor 'a' has unknown kind 'weird' (expected one of trainable, frozen, buffer, other)"),
        ("a", "buffer", "module tensor 'a' has kind 'buffer' but is a trained parameter of the layout"),
        ("positions", "trainable", "module tensor 'positions' has kind 'trainable' but is not a trained parameter"),
    ],
)
def test_module_tensor_kinds_are_checked(saved, tmp_path, name, kind, message):
    """Not "tensor key 'a' appears twice" from the fp32 export: the manifest is at fault."""
    from zeroshard.checkpoint.export.fp32 import to_fp32

    edit_manifest(saved, lambda data: data["model"]["tensors"][name].update(kind=kind))
    assert message in load_error(saved)
    with pytest.raises(ValueError, match=re.escape("manifest.json: " + message)):
        to_fp32(saved, tmp_path / "out", progress=False)


def test_dtype_mismatch(saved):
    fp16 = build_layout([[(s.name, s.shape, "fp16") for s in group] for group in SPECS], 2)
    message = load_error(saved, layout=fp16)
    assert "with another dtype: a (checkpoint bfloat16, run float16), b (checkpoint bfloat16, run float16)" in message
    with pytest.raises(ValueError, match="another dtype"):
        load_sharded(saved, fp16, 0, strict=False)


def test_state_dict_mismatch_is_caught_before_loading(saved):
    module_state = dict(synthesize_state(LAYOUT, 0).model_state)
    module_state["positions"] = torch.arange(6)
    del module_state["frozen.weight"]
    message = load_error(saved, module_state=module_state)
    assert (
        "does not match the run's state_dict: 1 not in the run: frozen.weight; 1 with another shape: positions"
        in message
    )


def test_rank_file_tensor_with_another_dtype(saved):
    edit_manifest(saved, lambda d: d["groups"][0]["states"].update(exp_avg="float16"))
    message = load_error(saved, rank=1)
    assert (
        "rank-00001-of-00002.safetensors: tensor 'group0.state.exp_avg' is float32 [32], the manifest says float16 [32]"
        in message
    )


def test_failed_load_leaves_the_base_untouched(saved):
    path = saved / "t" / "rank-00001-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    base = synthesize_state(LAYOUT, 1)
    before = [t.clone() for t in base.fp32_partitions]
    load_error(saved, rank=1, base=base)
    assert all(torch.equal(a, b) for a, b in zip(before, base.fp32_partitions))


def test_rank_outside_the_new_world(saved):
    assert "rank 2 is outside world size 2" in load_error(saved, rank=2)


def test_save_rejects_a_bad_state_on_every_rank(tmp_path):
    def one_rank(coord):
        state = synthesize_state(LAYOUT, coord.rank)
        if coord.rank == 1:
            state.optimizer_states[0]["exp_avg"] = torch.zeros(3)
        return save_sharded(tmp_path, "t", state, coordinator=coord)

    results = run_ranks(2, one_rank, return_exceptions=True)
    assert all(isinstance(r, ValueError) and "rank 1: group0.state.exp_avg has shape [3]" in str(r) for r in results)
    assert not (tmp_path / "t").exists() and not (tmp_path / "latest").exists()


def test_save_refuses_what_would_need_pickle(tmp_path):
    state = synthesize_state(build_layout(SPECS, 1), 0)
    state.extra["lr_scheduler"]["lr_lambdas"] = [lambda step: 1.0]
    with pytest.raises(ValueError, match=r"extra\['lr_scheduler'\]\['lr_lambdas'\]\[0\]: cannot store a function"):
        save_sharded(tmp_path, "t", state)


@pytest.mark.parametrize("tag", ["", "a/b", ".hidden", "latest"])
def test_bad_tags(tmp_path, tag):
    with pytest.raises(ValueError, match="checkpoint tag"):
        save_sharded(tmp_path, tag, synthesize_state(build_layout(SPECS, 1), 0))


def test_open_checkpoint_reports_policy_change_free_layouts(saved):
    # A manifest saved under one policy opens the same under any run policy: only the load maps.
    assert open_checkpoint(saved).manifest.layout.policy == LayoutPolicy.native()


@pytest.mark.parametrize(
    "entry", [{"shape": [True]}, {"shape": [1.0]}, {"data_offsets": ["0", 4]}, {"data_offsets": [0, 4.0]}]
)
def test_a_safetensors_header_number_of_the_wrong_json_type_is_refused(tmp_path, entry):
    from zeroshard.io.safetensors_io import read_header

    header = json.dumps({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], **entry}}).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    with pytest.raises(ValueError, match=re.escape(f"{path}: corrupted: bad header entry for 'x'")):
        read_header(path, path.stat().st_size)
