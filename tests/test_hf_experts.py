"""transformers v5 experts modules in one process (issue 20): recognised by the contract, made
expert-parallel without changing what they compute, loaded from pretrained checkpoints rank by
rank, exported in transformers' own per-expert names as an option, and checked against
grouped_mm's CUDA rules (which CPU torch does not check)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

import torch  # noqa: E402
from hf_moe_workers import CONFIG, qwen3_moe  # noqa: E402
from safetensors import safe_open  # noqa: E402

from zeroshard.checkpoint.engine_io import save_checkpoint  # noqa: E402
from zeroshard.checkpoint.export.fp32 import to_fp32  # noqa: E402
from zeroshard.engine import ZeroOptimizer  # noqa: E402
from zeroshard.layout import ExpertMesh, ExpertStack, LayoutPolicy  # noqa: E402
from zeroshard.moe import (  # noqa: E402
    ExpertGroups,
    GroupedMMRecorder,
    MoEConfig,
    MoEGPT,
    expert_modules,
    expert_parallel,
    grouped_mm_problems,
    load_pretrained,
    moe_param_groups,
)
from zeroshard.moe import pretrained as pretrained_module  # noqa: E402


def _experts(family: str):
    """One tiny experts module of a transformers family, random weights, grouped_mm."""
    import transformers

    common = dict(hidden_size=16, hidden_act="silu", experts_implementation="grouped_mm")
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=8, **common)
        module = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
    elif family == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=4, intermediate_size=8, **common)
        module = transformers.models.mixtral.modeling_mixtral.MixtralExperts(config)
    elif family == "deepseek_v3":
        config = transformers.DeepseekV3Config(n_routed_experts=4, moe_intermediate_size=8, **common)
        module = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts(config)
    else:
        config = transformers.GptOssConfig(num_local_experts=4, intermediate_size=8, **common)
        module = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
    torch.manual_seed(0)
    for param in module.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return module


OUT_IN_GATE_UP = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ()}
FAMILIES = {
    "qwen3_moe": ("out_in", OUT_IN_GATE_UP),
    "deepseek_v3": ("out_in", OUT_IN_GATE_UP),
    "mixtral": ("out_in", {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}),
    "gpt_oss": ("in_out", {"gate_up_proj": (), "down_proj": (), "gate_up_proj_bias": (), "down_proj_bias": ()}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_experts_are_recognised_by_class(family):
    orientation, parts = FAMILIES[family]
    [(name, contract)] = expert_modules(_experts(family)).items()
    assert name == "" and contract.expert_map == ((0, 1, 2, 3),) and contract.ep_rank == 0
    assert set(contract.stacks) == set(parts)
    for leaf, stack in contract.stacks.items():
        expected = "none" if leaf.endswith("_bias") else orientation
        assert stack == ExpertStack(expected, "stacked", parts[leaf]), leaf


def _route(tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.rand(tokens, 4, generator=generator).softmax(-1)
    weights, index = scores.topk(2, dim=-1)
    return index, weights


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_at_ep_1_the_expert_parallel_forward_computes_what_the_module_does(family):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(12, 16, generator=generator)
    index, weights = _route(12, generator)
    results = []
    for placement in (None, [[2, 0, 3, 1]]):
        module = _experts(family)
        if placement is None:
            reference = module(x, index, weights)
            grads = torch.autograd.grad(reference.square().sum(), list(module.parameters()))
            results.append((reference, dict(zip(dict(module.named_parameters()), grads))))
        expert_parallel(module, None, expert_map=placement)
        out = module(x, index, weights)
        named = dict(module.named_parameters())
        grads = dict(zip(named, torch.autograd.grad(out.square().sum(), list(named.values()))))
        results.append((out, grads, placement))
    (reference, ref_grads), (same, same_grads, _), (permuted, permuted_grads, _) = results
    assert torch.equal(same, reference)  # the identity placement runs the module's own code on the same rows
    assert all(torch.equal(same_grads[n], ref_grads[n]) for n in ref_grads)
    # Another placement reorders the experts' rows only, so at most the order of a sum changes:
    # within 2 n u of the sum of its terms' magnitudes (u = 2^-24), n the longest sum: H = 16
    # inputs of an expert's matrix rows, the 12 token rows of a weight gradient. The magnitudes
    # are bounded norm-wise, by the reference's largest element (seen: outputs equal, gradients
    # within 1.6e-7 of their largest element; with AVX2 kernels, ATEN_CPU_CAPABILITY=avx2,
    # 6.4e-8 and 2.4e-7).
    bound = 2 * 16 * 2.0**-24
    assert torch.allclose(permuted, reference, rtol=bound, atol=bound * reference.abs().max().item())
    order = torch.tensor([2, 0, 3, 1])
    for name, grad in permuted_grads.items():
        expected = ref_grads[name][order]
        assert torch.allclose(grad, expected, rtol=bound, atol=bound * expected.abs().max().item()), name


def test_expert_parallel_refusals():
    with pytest.raises(ValueError, match="has no experts module"):
        expert_parallel(torch.nn.Linear(2, 2), None)
    with pytest.raises(ValueError, match="already expert-parallel"):
        expert_parallel(MoEGPT(MoEConfig(vocab_size=31, n_layer=1)), None)
    with pytest.raises(ValueError, match="places 4 experts on 1 EP ranks; the model has 4 experts and the EP group 2 ranks"):
        expert_parallel(_experts("qwen3_moe"), ExpertGroups(ExpertMesh(2, 2), 0, None, None), expert_map=[[0, 1, 2, 3]])
    module = _experts("qwen3_moe")
    expert_parallel(module, ExpertGroups(ExpertMesh(2, 2), 1, None, None))  # no EP group to reach the others
    with pytest.raises(RuntimeError, match="no EP group"):
        module(torch.zeros(2, 16), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))


# ---- pretrained weights in ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny Qwen3-MoE as transformers' save_pretrained writes it (per expert), and stacked."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("pretrained")
    model = qwen3_moe()
    model.save_pretrained(root / "per_expert")
    model.save_pretrained(root / "sharded", max_shard_size="40KB")  # an index and its shards
    assert (root / "sharded" / "model.safetensors.index.json").is_file()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "stacked.safetensors"))
    return model, root


@pytest.mark.parametrize("form", ["per_expert", "sharded", "stacked.safetensors", "state_dict"])
@pytest.mark.parametrize("placement", [None, [[0, 3], [1, 2]]])
def test_a_rank_reads_only_its_own_experts(saved, form, placement, monkeypatch):
    full, root = saved
    reads = []
    for method in ("get", "rows"):
        for reader in (pretrained_module._SafetensorsReader, pretrained_module._StateDictReader):
            real = getattr(reader, method)
            monkeypatch.setattr(reader, method, lambda self, name, *ids, _real=real, _m=method: reads.append((name, *ids)) or _real(self, name, *ids))
    model = qwen3_moe(seed=5, meta=True)  # EP rank 1 of 2, built on the meta device
    expert_parallel(model, ExpertGroups(ExpertMesh(2, 2), 1, None, None), expert_map=placement)
    source = full.state_dict() if form == "state_dict" else root / form
    report = load_pretrained(model, source)
    mine = (2, 3) if placement is None else (1, 2)
    expected = dict(full.state_dict())
    for name, tensor in model.state_dict().items():
        want = expected[name][torch.tensor(mine)] if name.endswith(("gate_up_proj", "down_proj")) else expected[name]
        assert torch.equal(tensor, want), name
    rotary = dict(full.named_buffers())["model.rotary_emb.inv_freq"]  # not in any checkpoint: computed again
    assert torch.equal(dict(model.named_buffers())["model.rotary_emb.inv_freq"], rotary)
    expert_reads = [read for read in reads if ".experts." in read[0]]
    if form in ("per_expert", "sharded"):
        assert report.per_expert and not report.stacked
        assert {int(name.split(".experts.")[1].split(".")[0]) for name, *_ in expert_reads} == set(mine)
    else:
        assert report.stacked and not report.per_expert
        assert {tuple(ids) for _, ids in expert_reads} == {mine}
    assert not report.unused


def test_load_pretrained_names_what_does_not_fit(saved, tmp_path):
    full, root = saved
    state = dict(full.state_dict())
    del state["model.layers.1.mlp.experts.down_proj"]
    state["extra.weight"] = torch.zeros(1)
    model = qwen3_moe(seed=5)
    before = model.model.embed_tokens.weight.clone()
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.experts.down_proj'\]; unexpected \['extra.weight'\]"):
        load_pretrained(model, state)
    assert torch.equal(model.model.embed_tokens.weight, before)  # nothing copied
    report = load_pretrained(model, state, strict=False)
    assert report.unused == ["extra.weight"]
    state["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"another shape than the model's: \['model.norm.weight \[3\] != \[32\]'\]"):
        load_pretrained(model, state, strict=False)
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        load_pretrained(model, tmp_path)


# ---- exports in transformers' own names ---------------------------------------------------------


def test_the_per_expert_export_is_what_save_pretrained_writes(saved, tmp_path):
    full, root = saved
    model = qwen3_moe()
    engine = ZeroOptimizer(model, torch.optim.AdamW, moe_param_groups(model), lr=1e-3)
    out = to_fp32(save_checkpoint(engine, tmp_path / "ckpt"), tmp_path / "fp32", progress=False, experts="per_expert")
    with safe_open(out / "model.safetensors", "pt") as ours, safe_open(root / "per_expert" / "model.safetensors", "pt") as theirs:
        assert sorted(ours.keys()) == sorted(theirs.keys())
        for name in theirs.keys():
            assert torch.equal(ours.get_tensor(name), theirs.get_tensor(name)), name


def test_from_pretrained_loads_the_export_of_a_checkpointer_save_with_no_config_added(tmp_path):
    """Issue 28 N3: the export had no config.json, so from_pretrained(out) built a default model."""
    from transformers import Qwen3MoeForCausalLM

    from zeroshard.checkpoint import Checkpointer

    model = qwen3_moe()
    engine = ZeroOptimizer(model, torch.optim.AdamW, moe_param_groups(model), lr=1e-2, param_dtype=torch.bfloat16)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    with Checkpointer(engine, tmp_path / "ckpt") as ckpt:  # asynchronous: the host snapshot carries the config
        engine.backward(model(input_ids=ids, labels=ids).loss)
        engine.step()
        ckpt.save(0)
    out = to_fp32(tmp_path / "ckpt", tmp_path / "fp32", progress=False)
    assert (out / "config.json").is_file()  # without it from_pretrained builds the default model: 30B parameters
    loaded, info = Qwen3MoeForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert loaded.dtype == torch.float32 and loaded.config.num_experts == CONFIG["num_experts"]
    assert loaded.generation_config is not None and (out / "generation_config.json").is_file()
    for name, param in loaded.named_parameters():
        assert torch.equal(param, engine.get_full_fp32_param(name)), name


# ---- grouped_mm's CUDA rules, checked on the CPU -------------------------------------------------


def _meta_accepts(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """torch's meta registration of _grouped_mm (the CUDA checks, mirrored) on a weight of these strides."""
    weight = torch.empty_strided(shape, strides, dtype=torch.bfloat16, device="meta")
    tokens = torch.empty_strided((8, shape[1]), (-(-shape[1] // 8) * 8, 1), dtype=torch.bfloat16, device="meta")
    offsets = torch.empty(shape[0], dtype=torch.int32, device="meta")
    try:
        torch._grouped_mm(tokens, weight, offs=offsets)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("experts, k, n", [(4, 16, 24), (4, 10, 24), (3, 24, 10), (2, 8, 8), (2, 5, 3)])
def test_the_stride_rule_is_torchs_own(experts, k, n):
    """Row-major [E, K, N] and the transposed view of an [E, N, K] stack (what transformers
    passes): the check's stride verdict equals torch's meta registration's."""
    row_major = torch.zeros(experts, k, n, dtype=torch.bfloat16)
    transposed = torch.zeros(experts, n, k, dtype=torch.bfloat16).transpose(-2, -1)
    for weight in (row_major, transposed):
        stride_problems = [p for p in grouped_mm_problems(weight) if "stride" in p]
        assert (not stride_problems) == _meta_accepts(tuple(weight.shape), weight.stride()), (weight.shape, weight.stride())


def test_the_check_reads_the_address_of_each_expert():
    storage = torch.zeros(200, dtype=torch.bfloat16)
    assert grouped_mm_problems(storage[:120].view(3, 5, 8)) == ()
    assert grouped_mm_problems(storage[1:121].view(3, 5, 8)) == ("data_ptr % 16 = 2",)
    # Experts 40 bytes apart: each matrix is row-major with 16-byte rows, but every other one starts off 16.
    spaced = storage.as_strided((3, 2, 8), (20, 8, 1))
    assert grouped_mm_problems(spaced) == ("expert matrices at data_ptr % 16 = [0, 8]",)
    assert grouped_mm_problems(storage[:24].view(3, 8)[:, :5]) == ()  # a 2-d operand, 16-byte rows
    assert grouped_mm_problems(storage[:15].view(3, 5)) == ("stride of dimension 0 is 10 bytes, not a multiple of 16",)


def test_a_compact_layout_fails_the_check_on_every_call_and_gradient():
    """The issue's measurement: Qwen3-MoE with head_dim 10, every expert replicated in one bf16
    buffer with the attention weights, under a compact layout gives every grouped_mm a misaligned
    expert view; the native layout gives none."""
    verdicts = {}
    for label, policy in (("compact", LayoutPolicy.native(compact=True)), ("native", None)):
        model = qwen3_moe()
        engine = ZeroOptimizer(model, torch.optim.AdamW, param_dtype=torch.bfloat16, policy=policy, lr=1e-3)
        views = {n: (p, tuple(range(4)), True) for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))}
        recorder = GroupedMMRecorder(0, views)
        ids = torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
        with recorder.watching():
            engine.backward(model(input_ids=ids, labels=ids).loss)
        calls = recorder.at_step(0)
        assert len(calls) == len(recorder.gradients) == 2 * CONFIG["num_hidden_layers"]
        assert all(call.param for call in calls)  # every call read one of the stacks, in place
        off = sum(weight.data_ptr() % 16 != 0 for weight, _, _ in views.values())  # from the addresses alone
        verdicts[label] = (sum(not call.aligned for call in calls), off, len(recorder.problems()))
    assert verdicts["native"] == (0, 0, 0)
    misaligned, off, problems = verdicts["compact"]
    # head_dim 10 puts each layer's experts 40 bytes further: layer 0's off 16 bytes (layer 1's back on).
    assert misaligned == off >= CONFIG["num_hidden_layers"] and problems >= misaligned
