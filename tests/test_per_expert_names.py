"""Per-expert export names are each one tensor's (issue 28, C3): two stacks whose per-expert
names overlap (a ``parts`` typo in ``declare_experts``, or an edited manifest) made ``to-fp32
--experts per-expert`` write one tensor under a name another already had (exit 0, tensors
missing, one holding another's values), and ``inspect --verify`` of that export said OK. Now
the stacks are refused where they are declared and where a manifest is read, the writer
refuses a repeated name, and ``--verify`` notices a name held twice."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from zeroshard.checkpoint.engine_io import save_checkpoint
from zeroshard.checkpoint.export.fp32 import to_fp32
from zeroshard.io.streaming import OutputTensor, write_shards
from zeroshard.io.safetensors_io import PlannedTensor
from zeroshard.checkpoint.native.source import NativeSource
from zeroshard.checkpoint.universal import to_universal
from zeroshard.cli.main import main
from zeroshard.engine import ZeroOptimizer
from zeroshard.layout import ExpertStack, GroupSpec, ParamSpec, build_layout
from zeroshard.moe import declare_experts, moe_param_groups

E, D_IN, D_OUT = 4, 8, 6
GATE_UP = ExpertStack("out_in", "stacked", ("gate_proj", "up_proj"))
DOWN = ExpertStack("out_in", "stacked", ("down_proj",))
TYPO = ExpertStack("out_in", "stacked", ("up_proj",))  # should have been down_proj


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * D_OUT, D_IN) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(E, D_IN, D_OUT) * 0.1)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D_IN, D_IN)
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.einsum("ti,oi->to", self.proj(x), self.experts.gate_up_proj[0])[:, :D_OUT]
        return torch.einsum("to,io->ti", hidden, self.experts.down_proj[1]).square().mean()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A run of the two stacks declared rightly, saved; and its universal checkpoint."""
    root = tmp_path_factory.mktemp("pair")
    torch.manual_seed(0)
    model = Model()
    declare_experts(model.experts, {"gate_up_proj": GATE_UP, "down_proj": DOWN})
    engine = ZeroOptimizer(model, torch.optim.AdamW, moe_param_groups(model), stage=2, lr=1e-2)
    engine.backward(model(torch.randn(4, D_IN)))
    engine.step()
    tag = save_checkpoint(engine, root / "ckpt")
    to_universal(tag, root / "universal", progress=False)
    return tag


def test_declare_experts_refuses_stacks_naming_one_per_expert_tensor():
    with pytest.raises(ValueError) as refused:
        declare_experts(Experts(), {"gate_up_proj": GATE_UP, "down_proj": TYPO})
    assert str(refused.value).count("\n") == 0
    assert "expert stacks 'gate_up_proj' and 'down_proj' both name per-expert tensor '0.up_proj.weight'" in str(
        refused.value
    )


def test_declare_experts_refuses_a_per_expert_name_another_tensor_has():
    module = Experts()
    holder = nn.Module()
    holder.register_buffer("weight", torch.zeros(1))
    module.add_module("1", holder)  # its tensor "1.weight": what a stack named "weight" writes for expert 1
    module.weight = nn.Parameter(torch.zeros(E, 3))
    with pytest.raises(ValueError, match=r"expert stack 'weight' names per-expert tensor '1\.weight', the name of another"):
        declare_experts(module, {"weight": "none"})


def test_a_layout_refuses_stacks_naming_one_per_expert_tensor():
    """The route of param groups with ``expert_stacks`` (and of every layout read back)."""
    specs = (ParamSpec.of("m.gate_up_proj", (E, 2 * D_OUT, D_IN), "fp32"), ParamSpec.of("m.down_proj", (E, D_IN, D_OUT), "fp32"))
    group = GroupSpec(specs, "ep", 1, (tuple(range(E)),), (GATE_UP, DOWN))
    build_layout([group], 1)
    with pytest.raises(ValueError, match="expert stacks 'm.gate_up_proj' and 'm.down_proj' both name per-expert tensor 'm.0.up_proj.weight'"):
        build_layout([dataclasses.replace(group, stacks=(GATE_UP, TYPO))], 1)


def _edit(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _typo_in_native(data: dict) -> None:
    for group in data["layout"]["groups"]:
        for param in group["params"]:
            if param["name"] == "experts.down_proj":
                param["stack"]["parts"] = ["up_proj"]


@pytest.mark.parametrize("kind", ["native", "universal"])
def test_an_edited_manifest_naming_one_tensor_twice_is_refused_naming_the_file(saved, tmp_path, kind, capsys):
    if kind == "native":
        path = Path(shutil.copytree(saved, tmp_path / "tag"))
        manifest = path / "manifest.json"
        _edit(manifest, _typo_in_native)
    else:
        path = Path(shutil.copytree(saved.parent.parent / "universal", tmp_path / "universal"))
        manifest = path / "universal.json"
        _edit(manifest, lambda data: data["expert_stacks"]["experts.down_proj"].update(parts=["up_proj"]))
    code = main(["to-fp32", "--no-progress", "--experts", "per-expert", str(path), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"zeroshard to-fp32: error: {manifest}: "), err
    assert "'experts.gate_up_proj' and 'experts.down_proj' both name per-expert tensor 'experts.0.up_proj.weight'" in err
    assert not (tmp_path / "out").exists()


def test_the_export_writer_refuses_two_tensors_of_one_name(saved, tmp_path):
    """Past every check (a layout changed in memory): the writer still names the clash."""
    with NativeSource(saved) as source:
        layout = source.info.layout
        groups = [
            dataclasses.replace(group, stacks=(GATE_UP, TYPO)) if group.is_expert_group else group for group in layout.groups
        ]
        source.info.layout = dataclasses.replace(layout, groups=tuple(groups))
        with pytest.raises(ValueError, match=r"'experts.gate_up_proj' and 'experts.down_proj' would both be written as tensor 'experts.0.up_proj.weight'"):
            to_fp32(source, tmp_path / "out", experts="per_expert", progress=False)
    assert not (tmp_path / "out").exists()


def test_write_shards_refuses_one_key_in_two_files(tmp_path):
    tensors = [OutputTensor(PlannedTensor("a", "float32", (2,)), lambda: np.zeros(2, np.float32)) for _ in range(2)]
    with pytest.raises(ValueError, match="tensor 'a' is planned twice"):
        write_shards(tmp_path, tensors, [range(0, 1), range(1, 2)], ["one.safetensors", "two.safetensors"], block_size=64)
    assert list(tmp_path.iterdir()) == []


def test_the_right_stacks_export_every_expert_once(saved, tmp_path):
    from safetensors import safe_open

    out = to_fp32(saved, tmp_path / "out", experts="per_expert", progress=False)
    with safe_open(out / "model.safetensors", "np") as handle:
        names = set(handle.keys())
    parts = ("gate_proj", "up_proj", "down_proj")
    assert names == {"proj.weight", "proj.bias", *(f"experts.{g}.{p}.weight" for g in range(E) for p in parts)}


# ---- inspect --verify of an export notices a name held twice ----------------------------------------


def _write_raw(path: Path, header: dict, data: bytes) -> None:
    encoded = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def _crc(data: bytes) -> int:
    import zlib

    return zlib.crc32(data)


def _digests(tensors: dict[str, bytes]) -> str:
    record = {"format": "zeroshard.fp32-digests", "version": 1, "algorithm": "crc32", "dtype": "float32"}
    return json.dumps({**record, "tensors": {name: _crc(data) for name, data in tensors.items()}})


def test_verify_notices_a_tensor_name_in_two_shards(tmp_path, capsys):
    one, two = np.arange(2, dtype=np.float32).tobytes(), np.ones(2, dtype=np.float32).tobytes()
    meta = {"format": "pt", "zeroshard": "fp32 export"}
    _write_raw(tmp_path / "model-00001-of-00002.safetensors", {"__metadata__": meta, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, one + two)  # fmt: skip
    _write_raw(tmp_path / "model-00002-of-00002.safetensors", {"__metadata__": meta, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, one)  # fmt: skip
    index = {"metadata": {"total_size": 24}, "weight_map": {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}}  # fmt: skip
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "zeroshard.digests.json").write_text(_digests({"a": one, "b": two}))
    assert main(["inspect", "--verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"{tmp_path / 'model-00002-of-00002.safetensors'}: tensor 'a' is also in model-00001-of-00002.safetensors" in out


def test_verify_notices_a_header_holding_a_name_twice(tmp_path, capsys):
    one, two = np.arange(2, dtype=np.float32).tobytes(), np.ones(2, dtype=np.float32).tobytes()
    text = (
        '{"__metadata__":{"format":"pt","zeroshard":"fp32 export"},'
        '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}'
    ).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + one + two)
    (tmp_path / "zeroshard.digests.json").write_text(_digests({"a": two}))  # the last one's, as a reader keeps it
    assert main(["inspect", "--verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"{tmp_path / 'model.safetensors'}: corrupted: key 'a' appears twice in one JSON object" in out


def test_a_manifest_whose_stack_names_a_module_tensor_is_refused_naming_the_file(saved, tmp_path):
    from zeroshard.checkpoint import open_checkpoint

    path = Path(shutil.copytree(saved, tmp_path / "tag"))
    _edit(path / "manifest.json", lambda data: data["model"]["aliases"].update({"experts.2.down_proj.weight": "proj.bias"}))
    with pytest.raises(ValueError) as refused:
        open_checkpoint(path)
    assert str(refused.value) == (
        f"{path / 'manifest.json'}: expert stack 'experts.down_proj' names per-expert tensor "
        "'experts.2.down_proj.weight', the name of another tensor of the model"
    )


def test_verify_notices_an_index_naming_a_tensor_twice(tmp_path, capsys):
    one = np.arange(2, dtype=np.float32).tobytes()
    meta = {"format": "pt", "zeroshard": "fp32 export"}
    shard = "model-00001-of-00001.safetensors"
    _write_raw(tmp_path / shard, {"__metadata__": meta, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, one)
    index = '{"metadata": {"total_size": 8}, "weight_map": {"a": "%s", "a": "%s"}}' % (shard, shard)
    (tmp_path / "model.safetensors.index.json").write_text(index)
    (tmp_path / "zeroshard.digests.json").write_text(_digests({"a": one}))
    assert main(["inspect", "--verify", str(tmp_path)]) == 1
    index_file = tmp_path / "model.safetensors.index.json"
    assert f"{index_file}: corrupted: key 'a' appears twice in one JSON object" in capsys.readouterr().out
