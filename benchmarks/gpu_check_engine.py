"""gpu_check.py, check 1: the engine on the device equals the engine on the CPU.

The demo TinyGPT (width 36: odd-sized norms and biases, so alignment is earned by padding)
trains under ZeroOptimizer at D=1 on the device and on the CPU, from the same fp32 values,
for stages 1 and 2 in bf16 and fp16 (dynamic loss scaling), with clipping at 1.0 and two
micro-batches per step; stage 2 with several buckets.

The loss is a linear probe of the parameters, ``sum_p <p, c_p>``, with coefficients
``c = k / 2`` (k an integer in [-8, 8], drawn on the CPU per step and micro-batch): its
gradient is ``c`` exactly on any device, in bf16, in fp16 and scaled by any power of two,
so the two runs differ only by the engine's own arithmetic (accumulation, unscaling, the
norm, clipping, AdamW, the casts), whose rounding is bounded below. The real loss of the
model at its first step is compared too, against the bound of its bf16/fp16 forward.
"""

from __future__ import annotations

import math

import torch

from gpu_check_common import U_FP32, UNIT_ROUNDOFF, CheckResult, Context, gamma
from zeroshard.engine import ZeroOptimizer
from zeroshard.layout import LayoutPolicy
from zeroshard.models import GPTConfig, TinyGPT, gpt_param_groups

LR, BETAS, WEIGHT_DECAY, CLIP, ACCUMULATION = 1e-3, (0.9, 0.95), 0.1, 1.0, 2
STAGE2_BUCKET_NUMEL = 4096  # several buckets for the demo model's ~37k parameters
FP16_SKIPS = 2  # |c| <= 4: 4 * 2^16 / 2 and 4 * 2^15 / 2 overflow fp16 (max 65504), 4 * 2^14 / 2 does not
CONFIGS = [(stage, dtype) for stage in (1, 2) for dtype in (torch.bfloat16, torch.float16)]
OPS_PER_BLOCK = 12  # rounded results on a TinyGPT block's forward path (norms, matmuls, softmax, gelu, adds)


def _param_groups(model: TinyGPT) -> list[dict]:
    params = dict(model.named_parameters())
    decay, no_decay = gpt_param_groups(model)
    return [
        {"params": [params[n] for n in decay], "weight_decay": WEIGHT_DECAY},
        {"params": [params[n] for n in no_decay], "weight_decay": 0.0},
    ]


def _coefficients(shapes: list[torch.Size], step: int, micro: int) -> list[torch.Tensor]:
    """k / 2 for integers k in [-8, 8]: exact in bf16 and fp16 times any power of two. With
    fp16's first loss scale (2^16, halved by the two micro-batches) a coefficient of 4
    overflows, so the fp16 runs skip their first two steps, as the dynamic scaler must."""
    generator = torch.Generator().manual_seed(1000 * step + micro)
    return [torch.randint(-8, 9, shape, generator=generator).float() / 2 for shape in shapes]


def _batch(config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, config.vocab_size, (4, config.block_size + 1), generator=torch.Generator().manual_seed(7))
    return tokens[:, :-1], tokens[:, 1:]


def train_probe(device: torch.device, stage: int, dtype: torch.dtype, steps: int) -> dict:
    """One run: the model's first real loss, then ``steps`` steps of the linear probe.
    Returns the loss, which steps were applied, the norms, the fp32 masters (on the CPU)
    and how many parameter views start off 16 bytes."""
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    policy = LayoutPolicy.native(bucket_numel=STAGE2_BUCKET_NUMEL) if stage == 2 else None
    engine = ZeroOptimizer(
        model, torch.optim.AdamW, _param_groups(model), stage=stage, param_dtype=dtype, policy=policy,
        gradient_accumulation_steps=ACCUMULATION, max_grad_norm=CLIP, lr=LR, betas=BETAS,
    )  # fmt: skip
    params = list(model.named_parameters())
    misaligned = sum(param.data_ptr() % 16 != 0 for _, param in params)
    idx, targets = (t.to(device) for t in _batch(model.config))
    with torch.no_grad():
        first_loss = model(idx, targets).item()
    applied, norms = [], []
    for step in range(steps):
        for micro in range(ACCUMULATION):
            coefficients = _coefficients([p.shape for _, p in params], step, micro)
            loss = sum((p.float() * c.to(device)).sum() for (_, p), c in zip(params, coefficients))
            engine.backward(loss)
        applied.append(bool(engine.step()))
        norms.append(float(engine.last_grad_norm) if applied[-1] and engine.last_grad_norm is not None else 0.0)
        engine.zero_grad()
    masters = {name: engine.get_full_fp32_param(name).cpu() for name, _ in params}
    return {"loss": first_loss, "applied": applied, "norms": norms, "masters": masters, "misaligned": misaligned}


def adam_ratio_bound(t: int, beta1: float, beta2: float) -> float:
    """A bound on |m_hat / sqrt(v_hat)| after t Adam steps, for any gradients: since
    v_t >= (1 - b2) b2^(t-i) g_i^2 for each i, |m_t| <= (1 - b1) / sqrt(1 - b2) sqrt(v_t)
    sum_j (b1 / sqrt(b2))^j; the bias corrections multiply it by sqrt(1 - b2^t) / (1 - b1^t)."""
    series = sum((beta1 / math.sqrt(beta2)) ** j for j in range(t))
    return (1 - beta1) / math.sqrt(1 - beta2) * series * math.sqrt(1 - beta2**t) / (1 - beta1**t)


def master_bound(reference: torch.Tensor, steps: int, numel: int) -> torch.Tensor:
    """Per element, the most two correct runs of the same AdamW steps on identical gradients
    can differ by. Step t's update lr * r_t (|r_t| <= R_t) carries m and v from t steps of
    three roundings each, r's own (bias corrections, sqrt, eps, divide: 5) and the clip
    coefficient's (a norm over ``numel`` squares: gamma_{numel+2}); writing it (decay,
    subtract: 3 roundings) rounds against |w| + lr R_t. Twice that: one per run."""
    clip_error = gamma(numel + 2, U_FP32)
    per_element = torch.zeros_like(reference, dtype=torch.float64)
    for t in range(1, steps + 1):
        update = LR * adam_ratio_bound(t, *BETAS)
        per_element += ((5 * t + 5) * U_FP32 + clip_error) * update
        per_element += 3 * U_FP32 * (reference.double().abs() + update)
    return 2 * per_element


def run(context: Context) -> CheckResult:
    result = CheckResult("engine_equal")
    steps = 6 if context.size == "full" else 3
    cpu = torch.device("cpu")
    blocks = TinyGPT().config.n_layer
    for stage, dtype in CONFIGS:
        tag = f"stage{stage}_{str(dtype).removeprefix('torch.')}"
        device_run = train_probe(context.device, stage, dtype, steps)
        cpu_run = device_run if not context.cuda else train_probe(cpu, stage, dtype, steps)
        numel = sum(m.numel() for m in cpu_run["masters"].values())
        worst = max(
            ((device_run["masters"][n] - ref).double().abs() / master_bound(ref, steps, numel)).max().item()
            for n, ref in cpu_run["masters"].items()
        )
        result.figure(f"{tag}_master_error_per_bound", worst)
        result.compare(f"{tag}_masters", f"{tag}_master_error_per_bound", "<=", 1.0, "AdamW rounding bound (master_bound)")
        differ = sum(a != b for a, b in zip(device_run["applied"], cpu_run["applied"]))
        result.figure(f"{tag}_skipped_steps_differ", differ)
        result.figure(f"{tag}_steps_skipped", steps - sum(device_run["applied"]))
        must_skip = FP16_SKIPS if dtype == torch.float16 else 0
        result.compare(f"{tag}_skips", f"{tag}_steps_skipped", "==", must_skip, "the scaler's back-offs the probe forces")
        result.compare(f"{tag}_same_overflows", f"{tag}_skipped_steps_differ", "==", 0, "fp16 overflow is exact: same steps skipped")
        norm_error = max((abs(a - b) / b if b else abs(a) for a, b in zip(device_run["norms"], cpu_run["norms"])), default=0.0)
        result.figure(f"{tag}_norm_rel_diff", norm_error)
        result.compare(f"{tag}_norms", f"{tag}_norm_rel_diff", "<=", gamma(numel + 2, U_FP32), "fp32 sum of numel squares, twice")
        loss_error = abs(device_run["loss"] - cpu_run["loss"]) / abs(cpu_run["loss"])
        result.figure(f"{tag}_first_loss_rel_diff", loss_error)
        chain = OPS_PER_BLOCK * blocks + 3
        result.compare(
            f"{tag}_first_loss", f"{tag}_first_loss_rel_diff", "<=", 2 * gamma(chain, UNIT_ROUNDOFF[dtype]),
            f"{chain} rounded ops in {str(dtype).removeprefix('torch.')}, twice",
        )  # fmt: skip
        result.figure(f"{tag}_misaligned_views", device_run["misaligned"])
        result.compare(f"{tag}_aligned", f"{tag}_misaligned_views", "==", 0, "every view starts on 16 bytes")
    if not context.cuda:
        result.notes.append("--cpu: the device run is the CPU run; the comparison exercises the code only")
    return result

