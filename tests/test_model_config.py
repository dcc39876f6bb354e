"""The model's config travels with its checkpoints (issue 28, N3): the fp32 export of a
transformers model's checkpoint had no config.json, so ``from_pretrained(out)`` built a
default model and failed confusingly. A model with a transformers-style ``config`` (duck
typed: no transformers here) has it recorded in each checkpoint (``model.config.json``, listed
with its checksums, format version 3), carried by ``to-universal`` (version 5) and written
by ``to-fp32`` as ``config.json`` (its ``dtype`` the export's), with ``generation_config.json``.
A model without one saves exactly as before. The real transformers model: tests/test_hf_experts.py."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from zeroshard.checkpoint import open_checkpoint
from zeroshard.checkpoint.engine_io import load_checkpoint, save_checkpoint
from zeroshard.checkpoint.export.fp32 import to_fp32
from zeroshard.checkpoint.universal import to_universal
from zeroshard.cli.main import main
from zeroshard.engine import ZeroOptimizer

RECORDED = {"model_type": "tiny", "hidden_size": 4, "dtype": "bfloat16", "label": "caf\u00e9"}


class JsonConfig:
    """What transformers' PretrainedConfig offers: ``to_json_string()``."""

    def __init__(self, value: dict) -> None:
        self.value = value

    def to_json_string(self) -> str:
        return json.dumps(self.value, indent=2, sort_keys=True) + "\n"


class DictConfig:
    """What transformers' GenerationConfig offers too: ``to_dict()`` (and no more here)."""

    def to_dict(self) -> dict:
        return {"max_new_tokens": 5}


class Tiny(nn.Module):
    def __init__(self, config=None, generation=None) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        if config is not None:
            self.config = config
        if generation is not None:
            self.generation_config = generation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).square().mean()


def _saved(path: Path, model: nn.Module) -> Path:
    torch.manual_seed(0)
    engine = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2)
    engine.backward(model(torch.randn(2, 4)))
    engine.step()
    return save_checkpoint(engine, path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return _saved(tmp_path_factory.mktemp("configured") / "ckpt", Tiny(JsonConfig(RECORDED), DictConfig()))


def test_the_config_is_recorded_in_the_checkpoint_with_its_checksums(saved):
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["version"] == 3
    assert {"model.config.json", "model.generation_config.json"} <= set(manifest["files"])
    recorded = json.loads((saved / "model.config.json").read_text(encoding="utf-8"))
    assert recorded == {**RECORDED, "architectures": ["Tiny"]}  # as save_pretrained fills it in
    assert json.loads((saved / "model.generation_config.json").read_text()) == {"max_new_tokens": 5}
    assert main(["inspect", "--verify", str(saved)]) == 0


@pytest.mark.parametrize("route", ["native", "universal"])
def test_the_export_writes_config_json_in_its_dtype(saved, tmp_path, route):
    source = saved if route == "native" else to_universal(saved, tmp_path / "u", progress=False)
    if route == "universal":
        universal = json.loads((source / "universal.json").read_text())
        assert universal["version"] == 5 and sorted(universal["model_configs"]) == sorted(
            ["model.config.json", "model.generation_config.json"]
        )
        assert main(["inspect", "--verify", str(source)]) == 0
    for dtype in ("float32", "bfloat16"):
        out = to_fp32(source, tmp_path / f"fp32-{dtype}", dtype=dtype, progress=False)
        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
        assert config == {**RECORDED, "architectures": ["Tiny"], "dtype": dtype}  # from_pretrained loads in it
        assert json.loads((out / "generation_config.json").read_text()) == {"max_new_tokens": 5}
        record = json.loads((out / "zeroshard.digests.json").read_text())
        assert sorted(record["files"]) == ["config.json", "generation_config.json"]
        assert main(["inspect", "--verify", str(out)]) == 0


def test_a_model_without_config_saves_and_exports_as_before(tmp_path, capsys):
    tag = _saved(tmp_path / "ckpt", Tiny())
    assert json.loads((tag / "manifest.json").read_text())["version"] == 2
    assert sorted(p.name for p in tag.iterdir()) == ["manifest.json", "model.safetensors", "rank-00000-of-00001.safetensors"]
    universal = to_universal(tag, tmp_path / "u", progress=False)
    assert json.loads((universal / "universal.json").read_text())["version"] == 4
    assert main(["to-fp32", "--no-progress", str(universal), str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors", "zeroshard.digests.json"]
    note = capsys.readouterr().out.splitlines()[-1]
    assert note.startswith("note: no config.json: the checkpoint records no model config") and "save_pretrained" in note


def test_a_config_is_read_through_any_of_its_methods_and_a_failing_one_is_left_out(tmp_path, caplog):
    from zeroshard.state import model_config_files

    class FileConfig:
        def to_json_file(self, path: str) -> None:
            Path(path).write_text('{"model_type": "by-file"}')

    class Broken:
        def to_json_string(self) -> str:
            raise TypeError("cannot serialise a tensor")

    class NotAnObject:
        def to_json_string(self) -> str:
            return "[1, 2]"

    assert json.loads(model_config_files(Tiny(FileConfig()))["config.json"])["model_type"] == "by-file"
    assert model_config_files(Tiny(config=None, generation=DictConfig())) == {}  # a generation config alone is no model's
    with caplog.at_level(logging.WARNING):
        assert model_config_files(Tiny(Broken())) == {}
        assert model_config_files(Tiny(NotAnObject())) == {}
    assert "Tiny.config is not recorded in checkpoints: TypeError: cannot serialise a tensor" in caplog.text
    assert "Tiny.config is not recorded in checkpoints: ValueError: it gives a JSON list, not an object" in caplog.text
    tag = _saved(tmp_path / "ckpt", Tiny(Broken()))  # saved all the same, without it
    assert "model.config.json" not in json.loads((tag / "manifest.json").read_text())["files"]


def test_a_resumed_run_loads_a_checkpoint_with_a_config(saved):
    model = Tiny(JsonConfig(RECORDED))
    engine = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2)
    load_checkpoint(engine, saved)
    assert engine.global_steps == 1


# ---- a config file is hostile like any other ----------------------------------------------------


def _copy(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "tag"))


def _rerecord(tag: Path, name: str, data: bytes) -> None:
    """Replace file ``name`` and its manifest record (a file edited consistently: only its content is wrong)."""
    from zeroshard.io.checksum import BlockHasher

    (tag / name).write_bytes(data)
    manifest = json.loads((tag / "manifest.json").read_text())
    hasher = BlockHasher(manifest["files"][name]["block_size"])
    hasher.update(data)
    manifest["files"][name] = hasher.record().to_dict()
    (tag / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda tag: (tag / "model.config.json").write_bytes(b" " + (tag / "model.config.json").read_bytes()[1:]), "checksum mismatch in block 0"),
        (lambda tag: _rerecord(tag, "model.config.json", b"[1, 2]\n"), "a JSON list, not the object a model config is"),
        (lambda tag: _rerecord(tag, "model.config.json", b'{"a": 1, "a": 2}'), "key 'a' appears twice in one JSON object"),
        (lambda tag: _rerecord(tag, "model.config.json", b'{"a": "\xff"}'), "corrupted: not UTF-8 text"),
        (lambda tag: _rerecord(tag, "model.config.json", b"[" * 200 + b"]" * 200), "nested more than 100 levels deep"),
    ],
    ids=["flipped", "not-an-object", "repeated-key", "not-utf8", "deep"],
)
def test_a_damaged_config_file_is_named_in_one_line(saved, tmp_path, capsys, damage, message):
    tag = _copy(saved, tmp_path)
    damage(tag)
    assert main(["to-fp32", "--no-progress", str(tag), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tag / 'model.config.json'}" in err and message in err, err
    assert not (tmp_path / "out").exists()
    assert main(["inspect", "--verify", str(tag)]) == 1
    assert message in capsys.readouterr().out


def test_a_config_file_that_is_a_link_or_too_big_is_refused(saved, tmp_path, monkeypatch):
    from zeroshard.checkpoint import model_config

    tag = _copy(saved, tmp_path)
    outside = tmp_path / "elsewhere.json"
    shutil.copy(tag / "model.config.json", outside)
    os.replace(tag / "model.config.json", tmp_path / "moved")
    os.symlink(outside, tag / "model.config.json")
    with pytest.raises(ValueError, match="model.config.json: a symbolic link"):
        to_fp32(tag, tmp_path / "out", progress=False)
    os.unlink(tag / "model.config.json")
    os.replace(tmp_path / "moved", tag / "model.config.json")
    monkeypatch.setattr(model_config, "MAX_CONFIG_BYTES", 64)
    with pytest.raises(ValueError, match=r"model.config.json: the manifest says \d+ bytes, more than a model config holds"):
        to_fp32(tag, tmp_path / "out", progress=False)


def test_a_manifest_listing_configs_is_checked(saved, tmp_path):
    tag = _copy(saved, tmp_path)
    manifest = json.loads((tag / "manifest.json").read_text())
    (tag / "manifest.json").write_text(json.dumps({**manifest, "version": 2}))
    with pytest.raises(ValueError, match=r"manifest.json: format version 2 lists config files \['model.config.json'"):
        open_checkpoint(tag)
    files = dict(manifest["files"])
    files["model.other_config.json"] = files.pop("model.generation_config.json")
    (tag / "manifest.json").write_text(json.dumps({**manifest, "files": files}))
    with pytest.raises(ValueError, match=r"4 files listed, 2 expected \(the model file and one per rank, besides config"):
        open_checkpoint(tag)
    universal = to_universal(saved, tmp_path / "u", progress=False)
    data = json.loads((universal / "universal.json").read_text())
    data["model_configs"]["config.json"] = data["model_configs"].pop("model.config.json")
    (universal / "universal.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"universal.json: inconsistent manifest: model_configs names \['config.json'\]"):
        to_fp32(universal, tmp_path / "out", progress=False)


def test_a_save_refuses_a_config_that_is_no_json_object_on_every_rank(tmp_path):
    from zeroshard.checkpoint.testing import synthesize_state
    from zeroshard.layout import ParamSpec, build_layout
    from universal_helpers import save_synthetic

    layout = build_layout([[ParamSpec.of("a", (7, 5), "bf16")]], 2)
    states = [synthesize_state(layout, rank) for rank in range(2)]
    for state in states:
        state.model_configs = {"config.json": "[]"}
    with pytest.raises(ValueError, match="cannot save: rank 0: model config config.json: a JSON list, not the object"):
        save_synthetic(tmp_path / "ck", layout, states=states)
    for state in states:
        state.model_configs = {"tokenizer.json": "{}"}
    with pytest.raises(ValueError, match="model config file 'tokenizer.json' is not one of config.json, generation_config.json"):
        save_synthetic(tmp_path / "ck", layout, states=states)
