"""Worker code for the Muon checkpoint tests: a ZeroOptimizer with torch.optim.Muon for the
matrices (owner groups) and torch.optim.AdamW for the rest saves at one (D, EP), runs at
another load it, natively, through its universal conversion, module-only into an AdamW
engine (and the reverse), and refuse what they must.

A source run trains two steps, saves, and records its full state (every parameter's fp32
master and optimizer states, expert stacks by global expert id) as the reference. Resharding
copies values, so a loaded run's state must equal the reference bit for bit. Workers return
numbers (differing elements, error texts), never verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from muon_workers import MOE, MuonCase, batch, build_model, make_engine, param_groups
from safetensors.torch import load_file, save_file

from zeroshard.checkpoint.engine_io import load_checkpoint, load_checkpoint_attested, save_checkpoint
from zeroshard.engine import ZeroOptimizer
from zeroshard.engine.state_io import partition_state
from zeroshard.moe import moe_param_groups, new_expert_groups

MUON_STATES = ("momentum_buffer",)
ADAM_STATES = ("exp_avg", "exp_avg_sq")
STEPS = 2


@dataclass(frozen=True)
class Run:
    """An engine: the model ("gpt" or "moe"), EP, stage, and whether Muon trains the matrices."""

    model: str = "gpt"
    ep: int = 1
    stage: int = 2
    muon: bool = True

    def case(self) -> MuonCase:
        return MuonCase(f"{self.model}-ep{self.ep}", model=self.model, ep=self.ep, stage=self.stage, bucket_numel=200)


def engine_of(run: Run) -> ZeroOptimizer:
    groups = new_expert_groups(run.ep) if run.model == "moe" else None
    model = build_model(run.case(), groups.ep if groups else None)
    if run.muon:
        return make_engine(model, run.case(), groups.expert_dp if groups else None)
    return ZeroOptimizer(
        model,
        torch.optim.AdamW,
        moe_param_groups(model) if run.model == "moe" else None,
        stage=run.stage,
        expert_process_group=groups.expert_dp if groups else None,
        lr=1e-3,
    )


def train(engine: ZeroOptimizer, run: Run, steps: range) -> None:
    for step in steps:
        engine.backward(engine.model(*batch(run.case(), step, engine.rank, 0)))
        engine.step()
        engine.zero_grad()


def _experts(engine: ZeroOptimizer) -> set[str]:
    return {slot.name for group in engine.layout.groups if group.is_expert_group for slot in group.params}


def global_state(engine: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """Collective: every parameter's fp32 master and optimizer states, whole, expert stacks
    with every expert by global id; the AdamW step count."""
    experts = _experts(engine)
    state = {}
    for name in engine.layout.param_names:
        group, _ = engine.layout.param(name)
        kinds = ("fp32", *(MUON_STATES if group.owner else ADAM_STATES))
        for kind in kinds:
            value = engine.get_full_fp32_param(name) if kind == "fp32" else engine.get_full_optimizer_state(name, kind)
            if name in experts:
                ids = list(engine.model.blocks[0].moe.experts.expert_ids)
                full = torch.empty(MOE.num_experts, *value.shape[1:])
                for their_ids, their_value in engine.comm.all_gather_object((ids, value)):
                    full[their_ids] = their_value
                value = full
            state[f"{kind}/{name}"] = value.contiguous()
    steps = [partition_state(engine, g)[1].get("step") for g in range(len(engine.layout.groups))]
    state["steps"] = torch.tensor([float(s) for s in steps if s is not None] + [float(engine.global_steps)])
    return state


def source_run(rank: int, world_size: int, run: Run, root: str, reference: str) -> dict:
    """Train STEPS steps, save into ``root``, write the reference state to ``reference``."""
    engine = engine_of(run)
    train(engine, run, range(STEPS))
    path = save_checkpoint(engine, root)
    state = global_state(engine)
    if rank == 0:
        Path(reference).mkdir(parents=True, exist_ok=True)
        save_file(state, str(Path(reference) / "state.safetensors"))
    engine.comm.barrier()
    owners = [group.owner for group in engine.layout.groups]
    return {"path": str(path), "owners": owners, "momentum": sorted(partition_state(engine, 0)[0])}


def resumed_run(rank: int, world_size: int, run: Run, checkpoint: str, reference: str) -> dict:
    """Load at ``run``'s (D, EP), attested; compare with the reference; one more step works."""
    engine = engine_of(run)
    _, attestation = load_checkpoint_attested(engine, checkpoint)
    loaded = global_state(engine)
    saved = load_file(str(Path(reference) / "state.safetensors"))
    differing = {key: int((loaded[key] != saved[key]).sum()) for key in saved if key in loaded}
    train(engine, run, range(STEPS, STEPS + 1))
    return {
        "differing": differing,
        "keys": sorted(set(saved) ^ set(loaded)),
        "attested": attestation.line(),
        "finite": all(bool(torch.isfinite(p).all()) for p in engine.model.parameters()),
    }


def module_only_run(rank: int, world_size: int, run: Run, checkpoint: str, reference: str) -> dict:
    """Load ``checkpoint`` module-only into ``run`` (the other optimizer's engine): the
    weights are the saved masters, this run's optimizer state and counters are kept."""
    engine = engine_of(run)
    train(engine, run, range(1))
    before = {key: v for key, v in global_state(engine).items() if not key.startswith("fp32/")}
    load_checkpoint(engine, checkpoint, load_module_only=True)
    after = global_state(engine)
    saved = load_file(str(Path(reference) / "state.safetensors"))
    experts = _experts(engine)
    ids = list(engine.model.blocks[0].moe.experts.expert_ids) if experts else []
    weights = {}
    for name, param in engine.model.named_parameters():
        expected = saved[f"fp32/{name}"][ids] if name in experts else saved[f"fp32/{name}"]
        weights[name] = int((param.detach().float() != expected).sum())
    kept = {key: int((after[key] != before[key]).sum()) for key in before}
    return {"weights": weights, "kept": kept}


def refused_load(rank: int, world_size: int, run: Run, checkpoint: str) -> dict:
    """A full load of the other optimizer's checkpoint: refused on every rank, nothing changed."""
    engine = engine_of(run)
    train(engine, run, range(1))
    before = global_state(engine)
    try:
        load_checkpoint(engine, checkpoint)
        error = "no error"
    except ValueError as err:
        error = str(err)
    after = global_state(engine)
    return {"error": error, "changed": sum(int((before[k] != after[k]).sum()) for k in before)}


def refused_engines(rank: int, world_size: int) -> dict:
    """Engines refused at construction, one line on every rank: a Muon group holding a 1-D or
    a 3-D (undeclared) parameter, Muon options torch refuses."""
    errors = {}
    model = build_model(MuonCase("gpt"))
    params = dict(model.named_parameters())
    bias = next(name for name, p in params.items() if p.ndim == 1)
    cases = {
        "vector": ([params[bias]], {}),
        "bad_momentum": (param_groups(model, MuonCase("gpt")), {"momentum": -0.5}),
        "bad_ns_steps": (param_groups(model, MuonCase("gpt")), {"ns_steps": 200}),  # refused by torch at a step
        "bad_adjust_lr": (param_groups(model, MuonCase("gpt")), {"adjust_lr_fn": "bogus"}),
    }
    cube = torch.nn.Module()
    cube.weight = torch.nn.Parameter(torch.zeros(2, 3, 4))
    for label, (groups, options) in cases.items():
        errors[label] = _error(lambda: ZeroOptimizer(model, torch.optim.Muon, groups, lr=0.02, **options))
    errors["cube"] = _error(lambda: ZeroOptimizer(cube, torch.optim.Muon, None, lr=0.02))
    return errors


def _error(build) -> str:
    try:
        build()
    except ValueError as err:
        return str(err)
    return "no error"


def grouped(rank: int, world_size: int, calls: list[tuple[str, tuple]]) -> list:
    """Several of the above in one spawn, in order."""
    outcomes = [globals()[name](rank, world_size, *args) for name, args in calls]
    if dist.is_initialized():
        dist.barrier()
    return outcomes
