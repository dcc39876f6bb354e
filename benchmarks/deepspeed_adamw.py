"""DeepSpeed 0.19.8's ZeRO-2 engine as the load benchmarks build it (load_bytes.py,
load_vs_deepspeed.py): torch's AdamW, bf16 parameters, micro-batches of 4, nothing printed."""

from __future__ import annotations


def zero2_bf16_adamw(model, param_groups: list[dict], lr: float, betas: tuple[float, float]):
    """``deepspeed.initialize`` of ``model`` under that configuration; the engine."""
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "torch_adam": True}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups, config=config)
    return engine
