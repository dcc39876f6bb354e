"""Worker code for the exact-resume tests (issue 31): runs with dropout and a shuffled sampler,
straight against saved-and-resumed; each mis-resume cause injected; resumes at other world
sizes; the transformers MoE model at another EP. Workers return numbers (losses, bytes) and
the audit's own words, never verdicts of their own.
"""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from zeroshard.checkpoint import Checkpointer
from zeroshard.checkpoint.audit import ResumeAuditError
from zeroshard.engine import ZeroOptimizer

N = 6  # steps before the save; every run is 2N steps
ROWS, BATCH, FEATURES, CLASSES = 60, 6, 16, 4  # 5 batches per rank and epoch at D=2: the runs cross epochs
GLOBAL_ROWS = 12  # of a global batch, split over 1, 2 or 3 ranks

warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 on torch 2.13


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(ROWS, FEATURES, generator=generator)
    return TensorDataset(features, torch.randint(0, CLASSES, (ROWS,), generator=generator))


def build(dropout: float, process_group: Any = None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, CLASSES))
    engine = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, process_group=process_group)
    schedule = torch.optim.lr_scheduler.LambdaLR(engine, lambda step: 1.0 / (1.0 + 0.1 * step))
    return model, engine, schedule


class Epoch:
    """The epoch a DistributedSampler is in: StatefulDataLoader's state does not hold it (a global state)."""

    def __init__(self) -> None:
        self.epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = state["epoch"]


class GlobalBatches:
    """Global batch k is the same at every world size; each rank takes its rows (a global state)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size, self.position = rank, world_size, 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(100 + self.position)
        x = torch.randn(GLOBAL_ROWS, FEATURES, generator=generator)
        y = torch.randint(0, CLASSES, (GLOBAL_ROWS,), generator=generator)
        self.position += 1
        rows = GLOBAL_ROWS // self.world_size
        return x[self.rank * rows : (self.rank + 1) * rows], y[self.rank * rows : (self.rank + 1) * rows]


def stateful_batches(loader, sampler: DistributedSampler, epoch: Epoch) -> Iterator:
    """README's StatefulDataLoader pattern: the loader and the epoch are registered states."""
    while True:
        sampler.set_epoch(epoch.epoch)
        yield from loader
        epoch.epoch += 1


def plain_batches(loader: DataLoader, sampler: DistributedSampler, start: int) -> Iterator:
    """README's DistributedSampler pattern: the position is the step load() returned."""
    epoch, skip = divmod(start, len(loader))
    while True:
        sampler.set_epoch(epoch)
        yield from itertools.islice(loader, skip, None)
        epoch, skip = epoch + 1, 0


class Run:
    """One run of the dropout MLP on the 2-rank shuffled data, with a Checkpointer on ``root``."""

    def __init__(self, rank: int, world: int, root: Path, kind: str, **checkpointer: Any) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.model, self.engine, self.schedule = build(0.3)
        data = dataset()
        self.sampler = DistributedSampler(data, world, rank, shuffle=True, seed=3)
        # A generator of its own: iter() of a loader without one draws a seed from torch's
        # global generator, which a resumed run would draw once more than the straight one.
        loader_class = StatefulDataLoader if kind == "stateful" else DataLoader
        self.loader = loader_class(data, batch_size=BATCH, sampler=self.sampler, generator=torch.Generator())
        self.epoch = Epoch()
        states = {"state": {"data": self.loader}, "global_state": {"epoch": self.epoch}} if kind == "stateful" else {}
        self.ckpt = Checkpointer(self.engine, root, lr_scheduler=self.schedule, **states, **checkpointer)
        self.kind = kind

    def batches(self, start: int) -> Iterator:
        if self.kind == "stateful":
            return stateful_batches(self.loader, self.sampler, self.epoch)
        return plain_batches(self.loader, self.sampler, start)

    def train(self, batches: Iterator, steps: range) -> list[float]:
        losses = []
        for _ in steps:
            x, y = next(batches)
            loss = nn.functional.cross_entropy(self.model(x), y)
            self.engine.backward(loss)
            self.ckpt.report_loss(loss, terms=len(y))
            self.engine.step()
            self.engine.zero_grad()
            self.schedule.step()
            losses.append(loss.item())
        return losses


def straight(rank: int, world: int, root: Path, kind: str) -> dict[str, Any]:
    """2N steps, saving after step N - 1; the bytes each collective moved in the audited step
    (the first after the save) and in the next one."""
    run = Run(rank, world, root, kind)
    start = run.ckpt.load()
    batches = run.batches(start)
    losses = run.train(batches, range(0, N))
    run.ckpt.save(N - 1)
    moved = []
    for step in (N, N + 1):
        before = dict(run.engine.comm.bytes_moved)
        losses += run.train(batches, range(step, step + 1))
        after = run.engine.comm.bytes_moved
        moved.append({key: after[key] - before.get(key, 0) for key in after})
    losses += run.train(batches, range(N + 2, 2 * N))
    run.ckpt.close()
    return {"losses": losses, "fresh": int(start), "audited_step_bytes": moved[0], "next_step_bytes": moved[1]}


INJECTIONS: dict[str, Callable[[Run, Iterator], None]] = {
    "none": lambda run, batches: None,
    "data one batch late": lambda run, batches: next(batches),
    "lr schedule off by one": lambda run, batches: run.schedule.step(),
    "exp_avg perturbed": lambda run, batches: (
        run.engine.optimizer.state[run.engine.masters[0]]["exp_avg"][:3].add_(1e-6) if run.engine.rank == 1 else None
    ),
}


def resumed(rank: int, world: int, root: Path, kind: str, injection: str, **checkpointer: Any) -> dict[str, Any]:
    """Resume ``root`` and train to step 2N, with ``injection`` done after the load."""
    run = Run(rank, world, root, kind, **checkpointer)
    point = run.ckpt.load()
    batches = run.batches(point)
    INJECTIONS[injection](run, batches)
    result: dict[str, Any] = {"next_step": point.next_step, "saved_step": point.saved_step}
    try:
        result["losses"] = run.train(batches, range(point, 2 * N))
    except ResumeAuditError as err:
        result["error"] = str(err)
    verdict = run.ckpt.audit_verdict
    result["causes"] = list(verdict.causes) if verdict else None
    result["line"] = verdict.line(str(run.ckpt.resumed_from)) if verdict else None
    run.ckpt.close()
    return result


def same_world(rank: int, world: int, out: str) -> dict[str, Any]:
    """Spawn target (D=2): both data patterns straight and resumed; every injected cause; the
    straight runs at D=2 that other world sizes resume (global data position, with and
    without dropout)."""
    out_dir = Path(out)
    results: dict[str, Any] = {}
    for kind in ("stateful", "plain"):
        results[f"{kind} straight"] = straight(rank, world, out_dir / kind, kind)
        results[f"{kind} resumed"] = resumed(rank, world, out_dir / kind, kind, "none")
    for injection in ("data one batch late", "lr schedule off by one", "exp_avg perturbed"):
        results[injection] = resumed(rank, world, out_dir / "stateful", "stateful", injection)
    # No data state registered: the audit names the data position by elimination.
    results["plain data one batch late"] = resumed(rank, world, out_dir / "plain", "plain", "data one batch late")
    results["RNG not restored"] = resumed(rank, world, out_dir / "stateful", "stateful", "none", rng=False)
    results["strict"] = resumed(rank, world, out_dir / "stateful", "stateful", "lr schedule off by one", audit="strict")
    for dropout in (0.0, 0.3):
        results[f"global {dropout}"] = global_run(rank, world, out_dir / f"global-{dropout}", dropout, save=True)
    return results


def global_run(
    rank: int, world: int, root: Path, dropout: float, save: bool = False, process_group: Any = None
) -> dict[str, Any]:
    """The global-batch run: 2N steps saving after N - 1 (``save``), or resumed from ``root``
    to step 2N. Losses are the mean over the ranks (the global batch's mean)."""
    model, engine, schedule = build(dropout, process_group)
    batches = GlobalBatches(engine.rank, engine.world_size)
    ckpt = Checkpointer(engine, root, lr_scheduler=schedule, global_state={"data": batches})
    point = ckpt.load()
    losses = []
    for step in range(point, 2 * N):
        x, y = next(batches)
        loss = nn.functional.cross_entropy(model(x), y)
        engine.backward(loss)
        ckpt.report_loss(loss, terms=len(y))
        engine.step()
        engine.zero_grad()
        schedule.step()
        mean = loss.detach().double().reshape(1)
        engine.comm.all_reduce_(mean)
        losses.append(mean.item() / engine.world_size)
        if save and step == N - 1:
            ckpt.save(step)
    verdict = ckpt.audit_verdict
    ckpt.close()
    return {
        "losses": losses,
        "causes": list(verdict.causes) if verdict else None,
        "exact": verdict.exact if verdict else None,
        "line": verdict.line(str(root)) if verdict else None,
    }


def other_worlds(rank: int, world: int, out: str) -> dict[str, Any]:
    """Spawn target (D=3): resume the D=2 global-batch runs at D=3, then at D=1 (rank 0 alone,
    on a group of its own)."""
    out_dir = Path(out)
    results = {}
    for dropout in (0.0, 0.3):
        results[f"D=3 {dropout}"] = global_run(rank, world, out_dir / f"global-{dropout}", dropout)
    alone = dist.new_group([0])
    if rank == 0:
        for dropout in (0.0, 0.3):
            results[f"D=1 {dropout}"] = global_run(rank, 1, out_dir / f"global-{dropout}", dropout, process_group=alone)
    return results


def moe_ep_change(rank: int, world: int, out: str) -> dict[str, Any]:
    """Spawn target (W=2): the transformers Qwen3-MoE (attention dropout, router) trained at EP=2,
    saved after step 1, resumed at EP=1 for steps 2-3, against the straight run's."""
    import hf_moe_workers as hf

    from zeroshard.moe import expert_parallel, moe_param_groups, new_expert_groups

    def build_moe(ep: int):
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**hf.CONFIG, "attention_dropout": 0.2}))
        groups = new_expert_groups(ep)
        expert_parallel(model, groups)
        engine = ZeroOptimizer(
            model, torch.optim.AdamW, moe_param_groups(model), expert_process_group=groups.expert_dp, **hf.OPTIONS
        )
        return model, engine

    def train(model, engine, ckpt, position: GlobalBatches, steps: range) -> list[float]:
        losses = []
        for _ in steps:
            ids = hf.rank_batch(position.position, rank, world)
            position.position += 1
            loss = model(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            ckpt.report_loss(loss, terms=ids.numel())
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
        return losses

    root = Path(out) / "moe"
    runs = {}
    for ep, steps in ((2, range(0, 4)), (1, None)):
        model, engine = build_moe(ep)
        position = GlobalBatches(rank, world)
        ckpt = Checkpointer(engine, root, global_state={"data": position})
        point = ckpt.load()
        losses = train(model, engine, ckpt, position, range(point, 2) if steps else range(point, 4))
        if steps:
            ckpt.save(1)
            losses += train(model, engine, ckpt, position, range(2, 4))
        verdict = ckpt.audit_verdict
        runs[f"EP={ep}"] = {
            "losses": losses,
            "causes": list(verdict.causes) if verdict else None,
            "exact": verdict.exact if verdict else None,
            "line": verdict.line(str(root)) if verdict else None,
        }
        ckpt.close()
    return runs
