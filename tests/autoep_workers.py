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


def engine_load(rank: int, world_size: int, path: str, ep_sizes: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Spawned rank: for each EP in ``ep_sizes``, the transformers Qwen3-MoE (the main
    environment's transformers) made expert-parallel by ``zeroshard.moe.expert_parallel`` and
    put under a ZeroOptimizer (stage 2, bf16, ``moe_param_groups``) loads the AutoEP checkpoint
    at ``path`` with load_checkpoint. Returns, per EP, every parameter's fp32 master, Adam
    states and weight (collectives: every rank gathers), an expert stack's by global expert id
    (``"fp32/{name}/{g}"``), and the lr and step."""
    from autoep_fixtures import MODEL_CONFIG
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from zeroshard.checkpoint.engine_io import load_checkpoint
    from zeroshard.engine import ZeroOptimizer
    from zeroshard.moe import expert_modules, expert_parallel, moe_param_groups, new_expert_groups

    out = {}
    for ep_size in ep_sizes:
        groups = new_expert_groups(ep_size)
        torch.manual_seed(1)  # other weights than the run's: the load must replace all of them
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MODEL_CONFIG))
        expert_parallel(model, groups)
        engine = ZeroOptimizer(
            model, torch.optim.AdamW, moe_param_groups(model), expert_process_group=groups.expert_dp,
            stage=2, param_dtype=torch.bfloat16, lr=1.0,
        )  # fmt: skip
        extra = load_checkpoint(engine, path)
        ids = {f"{prefix}.{leaf}": c.expert_ids for prefix, c in expert_modules(model).items() for leaf in c.stacks}
        found: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters():
            values = {"fp32": engine.get_full_fp32_param(name), "weight": param.detach().float()}
            values.update((key, engine.get_full_optimizer_state(name, key)) for key in STATES[1:])
            for key, value in values.items():
                if name in ids:  # this rank's experts, by global id
                    found.update((f"{key}/{name}/{g}", value[local].clone()) for local, g in enumerate(ids[name]))
                else:
                    found[f"{key}/{name}"] = value.clone()
        found["lr"] = torch.tensor([group["lr"] for group in engine.param_groups], dtype=torch.float64)
        found["global_steps"] = torch.tensor(extra["global_steps"])
        out[ep_size] = found
    return out
