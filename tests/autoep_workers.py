"""Shared by the AutoEP tests: DeepSpeed's own universal output in the transformers model's
names (the reference), and the engine run that loads an AutoEP checkpoint online.

The reference is built from ``ds_to_universal``'s files by hand, not by the reader's mapping:
``gate_up_proj = cat(w1, w3)`` along dimension 1 (DeepSpeed's preset splits gate_up_proj rows
``[:I]`` into w1 and ``[I:]`` into w3), ``down_proj = w2``, ``gate.weight = router.gate.weight``.
"""

from __future__ import annotations

from pathlib import Path

import torch

STATES = ("fp32", "exp_avg", "exp_avg_sq")


def ds_reference(universal: Path, key: str, num_layers: int) -> dict[str, torch.Tensor]:
    """``ds_to_universal``'s ``key`` tensor of every trained parameter, under the model's names."""
    zero = universal / "zero"

    def load(name: str) -> torch.Tensor:
        return torch.load(zero / name / f"{key}.pt", weights_only=True)["param"].detach()

    out = {}
    autoep_names = set()
    for layer in range(num_layers):
        block = f"model.layers.{layer}.mlp"
        out[f"{block}.experts.gate_up_proj"] = torch.cat(
            [load(f"{block}.experts.w1"), load(f"{block}.experts.w3")], dim=1
        )
        out[f"{block}.experts.down_proj"] = load(f"{block}.experts.w2")
        out[f"{block}.gate.weight"] = load(f"{block}.router.gate.weight")
        # AutoEP's alias of the router: ds_to_universal writes it as an untrained tensor (fp32 only).
        autoep_names |= {f"{block}.experts.w{i}" for i in (1, 2, 3)} | {
            f"{block}.router.gate.weight",
            f"{block}.gate.gate.weight",
        }
    for folder in sorted(zero.iterdir()):
        if folder.is_dir() and folder.name not in autoep_names:
            out[folder.name] = load(folder.name)
    return out


def engine_load(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    """Spawned rank: the transformers Qwen3-MoE (the main environment's transformers) under a
    ZeroOptimizer, stage 2 bf16, its stacks in an expert group at EP = 1; loads the AutoEP
    checkpoint at ``path`` with load_checkpoint and returns, from every rank, every parameter's
    full fp32 master and Adam state (collectives: every rank gathers) and the step."""
    from autoep_fixtures import MODEL_CONFIG
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from zeroshard.checkpoint.engine_io import load_checkpoint
    from zeroshard.engine import ZeroOptimizer
    from zeroshard.moe import new_expert_groups

    groups = new_expert_groups(ep_size=1)
    torch.manual_seed(1)  # other weights than the run's: the load must replace all of them
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MODEL_CONFIG))
    experts = [p for name, p in model.named_parameters() if ".mlp.experts." in name]
    dense = [p for name, p in model.named_parameters() if ".mlp.experts." not in name]
    engine = ZeroOptimizer(
        model, torch.optim.AdamW, [{"params": dense}, {"params": experts, "expert": True}],
        expert_process_group=groups.expert_dp, stage=2, param_dtype=torch.bfloat16, lr=1.0,
    )  # fmt: skip
    extra = load_checkpoint(engine, path)
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        out[f"fp32/{name}"] = engine.get_full_fp32_param(name).detach().clone()
        for key in STATES[1:]:
            out[f"{key}/{name}"] = engine.get_full_optimizer_state(name, key).detach().clone()
        out[f"weight/{name}"] = param.detach().float().clone()
    out["lr"] = torch.tensor([group["lr"] for group in engine.param_groups], dtype=torch.float64)
    out["global_steps"] = torch.tensor(extra["global_steps"])
    return out
