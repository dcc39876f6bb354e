"""Worker code for the MoE checkpoint tests: MoEGPT runs at one (W, EP) save, runs at another
(W, EP) load and continue.

Every run trains on the same global batches (those of four ranks in moe_engine_workers),
split evenly over its W ranks, so its global mean loss is the same at any (W, EP). A source
run trains, saves, records its full state by global expert id (the reference), then trains on
uninterrupted; a loading run compares its state with the reference right after the load and
its losses with the source's afterwards. Workers return numbers (differing elements, max abs
differences, error texts), not verdicts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from moe_engine_workers import MODEL, OPTIONS, full_state, global_batch
from safetensors.torch import load_file, save_file

from zeroshard.checkpoint import Checkpointer
from zeroshard.checkpoint.engine_io import load_checkpoint, save_checkpoint
from zeroshard.engine import ZeroOptimizer
from zeroshard.moe import MoEConfig, MoEGPT, expert_param_names, moe_param_groups, new_expert_groups

SOURCE_WORLD = 4  # the batches are those of four ranks of moe_engine_workers
SAVED_AT, CONTINUE = 2, 2  # steps before the save, steps after it
STATES = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Run:
    ep_size: int
    stage: int = 2
    dtype: str = "float32"
    single: bool = False  # a world of one inside a spawned rank (its own process group)
    checkpointer: bool = False  # save and resume through an asynchronous Checkpointer

    @property
    def label(self) -> str:
        return f"EP={self.ep_size} stage {self.stage} {self.dtype}{' alone' if self.single else ''}"


def rank_batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's global batch."""
    idx, targets = global_batch(step, SOURCE_WORLD)
    rows = idx.shape[0] // world_size
    return idx[rank * rows : (rank + 1) * rows], targets[rank * rows : (rank + 1) * rows]


def make_engine(run: Run, config: MoEConfig = MODEL, expert_groups: bool = True) -> ZeroOptimizer:
    """An engine of MoEGPT at ``run``'s EP on the default group (or alone on a group of one);
    ``expert_groups=False``: the experts as dense parameters, replicated (EP = 1)."""
    if run.single:
        alone, _ = dist.new_subgroups_by_enumeration([[rank] for rank in range(dist.get_world_size())])
        model, groups, ep_dp, process_group = MoEGPT(config), None, alone, alone
    else:
        expert = new_expert_groups(run.ep_size)
        model, ep_dp, process_group = MoEGPT(config, ep_group=expert.ep), expert.expert_dp, None
    if config == MODEL:
        model.load_state_dict(full_state(), strict=True)
    groups = moe_param_groups(model) if expert_groups else None
    return ZeroOptimizer(
        model,
        torch.optim.AdamW,
        groups,
        stage=run.stage,
        param_dtype=getattr(torch, run.dtype),
        process_group=process_group,
        expert_process_group=ep_dp if expert_groups else None,
        max_grad_norm=0.5,
        **OPTIONS,
    )


def train(engine: ZeroOptimizer, steps: range) -> list[float]:
    """Global mean losses of ``steps``."""
    rank, world_size = engine.rank, engine.world_size
    losses = []
    for step in steps:
        loss = engine.model(*rank_batch(step, rank, world_size))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(sum(engine.comm.all_gather_object(loss.item())) / world_size)
    return losses


def global_state(engine: ZeroOptimizer, kinds: tuple[str, ...] = ("fp32", *STATES)) -> dict[str, torch.Tensor]:
    """Collective: every parameter's fp32 master and Adam states in full, expert weights with
    every expert stacked by global expert id, and the step counts."""
    experts = set(expert_param_names(engine.model)[1])
    ids = list(engine.model.blocks[0].moe.experts.expert_ids)
    state = {}
    for name in engine.layout.param_names:
        for kind in kinds:
            value = engine.get_full_fp32_param(name) if kind == "fp32" else engine.get_full_optimizer_state(name, kind)
            if name in experts:
                parts = engine.comm.all_gather_object((ids, value))
                full = torch.empty(MODEL.num_experts, *value.shape[1:])
                for their_ids, their_value in parts:
                    full[their_ids] = their_value
                value = full
            state[f"{kind}/{name}"] = value.contiguous()
    steps = [float(engine.optimizer.state.get(master, {}).get("step", -1)) for master in engine.masters]
    state["steps"] = torch.tensor(steps + [float(engine.global_steps)])
    return state


def source_run(rank: int, world_size: int, run: Run, root: str, reference: str) -> dict:
    """Train, save at step SAVED_AT into ``root``, write the reference state and the
    uninterrupted losses into directory ``reference``."""
    engine = make_engine(run)
    train(engine, range(SAVED_AT))
    if run.checkpointer:
        with Checkpointer(engine, root) as checkpointer:
            checkpointer.save(SAVED_AT - 1)  # the last step it trained
            state = global_state(engine)  # while the save is written: it reads its snapshot
            path = checkpointer.wait().path
    else:
        path = save_checkpoint(engine, root)
        state = global_state(engine)
    losses = train(engine, range(SAVED_AT, SAVED_AT + CONTINUE))
    if rank == 0:
        Path(reference).mkdir(parents=True, exist_ok=True)
        save_file(state, str(Path(reference) / "state.safetensors"))
        (Path(reference) / "losses.json").write_text(json.dumps(losses))
    engine.comm.barrier()
    return {"path": str(path)}


def resumed_run(rank: int, world_size: int, run: Run, checkpoint: str, reference: str) -> dict:
    """Load at ``run``'s (W, EP), compare with the source's state, train on, compare losses."""
    engine = make_engine(run)
    if run.checkpointer:
        with Checkpointer(engine, checkpoint) as checkpointer:
            assert checkpointer.load() == SAVED_AT
    else:
        load_checkpoint(engine, checkpoint)
    loaded = global_state(engine)
    saved = load_file(str(Path(reference) / "state.safetensors"))
    differing = {key: int((loaded[key] != saved[key]).sum()) for key in saved}
    losses = train(engine, range(SAVED_AT, SAVED_AT + CONTINUE))
    expected = json.loads((Path(reference) / "losses.json").read_text())
    return {
        "differing": differing,
        "keys": sorted(loaded) == sorted(saved),
        "loss_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, expected)),
        "experts": list(engine.model.blocks[0].moe.experts.expert_ids),
    }


def partial_loads(rank: int, world_size: int, run: Run, checkpoint: str, reference: str) -> dict:
    """Module-only and weights-only loads: the weights are the source's masters (cast), by
    global expert id; a module-only load keeps the run's optimizer state and counters, a
    weights-only load starts the optimizer afresh."""
    saved = load_file(str(Path(reference) / "state.safetensors"))
    outcome = {}
    for label, options in (
        ("module_only", {"load_module_only": True}),
        ("weights_only", {"load_optimizer_states": False}),
    ):
        engine = make_engine(run)
        train(engine, range(1))  # optimizer state that a module-only load must keep
        before = {key: value for key, value in global_state(engine).items() if not key.startswith("fp32/")}
        load_checkpoint(engine, checkpoint, **options)
        after = global_state(engine, ("fp32", *STATES) if label == "module_only" else ("fp32",))
        ids = list(engine.model.blocks[0].moe.experts.expert_ids)
        experts = set(expert_param_names(engine.model)[1])
        weights = {}
        for name, param in engine.model.named_parameters():
            expected = saved[f"fp32/{name}"][ids] if name in experts else saved[f"fp32/{name}"]
            weights[name] = int((param.detach().float() != expected.to(param.dtype).float()).sum())
        masters = {
            name: int((after[f"fp32/{name}"] != saved[f"fp32/{name}"].to(getattr(torch, run.dtype)).float()).sum())
            for name in engine.layout.param_names
        }
        kept = {key: int((after[key] != before[key]).sum()) for key in before} if label == "module_only" else {}
        states = [len(engine.optimizer.state.get(master, {})) for master in engine.masters]
        outcome[label] = {"weights": weights, "masters": masters, "kept": kept, "states": states}
    return outcome


def refused_loads(rank: int, world_size: int, checkpoint: str, scratch: str) -> dict:
    """Loads that must fail on every rank and change nothing: into a run whose experts are
    dense parameters (EP = 1, no expert groups), into a run with twice the experts, and a
    checkpoint of such a dense run (saved into ``scratch``) into an expert run."""
    dense = save_checkpoint(make_engine(Run(ep_size=1), MODEL, expert_groups=False), scratch)
    errors, changed = {}, {}
    rows = new_expert_groups(2)
    model = MoEGPT(MODEL, ep_group=rows.ep)
    try:  # the EP groups (rows of the mesh) given as the expert-DP groups (its columns)
        ZeroOptimizer(model, torch.optim.AdamW, moe_param_groups(model), expert_process_group=rows.ep)
        errors["wrong_groups"] = "no error"
    except ValueError as error:
        errors["wrong_groups"] = str(error)
    for label, config, expert_groups, path in (
        ("dense_run", MODEL, False, checkpoint),
        ("more_experts", dataclasses.replace(MODEL, num_experts=2 * MODEL.num_experts), True, checkpoint),
        ("dense_checkpoint", MODEL, True, str(dense)),
    ):
        engine = make_engine(Run(ep_size=2 if expert_groups else 1), config, expert_groups)
        before = [master.detach().clone() for master in engine.masters]
        try:
            load_checkpoint(engine, path)
            errors[label] = "no error"
        except ValueError as error:
            errors[label] = str(error)
        changed[label] = sum(int((a != b).sum()) for a, b in zip(before, engine.masters))
    return {"errors": errors, "changed": changed}


def grouped(rank: int, world_size: int, calls: list[tuple[str, tuple]]) -> list:
    """Several of the above in one spawn, in order (import torch costs 1.5 s per process)."""
    return [globals()[name](rank, world_size, *args) for name, args in calls]
