"""Worker code for the exact multi-step Muon test (tests/test_muon_exact.py): ZeroOptimizer
with torch.optim.Muon for the matrices and torch.optim.AdamW for the rest, on spawned gloo
ranks, against a one-process run, over several steps, equal BIT FOR BIT.

Why bit for bit can be asked for. torch's Newton-Schulz runs in bf16, so a last-bit
difference in one gradient can flip a rounding, and no useful error bound survives several
steps. The gradients are therefore made exact whatever the order of the sums: every rank's
loss of micro-batch m of step t is a linear probe of its parameters,

    loss = sum over parameters p of sum_i c[i] * p[i],    c = W * k * s,

with k integers drawn in [-K, K] per element, rank, micro-batch and step (a seeded generator;
an expert stack's rows are the rank's own experts), W the world size, s = 2^-10. Its gradient
is c whatever the weights, and (A = 2 micro-batches, |k| <= K = 8, D <= 8):

* ``engine.backward`` scales the loss by 1/A: the local gradient c/A = W k s/2 is a 7-bit
  integer (|W k| <= 64) times a power of two, exact in bf16 (8 bits) and fp32 alike;
* an fp32 reduction (stage 2: of each micro-batch; stage 1: of the local fp32 sum over the
  micro-batches) adds at most D*A such values: every partial sum, in any order, is an integer
  multiple of s/2 of at most 2^10 units, exact in fp32 (24 bits). The sum is W times an integer
  multiple of s/2, so the engine's division by W is exact, and so is stage 2's addition of
  the micro-batches' quotients;
* a bf16 reduction divides each rank's gradient by W first (in fp32, rounded to bf16):
  k s/2 (stage 2) or (k1 + k2) s/2 (stage 1), at most 16 units, exact in bf16's 8 bits; the
  widened fp32 sum is exact as above.

So the engine's reduced gradient is (s/2) * sum over ranks and micro-batches of k, exactly,
as is the reference's: plain torch autograd on the whole fp32 model (every expert), of the
mean of all ranks' probes, which is the sum of probes with coefficients k s/A (exact: W
cancels), accumulated micro-batch by micro-batch; an expert stack's rows take the probes of
the ranks that hold those experts (the engine reduces them over the expert-data-parallel
group and divides by W, as it must for the mean loss). The worker checks this premise on
every step (``grad_diff``: the engine's reduced gradient against the reference's). Given
the same gradient and state, torch's Muon on the engine's 2-D views and on the reference's
matrices, and AdamW on its flat partitions and on the parameters, run the same elementwise
operations and the same bf16 Newton-Schulz on the same bits (tests/test_muon_engine.py
checks one step of this); by induction the masters, ``momentum_buffer``, ``exp_avg`` and
``exp_avg_sq`` and the model's parameters are equal bit for bit after every step.

Clipping is not exact, so it stays inactive (``max_grad_norm`` above every norm: both
coefficients clamp to exactly 1). Every fragment's sum of squares S is exact here (at most
1024 squares of integers up to D*A*K = 2^7, in units of (s/2)^2: below 2^24), but the engine
squares each fragment's norm fl(sqrt(S)) again and sums over ranks, while torch's
clip_grad_norm_ takes the norm of the per-parameter norms: fl(fl(sqrt(2))^2) != 2 in fp32,
and a parameter cut between two ranks is two fragments there and one norm here. The totals
may differ in the last bits (they do, by one ulp, at D = 4), and so would the coefficients,
every clipped gradient, and through bf16 Newton-Schulz the run. The worker compares the
norms within their bound instead: each side is the sqrt of a sum of N positive terms
fl(fl(sqrt(S_i))^2), each within 3u of S_i, summed within (N - 1)u, so each total is within
(N/2 + 2)u of the exact norm (u = 2^-24; N the fragments of the whole job, or the
reference's parameters), and the two within the sum of both, plus u for second-order terms.
The two-halves test (tests/test_muon_engine.py) covers active clipping, and the gradients of
real losses through the model's forward, which the probe leaves out.

Workers return numbers (largest differences, the first step that differed), never verdicts.
"""

from __future__ import annotations

import torch
from torch import nn

from muon_workers import (
    ADAMW_OPTIONS,
    MUON_OPTIONS,
    MuonCase,
    full_state,
    is_muon,
    max_diff,
    summed,
    views_diff,
    build_model,
    gather_params,
    is_matrix,
    make_engine,
)
from zeroshard.moe import new_expert_groups
from zeroshard.moe.contract import expert_stacks

SCALE = 2.0**-10  # s: the probe's unit
K = 8  # |k| <= K
U = 2.0**-24  # fp32 unit roundoff
INACTIVE_CLIP = 1.0e6  # above every step's gradient norm (about 0.05 here)
STATE_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")


def exact_case(name: str, **options) -> MuonCase:
    """A case of this test: 4 steps of 2 micro-batches, clipping inactive."""
    return MuonCase(name, steps=4, accumulation=2, max_grad_norm=INACTIVE_CLIP, **options)


def probe_integers(step: int, rank: int, micro: int, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """k of every parameter (expert stacks with every expert) for one rank's micro-batch."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return {name: torch.randint(-K, K + 1, shape, generator=generator) for name, shape in shapes.items()}


def expert_rows(model: nn.Module, groups, world_size: int) -> dict[str, list[list[int]]]:
    """Per expert stack, every rank's experts (global ids: rows of the whole stack)."""
    if groups is None:
        return {}
    return {
        name: [list(module.expert_map[groups.mesh.ep_rank(rank)]) for rank in range(world_size)]
        for name, (_, module) in expert_stacks(model).items()
    }


def engine_probe(model: nn.Module, integers: dict, rows: dict, rank: int, world_size: int) -> torch.Tensor:
    """This rank's loss of one micro-batch: the probe with c = W k s, in the parameters' dtype."""
    terms = []
    for name, param in model.named_parameters():
        k = integers[name][rows[name][rank]] if name in rows else integers[name]
        coefficient = (k * world_size).to(param.dtype) * SCALE
        terms.append((coefficient * param).sum())
    return sum(terms)


class Reference:
    """The one-process run: the whole model in fp32, torch.optim.Muon on each matrix (each
    expert of a stack its own, a 2-D view of the stack) and torch.optim.AdamW on the rest."""

    def __init__(self, case: MuonCase, rows: dict[str, list[list[int]]]) -> None:
        self.case = case
        self.rows = rows
        self.model = build_model(case)  # no EP group: every expert
        self.params = dict(self.model.named_parameters())
        self.matrices = {
            name: [nn.Parameter(param.data[e]) for e in range(param.shape[0])] if name in rows else [param]
            for name, param in self.params.items()
            if name in rows or is_matrix(name, param)
        }
        self.rest = {name: param for name, param in self.params.items() if name not in self.matrices}
        self.muon = torch.optim.Muon([m for ms in self.matrices.values() for m in ms], **MUON_OPTIONS)
        self.adamw = torch.optim.AdamW(list(self.rest.values()), **ADAMW_OPTIONS)
        self.norm = 0.0

    @property
    def shapes(self) -> dict[str, torch.Size]:
        """Every parameter's whole shape (an expert stack with every expert)."""
        return {name: param.shape for name, param in self.params.items()}

    def backward(self, integers: dict, rank: int) -> None:
        """Rank ``rank``'s micro-batch's share of the mean loss: its probe with coefficients
        k s / A (its own experts' rows only), accumulated into the gradients."""
        terms = []
        for name, param in self.params.items():
            k = integers[name]
            if name in self.rows:
                own = torch.zeros_like(k)
                own[self.rows[name][rank]] = k[self.rows[name][rank]]
                k = own
            terms.append((k.float() * (SCALE / self.case.accumulation) * param).sum())
        sum(terms).backward()

    def step(self) -> None:
        """clip_grad_norm_ (inactive: it records the norm), Muon and AdamW, zero_grad."""
        self.norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.case.max_grad_norm))
        for name, matrices in self.matrices.items():
            if name in self.rows:
                for e, matrix in enumerate(matrices):
                    matrix.grad = self.params[name].grad[e]
        self.muon.step()
        self.adamw.step()
        self.model.zero_grad(set_to_none=True)
        for matrices in self.matrices.values():
            for matrix in matrices:
                matrix.grad = None

    def local(self, name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """``tensor`` of parameter ``name`` as rank ``rank`` holds it (its experts' rows)."""
        return tensor[self.rows[name][rank]] if name in self.rows else tensor

    def grads(self, rank: int) -> dict[str, torch.Tensor]:
        """The accumulated gradients, as rank ``rank`` holds its parameters."""
        return {name: self.local(name, param.grad, rank) for name, param in self.params.items()}

    def full_state(self, rank: int) -> dict:
        """Masters and optimizer states as ``muon_workers.full_state`` gives the engine's."""
        masters = {name: self.local(name, param.detach(), rank) for name, param in self.params.items()}
        states = {}
        for name, matrices in self.matrices.items():
            buffers = torch.stack([self.muon.state[m]["momentum_buffer"] for m in matrices])
            states[(name, "momentum_buffer")] = self.local(name, buffers, rank) if name in self.rows else buffers[0]
        for name, param in self.rest.items():
            for key in ("exp_avg", "exp_avg_sq"):
                states[(name, key)] = self.adamw.state[param][key]
        return {"masters": masters, "states": states}


def run_exact_cases(rank: int, world_size: int, cases: list[MuonCase]) -> list[dict]:
    """Spawn target: every case in one process group."""
    return [run_exact_case(rank, world_size, case) for case in cases]


def run_exact_case(rank: int, world_size: int, case: MuonCase) -> dict:
    groups = new_expert_groups(case.ep) if case.model == "moe" else None
    model = build_model(case, groups.ep if groups else None)
    engine = make_engine(model, case, groups.expert_dp if groups else None)
    rows = expert_rows(model, groups, world_size)
    reference = Reference(case, rows)
    muon = {name for name in engine.layout.param_names if is_muon(engine, name)}
    dtype = getattr(torch, case.dtype)
    initial = full_state(engine, muon, 0)["masters"]
    report = {"name": case.name, "grad_diff": 0.0, "masters_diff": 0.0, "states_diff": {key: 0.0 for key in STATE_KEYS}}
    report.update(params_diff=0.0, first_diff_step=-1, norm_rel_diff=0.0, norm_bound=0.0)
    for step in range(case.steps):
        for micro in range(case.accumulation):
            integers = probe_integers(step, rank, micro, reference.shapes)
            engine.backward(engine_probe(model, integers, rows, rank, world_size))
            for other in range(world_size):
                reference.backward(probe_integers(step, other, micro, reference.shapes), other)
        engine.reducer.reduce()  # stage 1 reduces at the step, or when a gradient is read
        reduced = gather_params(engine, engine.reducer.partition_grads)
        report["grad_diff"] = max(report["grad_diff"], max_diff(reduced, reference.grads(rank)))
        engine.step()
        engine.zero_grad()
        reference.step()
        _compare(report, step, full_state(engine, muon, step + 1), reference.full_state(rank))
        _compare_views(report, step, model, reference.full_state(rank)["masters"], dtype)
        _compare_norms(report, engine, reference)
    report["moved"] = max_diff(reference.full_state(rank)["masters"], initial)
    return report


def _compare(report: dict, step: int, engine_state: dict, reference_state: dict) -> None:
    """Fold one step's differences of masters and of each state into the report."""
    found = {"masters": max_diff(engine_state["masters"], reference_state["masters"])}
    for key in STATE_KEYS:
        ours = {k: v for k, v in engine_state["states"].items() if k[1] == key}
        theirs = {k: v for k, v in reference_state["states"].items() if k[1] == key}
        found[key] = max_diff(ours, theirs)
        report["states_diff"][key] = max(report["states_diff"][key], found[key])
    report["masters_diff"] = max(report["masters_diff"], found["masters"])
    if report["first_diff_step"] < 0 and any(value != 0.0 for value in found.values()):
        report["first_diff_step"] = step


def _compare_views(report: dict, step: int, model: nn.Module, masters: dict, dtype: torch.dtype) -> None:
    """The engine's model parameters against the reference's fp32 parameters cast."""
    difference = views_diff(model, masters, dtype)
    report["params_diff"] = max(report["params_diff"], difference)
    if report["first_diff_step"] < 0 and difference != 0.0:
        report["first_diff_step"] = step


def _compare_norms(report: dict, engine, reference: Reference) -> None:
    """The engine's global gradient norm against clip_grad_norm_'s, and their bound."""
    fragments = summed(sum(len(group.fragments(engine.rank_in(group))) for group in engine.layout.groups))
    bound = ((fragments + len(reference.params)) / 2 + 5) * U
    report["norm_rel_diff"] = max(report["norm_rel_diff"], abs(engine.last_grad_norm - reference.norm) / reference.norm)
    report["norm_bound"] = max(report["norm_bound"], bound)
