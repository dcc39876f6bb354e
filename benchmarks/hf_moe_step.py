"""The transformers Qwen3-MoE (unmodified, ``experts_implementation="grouped_mm"``) made
expert-parallel by ``zeroshard.moe.expert_parallel``, under ZeRO stage 2 at W = 4 with EP = 1,
2, 4 (gloo, CPU).

One spawn of 4 ranks builds one engine per EP (bf16 parameters, fp32 masters and fp32
reduction, AdamW) from one seeded model and trains them interleaved, step by step in a
rotating order so load on the machine hits every EP alike. Per EP it prints, as
``moe_step.py`` does for MoEGPT:

* per-rank memory against ``2 (P_d + P_e E/EP) + 16 (P_d / W + P_e E/W)`` bytes;
* bytes per step and rank by collective: the all-to-all payload (token rows to other EP
  ranks, forward and backward, and the per-slot counts) against the minimum, the routed rows
  whose expert is on another EP rank, each sent four times (dispatch, combine, and their
  gradients), as the mean over ranks; the reduce-scatter and all-gather payloads against the
  fp32 gradient and bf16 parameters of what the rank holds (padding excluded);
* the median step time (forward, backward, step) against EP = 1.

    .venv/bin/python benchmarks/hf_moe_step.py [--steps 20]
"""

from __future__ import annotations

import argparse

import torch
import moe_step  # its all-to-all counter and memory figure

from zeroshard.engine import ZeroOptimizer
from zeroshard.launch import spawn
from zeroshard.moe import expert_modules, expert_parallel, moe_param_groups, new_expert_groups

WORLD_SIZE = 4
EP_SIZES = (1, 2, 4)
CONFIG = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
    max_position_embeddings=64, decoder_sparse_step=1, mlp_only_layers=[], experts_implementation="grouped_mm",
)  # fmt: skip
BATCH_SIZE, SEQ = 8, 64  # per rank


def batch(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step * 101 + rank)
    return torch.randint(0, CONFIG["vocab_size"], (BATCH_SIZE, SEQ), generator=generator)


def build(ep_size: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    groups = new_expert_groups(ep_size)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))
    expert_parallel(model, groups)
    engine = ZeroOptimizer(
        model, torch.optim.AdamW, moe_param_groups(model), stage=2, param_dtype=torch.bfloat16,
        expert_process_group=groups.expert_dp, max_grad_norm=1.0, lr=3e-3, weight_decay=0.1,
    )  # fmt: skip
    return groups, model, engine


def off_rank_rows(model, ids: torch.Tensor) -> int:
    """Routed (token, choice) rows of this rank whose expert another EP rank holds (all layers)."""
    rows = 0
    hooks = []
    for prefix, contract in expert_modules(model).items():
        mine = torch.zeros(contract.num_experts, dtype=torch.bool)
        mine[list(contract.expert_ids)] = True

        def count(module, args, _mine=mine):
            nonlocal rows
            rows += int((~_mine[args[1]]).sum())

        hooks.append(model.get_submodule(prefix).register_forward_pre_hook(count))
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    return rows


def worker(rank: int, world_size: int, steps: int) -> dict:
    runs = {ep: build(ep) for ep in EP_SIZES}

    def train_step(ep: int, step: int) -> None:
        _, model, engine = runs[ep]
        ids = batch(step, rank)
        engine.backward(model(input_ids=ids, labels=ids).loss)

    def off_rank(ep: int, step: int) -> int:
        return off_rank_rows(runs[ep][1], batch(step, rank))

    return moe_step.interleaved_steps(runs, steps, CONFIG["hidden_size"] * 2, train_step, off_rank)  # bf16 rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    per_rank = spawn(worker, WORLD_SIZE, (args.steps,), backend="gloo", timeout_s=1800)
    print(f"transformers Qwen3MoeForCausalLM {CONFIG}, W={WORLD_SIZE}, stage 2, bf16, {args.steps} steps")
    moe_step.print_step_table(per_rank, EP_SIZES)


if __name__ == "__main__":
    main()
