"""gpu_check.py, check 2: the grouped GEMM on the engine's expert views.

* MoEGPT under ZeroOptimizer (stage 2, bf16, D=1): a forward and backward through
  ``torch._grouped_mm`` with every call recorded (:class:`zeroshard.moe.recorder.GroupedMMRecorder`,
  the CPU-side rule check of data_ptr and strides); on CUDA the kernel itself checks them.
* Each expert view through ``torch._grouped_mm`` (and ``F.grouped_mm`` where torch has it),
  forward and backward, against a per-expert matmul loop in fp32 on the same bf16 values.
* The same weights in a compact flat buffer behind a one-element parameter (where a compact
  layout puts them after an odd-sized one): on CUDA the call must raise the kernel's
  alignment error; the CPU kernel does not check (the rule check flags it instead).
* The transformers Qwen3-MoE model, if transformers is installed, with its grouped_mm
  experts: every grouped GEMM call reads a 16-byte aligned view of the flat buffer.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F

from gpu_check_common import U_BF16, U_FP32, CheckResult, Context, gamma, relative_error
from zeroshard.buffers import bind_flat_buffer, owns_storage
from zeroshard.demos.moe import expert_weights
from zeroshard.engine import ZeroOptimizer
from zeroshard.layout import LayoutPolicy, ParamSpec, build_layout
from zeroshard.moe import MoEConfig, MoEGPT, moe_param_groups, new_expert_groups
from zeroshard.moe.recorder import GroupedMMRecorder, grouped_mm_problems

SMALL = MoEConfig(vocab_size=31, n_layer=2)
FULL = MoEConfig(vocab_size=1024, block_size=128, n_layer=2, n_head=4, n_embd=256, num_experts=8, top_k=2, expert_hidden=512)


def _moe_engine(context: Context) -> tuple[MoEGPT, ZeroOptimizer]:
    groups = new_expert_groups(1)
    torch.manual_seed(0)
    model = MoEGPT(FULL if context.size == "full" else SMALL, ep_group=groups.ep).to(context.device)
    engine = ZeroOptimizer(
        model, torch.optim.AdamW, moe_param_groups(model), expert_process_group=groups.expert_dp,
        stage=2, param_dtype=torch.bfloat16, lr=1e-4,
    )  # fmt: skip
    return model, engine


def _loop(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor, bounds: list[int]) -> list[torch.Tensor]:
    """out, d a, d b of the grouped product, one matmul per group (whatever dtype given)."""
    pieces = list(zip(bounds, bounds[1:]))
    out = torch.cat([a[s:e] @ b[i] for i, (s, e) in enumerate(pieces)])
    grad_a = torch.cat([g[s:e] @ b[i].T for i, (s, e) in enumerate(pieces)])
    grad_b = torch.stack([a[s:e].T @ g[s:e] for s, e in pieces])
    return [out, grad_a, grad_b]


def _grouped_against_loop(kernel, weight: torch.Tensor, device: torch.device, seed: int) -> list[tuple[float, float]]:
    """(relative error, bound) of out, d tokens, d weight. The bound: one bf16 rounding of
    each result, plus an fp32 sum of K products on each side (kernel and loop), which is
    gamma_K |a||b| componentwise, so relative to ||ab|| it is scaled by || |a||b| || / ||ab||."""
    experts, rows_in, _ = weight.shape
    generator = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 33, (experts,), generator=generator)
    counts[experts // 2] = 0  # an expert with no tokens, as routing produces
    bounds = [0, *counts.cumsum(0).tolist()]
    tokens = torch.randn(bounds[-1], rows_in, generator=generator).to(torch.bfloat16).to(device).requires_grad_(True)
    offsets = counts.cumsum(0).to(torch.int32).to(device)
    out = kernel(tokens, weight, offs=offsets)
    cotangent = torch.randn(out.shape, generator=generator).to(torch.bfloat16).to(device)
    grads = torch.autograd.grad(out, [tokens, weight], cotangent)
    a, b, g = (t.detach().double().cpu() for t in (tokens, weight, cotangent))
    exact = _loop(a, b, g, bounds)
    magnitude = _loop(a.abs(), b.abs(), g.abs(), bounds)
    loop32 = _loop(a.float(), b.float(), g.float(), bounds)
    inner = (weight.shape[1], weight.shape[2], int(counts.max()))  # K of out, d tokens, d weight
    results = []
    for value, reference, ref32, size, k in zip([out, *grads], exact, loop32, magnitude, inner):
        ratio = size.norm().item() / max(reference.norm().item(), 1e-300)
        sums = gamma(k, U_FP32) * ratio  # one side's fp32 sums, relative to ||ab||
        results.append((relative_error(value, ref32), U_BF16 * (1 + sums) + 2 * sums))
    return results


def compact_probe(weight: torch.Tensor, device: str) -> dict:
    """Put ``weight``'s values in a compact flat buffer on ``device``, right after a
    one-element parameter (where a compact layout puts whatever follows an odd-sized
    parameter), and call ``torch._grouped_mm`` on that view under the recorder. Returns
    the view's address mod 16, the rule check's verdict and the kernel's error ("" if none)."""
    specs = [ParamSpec("lead", (1,), "bfloat16"), ParamSpec("experts", tuple(weight.shape), "bfloat16")]
    policy = LayoutPolicy.native(compact=True)
    params = [nn.Parameter(torch.zeros(1, dtype=torch.bfloat16)), nn.Parameter(weight.detach().cpu().clone())]
    bind_flat_buffer(build_layout([specs], 1, policy).groups[0], params, torch.device(device), policy)
    compact = params[1]
    experts = compact.shape[0]
    offsets = torch.full((experts,), experts, dtype=torch.int32).cumsum(0).to(torch.int32)
    tokens = torch.randn(int(offsets[-1]), compact.shape[1]).to(torch.bfloat16).to(device)
    recorder = GroupedMMRecorder(0, {"compact": (compact, tuple(range(experts)), True)})
    error = ""
    with recorder.watching(), torch.no_grad():
        try:
            torch._grouped_mm(tokens, compact, offs=offsets.to(device))
            if compact.is_cuda:
                torch.cuda.synchronize()
        except RuntimeError as err:
            error = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    [call] = recorder.at_step(0)
    return {"address_mod_16": compact.data_ptr() % 16, "rule_check_aligned": call.aligned, "error": error}


def _compact_probe_in_child(weight: torch.Tensor, device: str, results) -> None:
    try:
        results.put(compact_probe(weight, device))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        results.put({"crash": f"{type(err).__name__}: {err}"})


def compact_probe_in_child(weight: torch.Tensor, device: str) -> dict:
    """:func:`compact_probe` in a fresh process. On CUDA that is where it runs: were the
    kernel to take the misaligned pointer and fault, the fault (sticky in a CUDA context)
    stays there, and the other checks go on."""
    spawn = multiprocessing.get_context("spawn")
    results = spawn.SimpleQueue()
    child = spawn.Process(target=_compact_probe_in_child, args=(weight.detach().cpu(), device, results))
    child.start()
    child.join(timeout=300)
    if child.is_alive():
        child.kill()
        child.join()
    if results.empty():
        return {"crash": f"the probe process ended without a result (exit code {child.exitcode})"}
    return results.get()


def _moe_gpt(context: Context, result: CheckResult) -> None:
    model, engine = _moe_engine(context)
    weights = expert_weights(model, engine)
    recorder = GroupedMMRecorder(0, weights)
    idx = torch.randint(0, model.config.vocab_size, (4, model.config.block_size), generator=torch.Generator().manual_seed(0))
    idx = idx.to(context.device)
    with recorder.watching():
        engine.backward(model(idx, idx))
    context.sync()
    calls = recorder.at_step(0)
    result.figure("moegpt_grouped_mm_calls", len(calls))
    result.figure("moegpt_calls_on_aligned_flat_views", sum(c.aligned and c.in_flat_buffer for c in calls))
    result.figure("moegpt_expert_views", len(weights))
    result.compare("moegpt_calls", "moegpt_grouped_mm_calls", "==", len(weights), "one call per stacked weight per forward")
    result.compare(
        "moegpt_all_aligned", "moegpt_calls_on_aligned_flat_views", "==", len(calls), "every call read an aligned view in the buffer"
    )
    grads_ok = all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    result.figure("moegpt_backward_finite", int(grads_ok))
    result.compare("moegpt_backward", "moegpt_backward_finite", "==", 1, "backward through the kernel gave finite gradients")
    kernels = {"torch._grouped_mm": torch._grouped_mm}
    if hasattr(F, "grouped_mm"):
        kernels["F.grouped_mm"] = F.grouped_mm
    else:
        result.skipped["F.grouped_mm"] = "this torch has no torch.nn.functional.grouped_mm"
    worst = {key: 0.0 for key in ("out", "grad_tokens", "grad_weight")}
    for label, kernel in kernels.items():
        for seed, (name, (weight, _, _)) in enumerate(weights.items()):
            for key, (error, bound) in zip(worst, _grouped_against_loop(kernel, weight, context.device, seed)):
                worst[key] = max(worst[key], error / bound)
    for key, value in worst.items():
        result.figure(f"grouped_mm_{key}_error_per_bound", value)
        result.compare(f"grouped_mm_{key}", f"grouped_mm_{key}_error_per_bound", "<=", 1.0, "bf16 rounding + fp32 sums")
    _compact(context, result, next(iter(weights.values()))[0])


def _compact(context: Context, result: CheckResult, weight: torch.Tensor) -> None:
    probe = compact_probe_in_child(weight, str(context.device)) if context.cuda else compact_probe(weight, "cpu")
    if "crash" in probe:
        raise RuntimeError(f"compact probe: {probe['crash']}")
    result.figure("compact_view_address_mod_16", probe["address_mod_16"])
    result.figure("compact_rule_check_aligned", int(probe["rule_check_aligned"]))
    result.compare("rule_check_flags_compact", "compact_rule_check_aligned", "==", 0, "data_ptr % 16 != 0")
    result.figure("compact_refused", int(bool(probe["error"])))
    if context.cuda:
        result.compare("cuda_refuses_compact", "compact_refused", "==", 1, "CUDA's grouped GEMM checks alignment")
        result.notes.append(f"CUDA's error on the compact view: {probe['error'] or 'none raised'}")
    else:
        result.skipped["cuda_refuses_compact"] = "the CPU kernel does not check alignment (the rule check does)"


# ---- transformers' Qwen3-MoE --------------------------------------------------------------------


@contextlib.contextmanager
def _recording_grouped_mm(modules: list) -> Iterator[list[torch.Tensor]]:
    """Wrap every grouped-mm entry point found on ``modules``; yields the weights they read."""
    seen: list[torch.Tensor] = []
    replaced = []
    for module in modules:
        for attribute in ("_grouped_mm", "grouped_mm"):
            real = getattr(module, attribute, None)
            if callable(real):

                def recording(a, b, *args, _real=real, **kwargs):
                    seen.append(b)
                    return _real(a, b, *args, **kwargs)

                setattr(module, attribute, recording)
                replaced.append((module, attribute, real))
    try:
        yield seen
    finally:
        for module, attribute, real in replaced:
            setattr(module, attribute, real)


def _kernel_aligned(weight: torch.Tensor) -> bool:
    """CUDA's rules (zeroshard.moe.recorder.grouped_mm_problems: base and each expert on 16
    bytes, a 16-byte leading stride of a row- or column-major matrix)."""
    return not grouped_mm_problems(weight)


def _qwen3_moe(context: Context, result: CheckResult) -> None:
    try:
        import transformers
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    except ImportError as err:
        result.skipped["qwen3_moe"] = f"transformers is not installed here ({type(err).__name__})"
        return
    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=128, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(context.device)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("grouped_mm")
    engine = ZeroOptimizer(model, torch.optim.AdamW, stage=2, param_dtype=torch.bfloat16, lr=1e-4)
    experts = {n: p for n, p in model.named_parameters() if p.dim() == 3}
    result.figure("qwen3_expert_views", len(experts))
    result.figure("qwen3_expert_views_misaligned", sum(not _kernel_aligned(p) for p in experts.values()))
    modules = [torch, F]
    with contextlib.suppress(ImportError):
        import transformers.integrations.moe as hf_moe

        modules.append(hf_moe)
    ids = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).to(context.device)
    with _recording_grouped_mm(modules) as seen:
        engine.backward(model(input_ids=ids, labels=ids).loss)
    context.sync()
    in_buffer = [any(owns_storage(buffer, w) for buffer in engine.buffers) and _kernel_aligned(w) for w in seen]
    result.figure("qwen3_grouped_mm_calls", len(seen))  # each entry point counts (transformers' and torch's)
    result.figure("qwen3_calls_on_aligned_flat_views", sum(in_buffer))
    read = {w.data_ptr() for w in seen} & {p.data_ptr() for p in experts.values()}
    result.figure("qwen3_expert_views_read_in_place", len(read))
    result.compare("qwen3_calls", "qwen3_expert_views_read_in_place", "==", len(experts), "grouped_mm read every expert view")
    result.compare("qwen3_all_aligned", "qwen3_calls_on_aligned_flat_views", "==", len(seen), "aligned views of the buffer")
    result.compare("qwen3_views", "qwen3_expert_views_misaligned", "==", 0, "every expert view aligned")
    result.notes.append(f"transformers {transformers.__version__}, experts implementation "
                        f"{getattr(model.config, '_experts_implementation', None)!r}")


def run(context: Context) -> CheckResult:
    result = CheckResult("grouped_mm")
    _moe_gpt(context, result)
    try:
        _qwen3_moe(context, result)
    except Exception as err:  # noqa: BLE001 - transformers' API moves; MoEGPT's figures stand
        result.figure("qwen3_crashed", 1)
        result.compare("qwen3_ran", "qwen3_crashed", "==", 0, "the Qwen3-MoE part ran")
        result.notes.append(f"Qwen3-MoE crashed: {type(err).__name__}: {str(err)[:300]}")
    return result
