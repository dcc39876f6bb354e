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


def test_overwrite_replaces_an_export_beside_the_config_files_it_wrote_and_nothing_else(root, tmp_path, capsys):
    """An export of a run that recorded its model's config holds config.json and
    generation_config.json, which its zeroshard.digests.json lists: --overwrite refused them
    as foreign. A config.json anyone else wrote, or one edited since, is still refused."""
    from zeroshard.checkpoint.testing import synthesize_state

    states = [synthesize_state(LAYOUT, rank) for rank in range(LAYOUT.world_size)]
    for state in states:
        state.model_configs = {"config.json": '{"model_type": "tiny"}', "generation_config.json": "{}"}
    configured = save_synthetic(tmp_path / "configured", LAYOUT, states=states, block_size=64)
    fp32 = to_fp32(configured, tmp_path / "fp32", progress=False)
    universal = to_universal(configured, tmp_path / "u", progress=False)
    assert sorted(p.name for p in fp32.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "zeroshard.digests.json"
    ]  # fmt: skip
    assert _cli(capsys, "to-fp32", configured, fp32, "--overwrite")[0] == 0
    assert _cli(capsys, "to-fp32", configured, fp32, "--overwrite", "--max-shard-size", "200B")[0] == 0
    assert _cli(capsys, "to-universal", configured, universal, "--overwrite")[0] == 0
    # An export of a run without a config, replaced by one with: its files are ours too.
    assert _cli(capsys, "to-fp32", root, fp32, "--overwrite")[0] == 0 and not (fp32 / "config.json").exists()
    assert _cli(capsys, "to-fp32", configured, fp32, "--overwrite")[0] == 0 and (fp32 / "config.json").is_file()
    # Edited since: the user's now.
    (fp32 / "config.json").write_text('{"model_type": "tiny", "mine": true}')
    _refused(capsys, "to-fp32", configured, fp32, "--overwrite", expected="(config.json is not the file zeroshard wrote there: it changed since)")
    # Added by the user beside an export that has none: never ours.
    plain = to_fp32(root, tmp_path / "plain", progress=False)
    (plain / "config.json").write_text('{"model_type": "tiny"}')
    _refused(capsys, "to-fp32", root, plain, "--overwrite", expected="it holds 'config.json', which its zeroshard.digests.json does not list: zeroshard did not write it")
    (plain / "config.json").unlink()
    (plain / "tokenizer.json").write_text("{}")
    _refused(capsys, "to-fp32", root, plain, "--overwrite", expected="it holds 'tokenizer.json', which a model export does not")
    # A listed name that is a link now, pointing at the file that was written.
    (plain / "tokenizer.json").unlink()
    fresh = to_fp32(configured, tmp_path / "fresh", progress=False)
    os.replace(fresh / "config.json", tmp_path / "config.json")
    os.symlink(tmp_path / "config.json", fresh / "config.json")
    _refused(capsys, "to-fp32", configured, fresh, "--overwrite", expected="it holds 'config.json', which is not a regular file")
    assert (tmp_path / "config.json").is_file()


def test_an_output_of_dot_is_the_current_directory(root, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    _refused(capsys, "to-fp32", root, ".", expected=f"{work}: exists, is not empty and is not a model export")
    _refused(capsys, "to-universal", root, "..", expected=f"{tmp_path}: the output directory holds the input")
    (work / "notes.txt").unlink()
    assert _cli(capsys, "to-fp32", root, ".") == (0, "")
    assert sorted(p.name for p in work.iterdir()) == ["model.safetensors", "zeroshard.digests.json"]
    _refused(capsys, "to-fp32", root, "/", expected="the root directory cannot be an output directory")


# ---- every output opens with the real safetensors library ---------------------------------------


def assert_opens_with_safetensors(path: Path) -> int:
    """The real library opens ``path`` and reads every tensor to the bytes our header places
    there; returns the number of tensors."""
    import torch

    from zeroshard.io.safetensors_io import read_header

    raw = path.read_bytes()
    entries = read_header(path, len(raw))
    with safe_open(str(path), framework="pt") as handle:
        assert set(handle.keys()) == set(entries), path
        for key, entry in entries.items():
            tensor = handle.get_tensor(key)
            assert list(tensor.shape) == list(entry.shape), (path, key)
            data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
            assert data == raw[entry.begin : entry.end], (path, key)
    return len(entries)


def test_every_output_kind_opens_with_the_safetensors_library(root, tmp_path):
    from zeroshard.checkpoint import run_ranks, save_sharded
    from zeroshard.checkpoint.testing import synthesize_state
    from zeroshard.layout import ExpertMesh

    experts = ExpertMesh(2, 2).expert_group([ParamSpec.of("moe.w1", (2, 3, 4), "bf16")], 4)
    moe_layout = build_layout([[ParamSpec.of("embed", (9, 4), "bf16")], experts], 2)
    moe = tmp_path / "moe"
    run_ranks(2, lambda c: save_sharded(moe, "t", synthesize_state(moe_layout, c.rank), coordinator=c, block_size=64))
    outputs = [root / "t2", moe / "t"]
    for source in (root, moe):
        universal = to_universal(source, tmp_path / f"u-{source.name}", max_shard_size=300, progress=False)
        outputs += [universal, to_fp32(universal, tmp_path / f"f-{source.name}", progress=False)]
        outputs.append(to_fp32(source, tmp_path / f"s-{source.name}", max_shard_size=200, progress=False))
    files = [p for directory in outputs for p in sorted(directory.glob("*.safetensors"))]
    kinds = {p.name.split("-")[0].split(".")[0] for p in files}
    assert kinds == {"rank", "model", "universal"}, kinds
    assert sum(p.name.startswith("model-") for p in files) > 2  # sharded exports too
    assert all(assert_opens_with_safetensors(p) > 0 for p in files)


def test_a_parameter_no_safetensors_reader_opens_is_refused():
    with pytest.raises(ValueError, match=r"parameter name 'w\\ud800' is not valid UTF-8 \(it holds a lone surrogate\)"):
        ParamSpec.of("w\ud800", (3,), "bf16")
    with pytest.raises(ValueError, match=r"parameter 'w': shape \[0, 18446744073709551616\] describes more than 2\*\*63 bytes"):
        ParamSpec.of("w", (0, 2**64), "bf16")
    assert ParamSpec.of("w", (0, 2**61), "bf16").numel == 0  # 2**62 bytes if it held any: safetensors opens it


class _SourceWithModelEntry:
    """A file-less source (the testing pattern) whose one module tensor is given: what a
    DeepSpeed pickle may hold (any str, any shape)."""

    def __init__(self, name: str, shape: tuple[int, ...]) -> None:
        from universal_helpers import PatternSource

        from zeroshard.checkpoint.source import ModelEntry

        self._pattern = PatternSource(LAYOUT)
        self.path, self.kind = self._pattern.path, self._pattern.kind
        self.info = self._pattern.info
        self.info.model_entries = [ModelEntry(name, shape, "float32", "buffer")]
        self.info.aliases = {}

    def read(self, *args):
        return self._pattern.read(*args)

    def scalars(self, group):
        return self._pattern.scalars(group)

    def model_tensor(self, name):
        return np.zeros(0, dtype=np.float32)

    def close(self):
        pass


@pytest.mark.parametrize(
    "name, shape, message",
    [
        ("buf\ud800", (0,), r"'model/buf\\ud800': is not valid UTF-8"),
        ("buf", (0, 2**64), r"'model/buf': shape \[0, 18446744073709551616\] describes more than 2\*\*63 bytes"),
    ],
)
def test_a_conversion_refuses_a_tensor_no_reader_opens_before_writing(tmp_path, name, shape, message):
    for convert, out in ((to_universal, tmp_path / "u"), (to_fp32, tmp_path / "f")):
        expected = message if convert is to_universal else message.replace("model/", "")
        with pytest.raises(ValueError, match=expected + ".*refusing to write it"):
            convert(_SourceWithModelEntry(name, shape), out, progress=False)
        assert not out.exists() and not list(tmp_path.glob(".*"))


def test_a_save_refuses_a_module_name_no_reader_opens_on_every_rank(tmp_path):
    from zeroshard.checkpoint import run_ranks, save_sharded
    from zeroshard.checkpoint.testing import synthesize_state

    states = [synthesize_state(LAYOUT, rank) for rank in range(2)]
    states[0].model_state["buf\ud800"] = states[0].model_state.pop("positions")

    errors = run_ranks(
        2, lambda c: save_sharded(tmp_path, "t", states[c.rank], coordinator=c, buffer_names=["buf\ud800"]), return_exceptions=True
    )
    for error in errors:
        assert isinstance(error, ValueError) and r"model state name 'buf\ud800' is not valid UTF-8" in str(error), error
    assert not (tmp_path / "t").exists() and not list(tmp_path.glob(".t.tmp-*"))
