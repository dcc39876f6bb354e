"""The MoE layer on one process: against a naive per-token loop, its grouped GEMMs on aligned
zero-copy views of a flat buffer, per-expert state dicts, and the dense/expert split."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from zeroshard.buffers import bind_flat_buffer, owns_storage
from zeroshard.layout import ExpertMesh, LayoutPolicy, build_layout
from zeroshard.moe import GroupedExperts, MoEConfig, MoEFeedForward, MoEGPT, expert_param_names, layout_groups
from zeroshard.moe import per_expert_state_dict

DIM, HIDDEN, EXPERTS, TOP_K = 16, 24, 4, 2
U32 = 2.0**-24  # fp32 unit roundoff
# The layer and the loop compute the same fp32 products in other groupings: an output sums
# TOP_K experts of HIDDEN-term and DIM-term dot products, a weight gradient sums over the
# 21 tokens too. Another order of an n-term sum is within 2 n u of its terms' magnitude,
# which relative_diff divides by (values of order one): outputs n <= DIM + HIDDEN + TOP_K,
# gradients add the 21 tokens.
OUTPUT_TOLERANCE = 2 * (DIM + HIDDEN + TOP_K) * U32
GRAD_TOLERANCE = 2 * (DIM + HIDDEN + TOP_K + 21) * U32


def scaled_layer(top_k: int = TOP_K, seed: int = 0) -> MoEFeedForward:
    torch.manual_seed(seed)
    layer = MoEFeedForward(DIM, HIDDEN, EXPERTS, top_k)
    with torch.no_grad():  # weights of order one, so outputs and gradients are too
        for param in layer.parameters():
            param.normal_(0.0, 0.5)
    return layer


def naive_forward(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax, top-k, renormalise, weighted sum of SwiGLU experts."""
    w1, w2, w3 = layer.experts.w1, layer.experts.w2, layer.experts.w3
    outputs = []
    for token in x.reshape(-1, x.shape[-1]):
        probabilities = F.softmax(token @ layer.gate.weight.t(), dim=-1)
        weights, experts = probabilities.topk(layer.top_k)
        weights = weights / weights.sum()
        outputs.append(sum(w * ((F.silu(token @ w1[e]) * (token @ w3[e])) @ w2[e]) for w, e in zip(weights, experts)))
    return torch.stack(outputs).view_as(x)


def relative_diff(value: torch.Tensor, reference: torch.Tensor) -> float:
    """max |value - reference| over max(max |reference|, 1): relative for values of order one
    or more, absolute below (top-1's renormalised weight is 1, so its router gradient is 0)."""
    return ((value - reference).abs().max() / reference.abs().max().clamp_min(1.0)).item()


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_layer_equals_naive_per_token_loop(top_k):
    layer = scaled_layer(top_k)
    x = torch.randn(3, 7, DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)
    cotangent = torch.randn(3, 7, DIM, generator=torch.Generator().manual_seed(2))
    weights = [x, layer.gate.weight, layer.experts.w1, layer.experts.w2, layer.experts.w3]
    output = layer(x)
    grads = list(torch.autograd.grad((output * cotangent).sum(), weights))
    reference = naive_forward(layer, x)
    reference_grads = list(torch.autograd.grad((reference * cotangent).sum(), weights))
    assert reference.abs().max() > 1.0
    assert relative_diff(output, reference) < OUTPUT_TOLERANCE
    if top_k == 1:  # the router's gradient is exactly zero (the one weight is p / p = 1) ...
        router, reference_router = grads.pop(1), reference_grads.pop(1)
        assert router.abs().max() <= router_noise_bound(x, cotangent, reference)
        assert reference_router.abs().max() <= router_noise_bound(x, cotangent, reference)
    for grad, expected in zip(grads, reference_grads):
        assert relative_diff(grad, expected) < GRAD_TOLERANCE


def router_noise_bound(x: torch.Tensor, cotangent: torch.Tensor, output: torch.Tensor) -> float:
    """... so both computations give only rounding noise: the softmax backward cancels terms
    of size |cotangent . output| per token to within a few roundings each, and the weight's
    gradient sums those times |x| over the 21 tokens: 2 n u of that sum, n = EXPERTS + 21."""
    per_token = (cotangent * output).sum(-1).abs().reshape(-1)
    magnitude = (x.detach().abs().reshape(-1, DIM).T @ per_token.detach()).max().item()
    return 2 * (EXPERTS + x.shape[0] * x.shape[1]) * U32 * magnitude


def test_experts_with_no_tokens_get_zero_gradients():
    torch.manual_seed(0)
    experts = GroupedExperts(DIM, HIDDEN, range(4), 4)
    counts = torch.tensor([3, 0, 2, 0])
    rows = torch.randn(5, DIM, requires_grad=True)
    output = experts(rows, counts)
    bounds = [0, 3, 3, 5, 5]
    expected = torch.cat(
        [
            (F.silu(rows[a:b] @ experts.w1[e]) * (rows[a:b] @ experts.w3[e])) @ experts.w2[e]
            for e, (a, b) in enumerate(zip(bounds, bounds[1:]))
        ]
    )
    assert relative_diff(output, expected) < OUTPUT_TOLERANCE
    output.backward(torch.randn_like(output))
    assert experts.w1.grad[[1, 3]].abs().max() == 0 and experts.w1.grad[[0, 2]].abs().min() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_mm_on_cpu_matches_per_group_matmuls(dtype):
    """What torch 2.13's CPU kernel was verified to do: 2-D x 3-D with int32 cumulative
    offsets, forward and backward, in every dtype a flat buffer holds for training."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(10, 8, generator=generator).to(dtype).requires_grad_(True)
    b = torch.randn(3, 8, 16, generator=generator).to(dtype).requires_grad_(True)
    offsets = torch.tensor([3, 7, 10], dtype=torch.int32)
    out = torch._grouped_mm(a, b, offs=offsets)
    cotangent = torch.randn(10, 16, generator=generator).to(dtype)
    grads = torch.autograd.grad(out, [a, b], cotangent)
    a32, b32 = a.detach().float().requires_grad_(True), b.detach().float().requires_grad_(True)
    expected = torch.cat([a32[0:3] @ b32[0], a32[3:7] @ b32[1], a32[7:10] @ b32[2]])
    expected_grads = torch.autograd.grad(expected, [a32, b32], cotangent.float())
    # Same inputs on both sides; sums of at most n = 16 terms (the output gradient's rows).
    # fp32: another order, 2 n u. bf16: accumulated in fp32 (the bf16 dot-product instructions
    # and their AVX2 emulation both do), the result rounded once: 2^-9, bounded by 2 x 2^-8.
    # fp16: a kernel may accumulate in fp16 (AVX512-FP16 CPUs): n roundings of 2^-11.
    tolerance = {torch.float32: 2 * 16 * U32, torch.bfloat16: 2 * 2.0**-8, torch.float16: 16 * 2.0**-11}[dtype]
    assert out.dtype == dtype and relative_diff(out.float(), expected) < tolerance
    for grad, ref in zip(grads, expected_grads):
        assert relative_diff(grad.float(), ref) < tolerance
    with pytest.raises(RuntimeError, match="int32"):
        torch._grouped_mm(a, b, offs=offsets.long())


def bind_model(model: torch.nn.Module, mesh: ExpertMesh, policy: LayoutPolicy = LayoutPolicy()):
    layout = build_layout(layout_groups(model, mesh, "bfloat16"), mesh.world_size, policy)
    params = dict(model.named_parameters())
    buffers = [bind_flat_buffer(g, [params[s.name] for s in g.params], torch.device("cpu"), policy) for g in layout.groups]
    return layout, buffers


def test_grouped_mm_reads_16_byte_aligned_views_of_the_flat_buffer(monkeypatch):
    model = MoEGPT(MoEConfig(vocab_size=31, n_layer=2)).to(torch.bfloat16)
    layout, buffers = bind_model(model, ExpertMesh(1, 1))
    expert_buffer = buffers[1]
    assert layout.groups[1].is_expert_group and layout.groups[1].expert_map == ((0, 1, 2, 3),)
    views = {name: param for name, param in model.named_parameters() if ".experts." in name}
    for name, view in views.items():
        assert owns_storage(expert_buffer, view), name
        assert view.data_ptr() % 16 == 0, name
        for expert in view:  # each expert's matrix and each of its rows start on 16 bytes
            assert expert.data_ptr() % 16 == 0 and expert.stride(0) * expert.element_size() % 16 == 0, name

    calls = []
    real_grouped_mm = torch._grouped_mm

    def recording_grouped_mm(a, b, offs=None, **kwargs):
        calls.append(b.data_ptr())
        return real_grouped_mm(a, b, offs=offs, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", recording_grouped_mm)
    idx = torch.randint(0, 31, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = model(idx, idx)
    loss.backward()
    # Every grouped GEMM read an expert weight in place, at its aligned address in the buffer.
    assert sorted(calls) == sorted(view.data_ptr() for view in views.values())
    assert all(view.grad is not None and view.grad.abs().max() > 0 for view in views.values())
    monkeypatch.undo()
    # The same forward on copies of the weights (outside the buffer) gives the same loss.
    copy = MoEGPT(MoEConfig(vocab_size=31, n_layer=2)).to(torch.bfloat16)
    copy.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    assert copy(idx, idx).item() == loss.item()


def test_expert_views_pass_the_cuda_kernel_checks_on_meta_tensors():
    """torch's meta registration of _grouped_mm mirrors the CUDA checks (bf16, 16-byte row
    strides): MoEConfig's expert views pass them; a width of 12 bf16 (24-byte rows) fails."""
    model = MoEGPT(MoEConfig(vocab_size=31)).to(torch.bfloat16)
    bind_model(model, ExpertMesh(1, 1))
    offsets = torch.empty(4, dtype=torch.int32, device="meta")
    for name, view in model.named_parameters():
        if ".experts." in name:
            weight = torch.empty_strided(view.shape, view.stride(), dtype=view.dtype, device="meta")
            tokens = torch.empty(10, view.shape[1], dtype=view.dtype, device="meta")
            assert torch._grouped_mm(tokens, weight, offs=offsets).shape == (10, view.shape[2])
    narrow = torch.empty(4, 32, 12, dtype=torch.bfloat16, device="meta")
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        torch._grouped_mm(torch.empty(10, 32, dtype=torch.bfloat16, device="meta"), narrow, offs=offsets)


def test_expert_partitions_at_ep_2_are_aligned_on_every_expert_dp_rank():
    mesh = ExpertMesh(4, 2)
    experts = GroupedExperts(32, 48, (2, 3), 4).to(torch.bfloat16)
    layout, (buffer,) = _bind_experts(experts, mesh)
    group = layout.groups[0]
    assert (group.world_size, group.shard_group, group.expert_map) == (2, "expert_dp", ((0, 1), (2, 3)))
    for rank in range(group.world_size):
        assert buffer.rank_slice(0, rank).data_ptr() % 16 == 0
    assert all(p.data_ptr() % 16 == 0 and owns_storage(buffer, p) for p in experts.parameters())


def test_compact_layout_misaligns_odd_sized_experts():
    """The alignment above comes from the native layout: packed odd experts are misaligned."""
    experts = GroupedExperts(5, 3, (0, 1), 2).to(torch.bfloat16)
    _, (buffer,) = _bind_experts(experts, ExpertMesh(1, 1), LayoutPolicy.native(compact=True))
    assert experts.w2.data_ptr() % 16 != 0  # after 2 x 5 x 3 bf16 elements = 60 bytes
    _, (buffer,) = _bind_experts(experts, ExpertMesh(1, 1))
    assert all(p.data_ptr() % 16 == 0 for p in experts.parameters())


def _bind_experts(experts: GroupedExperts, mesh: ExpertMesh, policy: LayoutPolicy = LayoutPolicy()):
    from zeroshard.models import param_specs

    layout = build_layout([mesh.expert_group(param_specs(experts), experts.num_experts)], mesh.world_size, policy)
    group = layout.groups[0]
    params = dict(experts.named_parameters())
    return layout, [bind_flat_buffer(group, [params[s.name] for s in group.params], torch.device("cpu"), policy)]


# ---- per-expert state dicts (the export naming) -----------------------------------------------


def test_per_expert_state_dict_has_mixtral_names_and_loads_strictly():
    model = MoEGPT(MoEConfig(vocab_size=31))
    state = per_expert_state_dict(model)
    assert not any(name.endswith(("experts.w1", "experts.w2", "experts.w3")) for name in state)
    config = model.config
    for layer in range(config.n_layer):
        for expert in range(config.num_experts):
            stacked = model.blocks[layer].moe.experts
            prefix = f"blocks.{layer}.moe.experts.{expert}"
            assert torch.equal(state[f"{prefix}.w1.weight"], stacked.w1[expert].t())  # [hidden, dim], as nn.Linear
            assert state[f"{prefix}.w2.weight"].shape == (config.n_embd, config.expert_hidden)
            assert torch.equal(state[f"{prefix}.w3.weight"], stacked.w3[expert].t())
    again = MoEGPT(MoEConfig(vocab_size=31))
    again.load_state_dict(state, strict=True)
    idx = torch.randint(0, 31, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(again(idx), model(idx))


def test_an_ep_rank_loads_its_own_experts_by_global_id():
    torch.manual_seed(0)
    full = GroupedExperts(DIM, HIDDEN, range(4), 4)
    local = GroupedExperts(DIM, HIDDEN, (2, 3), 4)
    local.load_state_dict(per_expert_state_dict(full), strict=True)
    for name in ("w1", "w2", "w3"):
        assert torch.equal(getattr(local, name), getattr(full, name)[2:4])
    # A local expert missing: the stacked weight is reported missing under strict loading.
    state = per_expert_state_dict(full)
    del state["3.w2.weight"]
    with pytest.raises(RuntimeError, match='Missing key.*"w2"'):
        local.load_state_dict(state, strict=True)
    state = per_expert_state_dict(full)
    state["2.w1.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=r"size mismatch for 2.w1.weight: expected shape \[24, 16\], got \[3, 3\]"):
        local.load_state_dict(state, strict=True)
    state = per_expert_state_dict(full)
    state["4.w1.weight"] = torch.zeros(HIDDEN, DIM)  # no expert 4 in a model of 4 experts
    with pytest.raises(RuntimeError, match='Unexpected key.*"4.w1.weight"'):
        local.load_state_dict(state, strict=True)


# ---- the dense / expert split -------------------------------------------------------------------


def test_expert_param_names_and_layout_groups():
    model = MoEGPT(MoEConfig(vocab_size=31, n_layer=2))
    dense, expert = expert_param_names(model)
    assert expert == [f"blocks.{i}.moe.experts.{w}" for i in range(2) for w in ("w1", "w2", "w3")]
    assert "wte.weight" in dense and "lm_head.weight" not in dense  # tied: listed once
    assert "blocks.0.moe.gate.weight" in dense  # the router is dense: every rank holds it
    assert set(dense) | set(expert) == {name for name, _ in model.named_parameters()}
    layout = build_layout(layout_groups(model, ExpertMesh(8, 1), "bfloat16"), 8)
    assert layout.shard_groups == {"dp": 8, "expert_dp": 8}
    assert [slot.name for slot in layout.groups[1].params] == expert
    # Without an EP group the model holds all 4 experts: too many for one EP rank of 4.
    with pytest.raises(ValueError, match="stack 1 local experts in their first dimension, got shape \\[4, 32, 48\\]"):
        build_layout(layout_groups(model, ExpertMesh(8, 4), "bfloat16"), 8)


def test_top_k_must_fit_the_experts():
    with pytest.raises(ValueError, match="top_k must be between 1 and the 4 experts, got 5"):
        MoEFeedForward(DIM, HIDDEN, 4, top_k=5)
