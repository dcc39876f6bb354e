"""The MoE demo: MoEGPT, or with ``hf`` the transformers Qwen3-MoE (:mod:`.hf`), trained
with ZeRO and expert parallelism, its grouped GEMMs watched.

``moe_train_phase`` runs on every rank (spawned by the CLI, or under torchrun) at W ranks
with expert parallelism EP: each rank holds E / EP experts of every layer, tokens reach them
by all-to-all, expert state is sharded over the W / EP ranks holding the same experts. Every
``torch._grouped_mm`` call is recorded as it happens (:mod:`..moe.recorder`) and checked, with
the gradient backward computes for its weight, against CUDA's grouped GEMM rules, so the
report shows the alignment the kernel was given. Checkpoints go through one function,
:func:`checkpointing`. Rank 0 returns a ``MoEPhaseResult``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..buffers import owns_storage
from ..checkpoint.checkpointer import Checkpointer, SaveStats
from .dense import DTYPES, DemoConfig, progress_bar, resume_at, train_steps
from ..engine import ZeroOptimizer
from ..layout.stacks import exported_expert_shape, per_expert_tensors
from ..moe import (
    ExpertGroups,
    MoEConfig,
    MoEGPT,
    expert_modules,
    expert_parallel,
    moe_param_groups,
    new_expert_groups,
    per_expert_state_dict,
)
from ..moe.recorder import GroupedMMCall, GroupedMMRecorder

MOE_MODEL = MoEConfig(num_experts=8, top_k=2)  # 2 layers, width 32, expert hidden 48
LIVE_STATE_FILE = "live_fp32_state.safetensors"


@dataclass(frozen=True)
class MoEDemoConfig(DemoConfig):
    """The dense demo's training settings, with an MoE model."""

    steps: int = 40
    model: MoEConfig = MOE_MODEL
    hf: bool = False  # the transformers Qwen3-MoE (hf.HF_MODEL) instead of MoEGPT

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer of the model trained (Qwen3-MoE's with ``hf``, else MoEGPT's)."""
        if self.hf:
            from .hf import NUM_EXPERTS

            return NUM_EXPERTS
        return self.model.num_experts


@dataclass
class MoEPhaseResult:
    """What rank 0 reports of one phase at (W, EP)."""

    world_size: int
    ep_size: int
    backend: str
    first_step: int
    losses: list[float] = field(default_factory=list)
    train_seconds: float = 0.0
    load_seconds: float = 0.0
    attestation: str = ""  # what the resume's load proved (its one line)
    save: SaveStats | None = None  # the phase's save: its training stall and background write
    checkpoint: str = ""
    calls: list[GroupedMMCall] = field(default_factory=list)  # every rank's, at the phase's first step
    checked_calls: int = 0  # every grouped_mm call of every step on every rank, checked
    checked_gradients: int = 0  # the gradients backward computed for their weights, checked
    problems: list[str] = field(default_factory=list)  # every broken rule, one line each
    storage_kept: bool = False  # every call of the last step read the addresses of the first
    memory: dict = field(default_factory=dict)
    layout: dict = field(default_factory=dict)  # the run's layout (JSON), shard groups and expert map


def build_moe_engine(config: MoEDemoConfig, groups: ExpertGroups) -> tuple:
    """This rank's model (its E / EP experts) under ZeRO with expert groups, and the callable
    the training loop calls with ``(inputs, targets)`` for the loss.

    Every rank draws the same full model and keeps its own experts by global id, so the run
    starts from the same weights at any (W, EP): MoEGPT loads them from the full model's
    per-expert state dict; the transformers model is made expert-parallel in one call.
    Collective over every rank of ``groups``.
    """
    if config.hf:
        from .hf import NextTokenLoss, qwen3_moe

        model = qwen3_moe(config.seed)
        expert_parallel(model, groups)
        loss = NextTokenLoss(model)
    else:
        torch.manual_seed(config.seed)
        full = per_expert_state_dict(MoEGPT(config.model))
        model = MoEGPT(config.model, ep_group=groups.ep)
        model.load_state_dict(full, strict=True)
        loss = model
    engine = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        moe_param_groups(model),
        stage=config.stage,
        param_dtype=DTYPES[config.dtype],
        expert_process_group=groups.expert_dp,
        max_grad_norm=config.max_grad_norm,
        lr=config.lr,
        betas=(0.9, 0.95),
        weight_decay=config.weight_decay,
    )
    return model, engine, loss


def expert_weights(model: torch.nn.Module, engine: ZeroOptimizer) -> dict[str, tuple[torch.Tensor, tuple[int, ...], bool]]:
    """Every expert stack (the contract's, :mod:`..moe.contract`): (the tensor, its experts'
    global ids, whether it is a view of the engine's flat buffer), by parameter name."""
    weights = {}
    for prefix, contract in expert_modules(model).items():
        module = model.get_submodule(prefix)
        for leaf in contract.stacks:
            name = f"{prefix}.{leaf}"
            weight = getattr(module, leaf)
            buffer = engine.buffers[engine.layout.param(name)[0].index]
            weights[name] = (weight, contract.expert_ids, owns_storage(buffer, weight))
    return weights


@dataclass(frozen=True)
class CheckpointPlan:
    """Where a phase's checkpoints live, whether it resumes from the latest, after which step
    it saves, and whether rank 0 writes the live fp32 state (``LIVE_STATE_FILE``) at the end."""

    out_dir: str
    resume: bool
    save_after: int
    live_state: bool = False


@contextlib.contextmanager
def checkpointing(
    engine: ZeroOptimizer, plan: CheckpointPlan | None, first_step: int, result: MoEPhaseResult
) -> Iterator[Callable[[int], None]]:
    """Collective with a plan: load the latest checkpoint if the plan resumes; yield the
    after-step hook that saves after ``plan.save_after``; on exit wait for the save and record
    it in ``result``. Without a plan, nothing is loaded or saved."""
    if plan is None:
        yield lambda step: None
        return
    with Checkpointer(engine, Path(plan.out_dir) / "checkpoints", keep_last=2, async_save=True) as ckpt:
        if plan.resume:
            result.load_seconds, result.attestation = resume_at(ckpt, first_step)

        def save(step: int) -> None:
            if step == plan.save_after:
                ckpt.save(step)

        yield save
        result.save = ckpt.wait()
        result.checkpoint = str(result.save.path) if result.save is not None else ""


def save_live_fp32_state(model: torch.nn.Module, engine: ZeroOptimizer, path: Path) -> None:
    """Collective: rank 0 writes every trained parameter's fp32 master under its export name,
    gathered from the live engine's every EP rank: an expert stack by global id, as one
    ``[E, ...]`` tensor or per expert (``[out, in]``), as the stack's export form says."""
    from safetensors.torch import save_file

    masters = {name: engine.get_full_fp32_param(name) for name in engine.layout.param_names}
    stacks = {}
    for prefix, contract in expert_modules(model).items():
        for leaf, stack in contract.stacks.items():
            local = masters.pop(f"{prefix}.{leaf}")
            stacks[f"{prefix}.{leaf}"] = (stack, {g: local[i] for i, g in enumerate(contract.expert_ids)})
    every_rank = engine.comm.all_gather_object((masters, stacks))  # EP ranks hold different experts
    if engine.rank != 0:
        return
    live = {name: value for dense, _ in every_rank for name, value in dense.items()}
    for name, (stack, _) in every_rank[0][1].items():
        experts = {g: value for _, held in every_rank for g, value in held[name][1].items()}
        live.update(_exported(name, stack, [experts[g] for g in sorted(experts)]))
    save_file(live, str(path))


def _exported(name: str, stack, experts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A stack's global experts (in id order) under the names its export form gives them."""
    if stack.export == "stacked":
        return {name: torch.stack(experts)}
    tensors = {}
    for g, expert in enumerate(experts):
        matrix = expert.t() if stack.orientation == "in_out" else expert
        assert tuple(matrix.shape) == exported_expert_shape(stack, expert.shape)
        for part in per_expert_tensors(name, stack, g, tuple(expert.shape)):
            tensors[part.name] = matrix[part.row_start : part.row_end].contiguous()
    return tensors


def moe_train_phase(
    rank: int,
    world_size: int,
    config: MoEDemoConfig,
    ep_size: int,
    first_step: int,
    steps: int,
    plan: CheckpointPlan | None = None,
) -> MoEPhaseResult | None:
    """Collective (every rank of the phase runs it): train ``steps`` steps from ``first_step``
    at (W, EP), recording the grouped GEMMs; resume and save as ``plan`` says. The result on
    rank 0, None on the others. ValueError when the global batch does not split into the ranks."""
    if config.global_batch % world_size:
        raise ValueError(f"global batch {config.global_batch} does not split into {world_size} ranks")
    groups = new_expert_groups(ep_size)
    model, engine, loss = build_moe_engine(config, groups)
    result = MoEPhaseResult(world_size, ep_size, engine.comm.backend, first_step)
    recorder = GroupedMMRecorder(engine.rank, expert_weights(model, engine))
    recorder.step = first_step
    bar = progress_bar(config, rank, first_step, steps)
    with checkpointing(engine, plan, first_step, result) as save:

        def after_step(step: int) -> None:
            recorder.step = step + 1
            save(step)

        start = time.perf_counter()
        with recorder.watching():
            result.losses = train_steps(loss, engine, config, first_step, steps, bar, after_step)
        result.train_seconds = time.perf_counter() - start
        bar(None, None)
    if plan is not None and plan.live_state:
        save_live_fp32_state(model, engine, Path(plan.out_dir) / LIVE_STATE_FILE)

    first, last = recorder.at_step(first_step), recorder.at_step(first_step + steps - 1)
    kept = len(first) == len(last) > 0 and all(a.address == b.address for a, b in zip(first, last))
    checked = (sum(map(len, recorder.calls.values())), len(recorder.gradients), recorder.problems())
    calls = engine.comm.all_gather_object(first)
    everywhere_kept = engine.comm.all_gather_object(kept)
    everywhere_checked = engine.comm.all_gather_object(checked)
    result.calls = [call for per_rank in calls for call in per_rank]
    result.storage_kept = all(everywhere_kept)
    result.checked_calls = sum(count for count, _, _ in everywhere_checked)
    result.checked_gradients = sum(count for _, count, _ in everywhere_checked)
    result.problems = [line for _, _, lines in everywhere_checked for line in lines]
    result.memory = asdict(engine.memory_report())
    result.layout = engine.layout.to_dict()
    return result if rank == 0 else None
