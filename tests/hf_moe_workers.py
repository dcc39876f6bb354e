"""Worker code for the transformers MoE tests: an unmodified transformers v5 Qwen3-MoE (tiny
config, random weights, ``experts_implementation="grouped_mm"``) made expert-parallel by
``zeroshard.moe.expert_parallel`` and trained by ZeroOptimizer on spawned gloo ranks, against
the same model trained in one process by plain torch AdamW on the union of the ranks' batches.

Every rank builds the same full model from one seed and keeps its own experts. The data is
one global batch per step, split into equal row blocks by rank, so every (W, EP) sees the
same global batch and the mean of the ranks' losses is the reference's loss. Workers return
numbers (losses, max abs differences, tensors by global expert id), never verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from zeroshard.checkpoint.engine_io import load_checkpoint, save_checkpoint
from zeroshard.demos.moe import expert_weights
from zeroshard.engine import ZeroOptimizer
from zeroshard.moe import (
    GroupedMMRecorder,
    expert_modules,
    expert_parallel,
    load_pretrained,
    moe_param_groups,
    new_expert_groups,
)

# head_dim 10: q_norm and k_norm (10 elements) put a compact layout's next view 40 bytes in.
CONFIG = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=10, num_experts=4, num_experts_per_tok=2,
    max_position_embeddings=32, decoder_sparse_step=1, mlp_only_layers=[], experts_implementation="grouped_mm",
)  # fmt: skip
GLOBAL_BATCH, SEQ, STEPS, MORE_STEPS = 8, 8, 3, 2
OPTIONS = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
ADAM_STATES = ("exp_avg", "exp_avg_sq")


def qwen3_moe(seed: int = 0, meta: bool = False):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))


def global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + step))


def rank_batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    rows = GLOBAL_BATCH // world_size
    return global_batch(step)[rank * rows : (rank + 1) * rows]


def reference_run(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unmodified model in one process, fp32, plain AdamW on each step's global batch:
    its losses and final parameters."""
    model = qwen3_moe()
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIONS)
    losses = []
    for step in range(steps):
        ids = global_batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: param.detach().clone() for name, param in model.named_parameters()}


@dataclass(frozen=True)
class HFCase:
    ep_size: int
    stage: int
    dtype: str = "float32"
    save: bool = False  # save after the first steps (into the spawn's root), then train on

    @property
    def label(self) -> str:
        return f"EP={self.ep_size} stage {self.stage} {self.dtype}"


@dataclass
class Outcome:
    """One rank's run of one case."""

    losses: list[float] = field(default_factory=list)  # the mean over ranks, per step
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # dense: whole; experts: {name: ...} below
    experts: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)  # name -> global id -> master
    states: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)  # "name/state" -> global id -> value
    calls: int = 0  # grouped_mm calls recorded
    problems: list[str] = field(default_factory=list)  # grouped_mm rule problems (weights and gradients)
    gradients_checked: int = 0
    calls_on_flat_views: int = 0
    continued: list[float] = field(default_factory=list)  # losses of the steps after a save


def build(case: HFCase, rank: int, world_size: int, meta: bool = False):
    groups = new_expert_groups(case.ep_size) if world_size > 1 else None
    model = qwen3_moe(meta=meta)
    expert_parallel(model, groups)
    engine = ZeroOptimizer(
        model, torch.optim.AdamW, moe_param_groups(model), stage=case.stage, param_dtype=getattr(torch, case.dtype),
        expert_process_group=groups.expert_dp if groups is not None else None, **OPTIONS,
    )  # fmt: skip
    return model, engine


def train(model, engine: ZeroOptimizer, first: int, steps: int, recorder: GroupedMMRecorder | None = None) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        ids = rank_batch(step, engine.rank, engine.world_size)
        if recorder is not None:
            recorder.step = step
            with recorder.watching():
                loss = model(input_ids=ids, labels=ids).loss
                engine.backward(loss)
        else:
            loss = model(input_ids=ids, labels=ids).loss
            engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(_mean_over_ranks(loss.detach().float(), engine))
    return losses


def _mean_over_ranks(loss: torch.Tensor, engine: ZeroOptimizer) -> float:
    if engine.world_size > 1:
        dist.all_reduce(loss)
    return loss.item() / engine.world_size


def snapshot(model, engine: ZeroOptimizer, outcome: Outcome) -> None:
    """The run's fp32 masters (dense whole, experts by global id) and Adam states by global id."""
    ids = {f"{prefix}.{leaf}": c.expert_ids for prefix, c in expert_modules(model).items() for leaf in c.stacks}
    for name in engine.layout.param_names:
        master = engine.get_full_fp32_param(name)
        if name not in ids:
            outcome.params[name] = master
            continue
        outcome.experts[name] = {g: master[local].clone() for local, g in enumerate(ids[name])}
        for key in ADAM_STATES:
            state = engine.get_full_optimizer_state(name, key)
            outcome.states[f"{name}/{key}"] = {g: state[local].clone() for local, g in enumerate(ids[name])}


def run_case(case: HFCase, rank: int, world_size: int, root: str | None = None) -> Outcome:
    """Train STEPS steps and snapshot the state; with ``case.save``, save it as ``root/saved``
    first and train MORE_STEPS more (the uninterrupted losses a resume must continue)."""
    model, engine = build(case, rank, world_size)
    outcome = Outcome()
    recorder = GroupedMMRecorder(rank, expert_weights(model, engine)) if case.dtype == "bfloat16" else None
    outcome.losses = train(model, engine, 0, STEPS, recorder)
    if recorder is not None:
        calls = [call for step in range(STEPS) for call in recorder.at_step(step)]
        outcome.calls = len(calls)
        outcome.calls_on_flat_views = sum(call.in_flat_buffer for call in calls)
        outcome.problems = recorder.problems()
        outcome.gradients_checked = len(recorder.gradients)
    if case.save:
        save_checkpoint(engine, root, tag="saved")
    snapshot(model, engine, outcome)
    if case.save:
        outcome.continued = train(model, engine, STEPS, MORE_STEPS)
    return outcome


def resume(case: HFCase, rank: int, world_size: int, path: str) -> Outcome:
    """Load the (4, 2) checkpoint at (world_size, case.ep_size): its state by global id, then
    the losses of the next steps."""
    model, engine = build(case, rank, world_size)
    load_checkpoint(engine, path)
    outcome = Outcome()
    snapshot(model, engine, outcome)
    outcome.losses = train(model, engine, STEPS, MORE_STEPS)
    return outcome


def pretrained_slices(rank: int, world_size: int, sources: dict[str, str]) -> dict[str, float]:
    """Load each source into a meta-built EP model (EP = world size): the max abs difference
    of every tensor from the full model's (this rank's experts' rows of each stack)."""
    full = dict(qwen3_moe().state_dict())
    differences = {}
    for label, path in sources.items():
        groups = new_expert_groups(world_size)
        model = qwen3_moe(meta=True)
        expert_parallel(model, groups)
        load_pretrained(model, path)
        worst = 0.0
        for name, tensor in model.state_dict().items():
            reference = full[name]
            if tensor.shape != reference.shape:  # a stack: this rank's experts
                reference = reference[torch.tensor(expert_modules(model)[name.rsplit(".", 1)[0]].expert_ids)]
            worst = max(worst, (tensor.float() - reference.float()).abs().max().item())
        differences[label] = worst
    return differences


def refuses_expert_groups_without_a_process_group(rank: int, world_size: int) -> str:
    """Outside a world of one the expert-DP group is required: the error every rank raises."""
    model = qwen3_moe()
    expert_parallel(model, new_expert_groups(1))
    try:
        ZeroOptimizer(model, torch.optim.AdamW, moe_param_groups(model), lr=1e-2)
    except ValueError as err:
        return str(err)
    return ""


def run_world(rank: int, world_size: int, cases: list[HFCase], root: str, resumes: list[HFCase], pretrained: dict | None):
    """Everything one spawn does, in order: the cases (one may save into ``root``), resumes of
    ``root/saved`` at ``resumes``, pretrained loads, and the refusal."""
    results: dict = {"cases": [run_case(case, rank, world_size, root) for case in cases]}
    results["resumed"] = [resume(case, rank, world_size, str(Path(root) / "saved")) for case in resumes]
    if pretrained:
        results["pretrained"] = pretrained_slices(rank, world_size, pretrained)
    results["refusal"] = refuses_expert_groups_without_a_process_group(rank, world_size)
    return results
