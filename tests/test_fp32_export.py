"""fp32 export: Hugging Face safetensors of the module state_dict, from any checkpoint kind."""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from universal_helpers import PatternSource, bits, save_synthetic

from zeroshard.checkpoint import run_ranks, save_sharded
from zeroshard.checkpoint.export.fp32 import load_fp32_state_dict, to_fp32
from zeroshard.checkpoint.testing import pattern
from zeroshard.checkpoint.universal import to_universal
from zeroshard.engine import ZeroOptimizer
from zeroshard.layout import LayoutPolicy, ParamSpec, build_layout
from zeroshard.models import GPTConfig, TinyGPT, gpt_param_groups

CONFIG = GPTConfig(vocab_size=31, block_size=8, n_layer=2, n_head=2, n_embd=16)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A TinyGPT trained 3 steps by a single-process engine (stage 2, bf16, two param groups,
    wpe frozen), saved natively; the engine is returned for its fp32 masters."""
    root = tmp_path_factory.mktemp("trained")
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    model.wpe.weight.requires_grad_(False)
    model.wpe.to(torch.bfloat16)  # frozen, so the engine leaves its dtype alone
    decay, no_decay = gpt_param_groups(model)
    params = dict(model.named_parameters())
    groups = [
        {"params": [params[n] for n in decay if n in params], "weight_decay": 0.1},
        {"params": [params[n] for n in no_decay if n in params], "weight_decay": 0.0},
    ]
    engine = ZeroOptimizer(model, torch.optim.AdamW, groups, param_dtype=torch.bfloat16, lr=1e-2)
    data = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.block_size + 1))
    for _ in range(3):
        engine.backward(engine.model(data[:, :-1], data[:, 1:]))
        engine.step()
        engine.zero_grad()
    state = engine.export_state()
    # The tie survives the export, so the checkpoint records lm_head.weight as an alias.
    assert state.model_state["lm_head.weight"] is state.model_state["wte.weight"]
    run_ranks(1, lambda c: save_sharded(root, "step3", state, coordinator=c, buffer_names=["positions"]))
    return engine, root / "step3"


def test_export_loads_strictly_and_equals_the_live_masters(trained, tmp_path):
    engine, checkpoint = trained
    out = to_fp32(checkpoint, tmp_path / "fp32", progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "zeroshard.digests.json"]
    with safe_open(out / "model.safetensors", "pt") as handle:
        assert handle.metadata() == {"format": "pt", "zeroshard": "fp32 export"}
    exported = load_file(out / "model.safetensors")
    # The digests record what was written: zlib.crc32 of each tensor's bytes, every name.
    recorded = json.loads((out / "zeroshard.digests.json").read_text())
    assert (recorded["format"], recorded["algorithm"], recorded["dtype"]) == ("zeroshard.fp32-digests", "crc32", "float32")
    assert recorded["tensors"] == {name: zlib.crc32(t.view(torch.uint8).numpy().tobytes()) for name, t in exported.items()}
    model = TinyGPT(CONFIG)
    model.load_state_dict(exported, strict=True)
    assert exported.keys() == model.state_dict().keys()
    for name in engine.layout.param_names:
        master = engine.get_full_fp32_param(name)
        assert exported[name].dtype == torch.float32
        assert torch.equal(bits(exported[name]), bits(master)), name
    assert torch.equal(exported["lm_head.weight"], exported["wte.weight"])
    assert torch.equal(exported["positions"], torch.arange(CONFIG.block_size))
    # Frozen: saved in bf16, cast to the export dtype.
    assert exported["wpe.weight"].dtype == torch.float32
    assert torch.equal(exported["wpe.weight"], engine.model.wpe.weight.float())


def test_bf16_export_and_the_universal_route_agree(trained, tmp_path):
    engine, checkpoint = trained
    direct = to_fp32(checkpoint, tmp_path / "direct", dtype="bf16", progress=False)
    universal = to_universal(checkpoint, tmp_path / "universal", progress=False)
    via = to_fp32(universal, tmp_path / "via", dtype=torch.bfloat16, progress=False)
    assert (direct / "model.safetensors").read_bytes() == (via / "model.safetensors").read_bytes()
    exported = load_file(via / "model.safetensors")
    assert exported["blocks.0.fc.weight"].dtype == torch.bfloat16 and exported["positions"].dtype == torch.int64
    assert torch.equal(exported["blocks.0.fc.weight"], engine.get_full_fp32_param("blocks.0.fc.weight").bfloat16())


def test_sharded_export_has_a_correct_index(trained, tmp_path):
    engine, checkpoint = trained
    out = to_fp32(checkpoint, tmp_path / "sharded", max_shard_size=8000, progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards == sorted(set(index["weight_map"].values()))
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    merged = {}
    for shard in shards:
        tensors = load_file(out / shard)
        assert {k for k, v in index["weight_map"].items() if v == shard} == tensors.keys()
        assert sum(t.nbytes for t in tensors.values()) <= 8000 or len(tensors) == 1
        merged.update(tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in merged.values())
    TinyGPT(CONFIG).load_state_dict(merged, strict=True)
    assert not (out / "model.safetensors").exists()


def test_load_fp32_state_dict(trained):
    engine, checkpoint = trained
    state = load_fp32_state_dict(checkpoint)
    TinyGPT(CONFIG).load_state_dict(state, strict=True)
    assert state["lm_head.weight"] is state["wte.weight"]
    assert torch.equal(state["ln_f.bias"], engine.get_full_fp32_param("ln_f.bias"))
    half = load_fp32_state_dict(checkpoint, dtype=torch.float16)
    assert half["ln_f.bias"].dtype == torch.float16 and half["positions"].dtype == torch.int64


def test_large_d_exports_match_the_pattern(tmp_path):
    specs = [[ParamSpec.of("a.weight", (300, 400), "bf16")], [ParamSpec.of("b.weight", (266240,), "bf16")]]
    layout = build_layout(specs, 4096, LayoutPolicy.native())
    out = to_fp32(PatternSource(layout), tmp_path / "fp32", max_shard_size=500_000, progress=False)
    merged = {}
    for shard in sorted(out.glob("*.safetensors")):
        merged.update(load_file(shard))
    assert merged.keys() == {"a.weight", "b.weight", "tied.alias", "positions"}
    assert torch.equal(merged["a.weight"].reshape(-1), pattern("a.weight", "fp32", 120000))
    assert torch.equal(merged["b.weight"], pattern("b.weight", "fp32", 266240))
    assert torch.equal(merged["tied.alias"], merged["a.weight"])


def test_d768_native_checkpoint_exports_the_pattern(tmp_path):
    specs = [[ParamSpec.of("small", (266240,), "bf16")], [ParamSpec.of("big", (700, 900), "bf16")]]
    layout = build_layout(specs, 768, LayoutPolicy.deepspeed())
    state = load_fp32_state_dict(save_synthetic(tmp_path / "ck", layout, block_size=1 << 16))
    assert torch.equal(state["small"], pattern("small", "fp32", 266240))
    assert torch.equal(state["big"].reshape(-1), pattern("big", "fp32", 630000))
    assert torch.equal(state["frozen.weight"].reshape(-1), pattern("frozen.weight", "fp32", 6))
