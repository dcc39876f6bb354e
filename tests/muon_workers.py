"""Worker code for the Muon engine tests: ZeroOptimizer with torch.optim.Muon for the
matrices and torch.optim.AdamW for the rest, on spawned gloo ranks, against one process.

What the engine computes per step splits in two, and each half is compared on its own:

* the reduced gradient. Every rank also runs a *replica* of its model (the same parameter
  values, the same micro-batches, the same loss scaling; for MoEGPT the same EP group), so
  the replica's local gradients are the engine rank's bit for bit. The reference reduces
  them as the engine does (see :func:`mirror_reduction`): in rank order, which gloo's fp32
  reduce-scatter need not follow. A sum of two terms has one order, so at D <= 2 and with a
  bf16 reduction (whose fp32 sum the engine takes in rank order) the gradient must be equal
  bit for bit; a sum of D > 2 fp32 terms in another order differs by at most
  ``2 (D - 1) u sum_r |g_r|`` (u = 2^-24; each order is within (D - 1) u sum_r |g_r| of the
  exact sum), and the bound below adds the roundings of the division by D and of the
  accumulation over micro-batches, each at most u of its result;
* the step. Given the engine's own gradient (clipped by the engine's coefficient, rebuilt
  from ``engine.last_grad_norm`` the way the engine computes it) and its state before the
  step, torch.optim.Muon on each matrix (each expert of a stack its own matrix) and
  torch.optim.AdamW on the rest, on one process, must give the engine's masters and states
  after the step bit for bit: the engine hands the same optimizer classes the same tensors
  (2-D views of its partitions), so they run the same operations in the same order,
  Newton-Schulz in bf16 included, on any CPU.

Each step also counts the Newton-Schulz calls of every rank (torch's
``_zeropower_via_newtonschulz``): each matrix of the job exactly once. Workers return
numbers, never verdicts.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.optim._muon as torch_muon
from torch import nn

from zeroshard.engine import ZeroOptimizer
from zeroshard.engine.state_io import partition_state
from zeroshard.layout import LayoutPolicy
from zeroshard.models import GPTConfig, TinyGPT
from zeroshard.moe import MoEConfig, MoEGPT, moe_param_groups, new_expert_groups, per_expert_state_dict

GPT = GPTConfig(vocab_size=31, block_size=8, n_layer=2, n_head=2, n_embd=16)
TINY = GPTConfig(vocab_size=17, block_size=4, n_layer=1, n_head=2, n_embd=8)
MOE = MoEConfig(vocab_size=29, block_size=8, n_layer=1, n_head=2, n_embd=16, num_experts=4, top_k=2, expert_hidden=8)
MUON_OPTIONS = dict(lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=True)
ADAMW_OPTIONS = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
BATCH, SEQ = 2, 8
U = 2.0**-24  # fp32 unit roundoff
NS_CALLS: Counter = Counter()


def _counting_newton_schulz():
    original = torch_muon._zeropower_via_newtonschulz

    def counted(*args, **kwargs):
        NS_CALLS["calls"] += 1
        return original(*args, **kwargs)

    return counted


torch_muon._zeropower_via_newtonschulz = _counting_newton_schulz()


@dataclass(frozen=True)
class MuonCase:
    """One run: the model, EP, stage, precisions, accumulation, clipping, buckets."""

    name: str
    model: str = "gpt"  # "gpt" (TinyGPT, 2 layers), "tiny" (1 layer), "moe" (MoEGPT)
    ep: int = 1
    stage: int = 2
    dtype: str = "float32"  # parameter dtype
    reduce_dtype: str = "float32"
    accumulation: int = 2
    max_grad_norm: float | None = 0.05  # below every step's norm: clipping is active
    bucket_numel: int | None = 300
    steps: int = 3


# ---- models, data, param groups ------------------------------------------------------------------


def build_model(case: MuonCase, ep_group=None) -> nn.Module:
    torch.manual_seed(0)
    if case.model == "moe":
        full = MoEGPT(MOE)
        model = MoEGPT(MOE, ep_group=ep_group)
        model.load_state_dict(per_expert_state_dict(full), strict=True)
        return model
    return TinyGPT(GPT if case.model == "gpt" else TINY)


def vocab(case: MuonCase) -> int:
    return {"gpt": GPT, "tiny": TINY, "moe": MOE}[case.model].vocab_size


def batch(case: MuonCase, step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 1009 + rank * 31 + micro)
    seq = min(SEQ, {"gpt": GPT, "tiny": TINY, "moe": MOE}[case.model].block_size)
    idx = torch.randint(0, vocab(case), (BATCH, seq), generator=generator)
    return idx, (idx * 3 + 1) % vocab(case)


def is_matrix(name: str, param: nn.Parameter) -> bool:
    """What Muon trains: the blocks' 2-D weights (not the embeddings, which AdamW trains)."""
    return param.ndim == 2 and name.startswith("blocks.")


def param_groups(model: nn.Module, case: MuonCase) -> list[dict]:
    """Muon (the engine's class) for the matrices and the expert stacks, AdamW for the rest."""
    params = dict(model.named_parameters())
    groups = moe_param_groups(model) if case.model == "moe" else [{"params": list(params.values())}]
    dense = {id(p) for p in groups[0]["params"]}
    names = [name for name, p in params.items() if id(p) in dense]
    matrices = [params[name] for name in names if is_matrix(name, params[name])]
    rest = [params[name] for name in names if not is_matrix(name, params[name])]
    return [{"params": matrices}, {"params": rest, "optimizer": torch.optim.AdamW, **ADAMW_OPTIONS}, *groups[1:]]


def make_engine(model: nn.Module, case: MuonCase, expert_dp=None) -> ZeroOptimizer:
    return ZeroOptimizer(
        model,
        torch.optim.Muon,
        param_groups(model, case),
        stage=case.stage,
        param_dtype=getattr(torch, case.dtype),
        reduce_dtype=getattr(torch, case.reduce_dtype),
        policy=LayoutPolicy.native(bucket_numel=case.bucket_numel),
        expert_process_group=expert_dp,
        gradient_accumulation_steps=case.accumulation,
        max_grad_norm=case.max_grad_norm,
        **MUON_OPTIONS,
    )


# ---- the run ---------------------------------------------------------------------------------------


def run_cases(rank: int, world_size: int, cases: list[MuonCase]) -> list[dict]:
    """Spawn target: every case in one process group."""
    return [run_case(rank, world_size, case) for case in cases]


def run_case(rank: int, world_size: int, case: MuonCase) -> dict:
    groups = new_expert_groups(case.ep) if case.model == "moe" else None
    model = build_model(case, groups.ep if groups else None)
    replica = build_model(case, groups.ep if groups else None)
    engine = make_engine(model, case, groups.expert_dp if groups else None)
    dtype = getattr(torch, case.dtype)
    replica.to(dtype)
    experts = {name for group in engine.grouping.user_groups if group.expert for name in _names(engine, group)}
    muon = {name for name in engine.layout.param_names if is_muon(engine, name)}
    report = {"name": case.name, "grad_excess": 0.0, "grad_max_diff": 0.0, "step_masters_diff": 0.0}
    report.update(step_state_diff=0.0, views_diff=0.0, ns_calls=[], moved=0.0, padding_nonzero=0.0)
    for step in range(case.steps):
        replica.load_state_dict(model.state_dict())
        local = _replica_gradients(replica, case, step, rank, engine.scaler.scale)
        for micro in range(case.accumulation):
            loss = model(*batch(case, step, rank, micro))
            engine.backward(loss)
        before = full_state(engine, muon, step)
        engine.reducer.reduce()  # stage 1 reduces at the step, or when a gradient is read
        scale = engine.scaler.scale
        grads = {k: v / scale for k, v in gather_params(engine, engine.reducer.partition_grads).items()}
        expected = mirror_reductions(engine, local, case, scale)
        for name, grad in grads.items():
            value, bound = expected[name]
            report["grad_max_diff"] = max(report["grad_max_diff"], float((grad - value).abs().max()))
            report["grad_excess"] = max(report["grad_excess"], float(((grad - value).abs() - bound).max()))
        calls = NS_CALLS["calls"]
        engine.step()
        engine.zero_grad()
        report["ns_calls"].append(summed(NS_CALLS["calls"] - calls))
        after = full_state(engine, muon, step + 1)
        masters, states = reference_step(engine, before, grads, muon, experts)
        report["step_masters_diff"] = max(report["step_masters_diff"], max_diff(masters, after["masters"]))
        report["step_state_diff"] = max(report["step_state_diff"], max_diff(states, after["states"]))
        report["moved"] = max(report["moved"], max_diff(after["masters"], before["masters"]))
        report["views_diff"] = max(report["views_diff"], views_diff(model, after["masters"], dtype))
        report["padding_nonzero"] = max(report["padding_nonzero"], _padding_nonzero(engine))
    report["expected_ns_calls"] = _expected_ns_calls(engine, muon, experts, case)
    report["owner_groups"] = [group.owner for group in engine.layout.groups]
    return report


def _names(engine: ZeroOptimizer, user) -> list[str]:
    return [slot.name for g in user.layout_groups for slot in engine.layout.groups[g].params]


def is_muon(engine: ZeroOptimizer, name: str) -> bool:
    group, _ = engine.layout.param(name)
    return group.owner


def gather_params(engine: ZeroOptimizer, partitions: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole parameters (an expert stack: this rank's) from every rank's partition of each
    group (one all-gather per group, over its shard group), reassembled from their pieces."""
    full: dict[str, torch.Tensor] = {}
    for group, partition in zip(engine.layout.groups, partitions):
        everyone = _gather(partition.detach().float(), engine.group_comms[group.index])
        for slot in group.params:
            values = torch.empty(slot.numel, dtype=torch.float32)
            for piece in group.pieces(slot.index):
                values[piece.param_start : piece.param_start + piece.length] = everyone[piece.rank][
                    piece.partition_start : piece.partition_start + piece.length
                ]
            full[slot.name] = values.view(slot.spec.shape)
    return full


def summed(value: int) -> int:
    total = torch.tensor([value], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(total)
    return int(total)


def _expected_ns_calls(engine: ZeroOptimizer, muon: set[str], experts: set[str], case: MuonCase) -> int:
    """Each dense matrix once; each expert of each stack once per EP rank (its own experts)."""
    count = 0
    for name in muon:
        group, slot = engine.layout.param(name)
        count += slot.spec.shape[0] * case.ep if name in experts else 1
    return count


# ---- the reduction, mirrored --------------------------------------------------------------------------


def _replica_gradients(replica: nn.Module, case: MuonCase, step: int, rank: int, scale: float) -> list[dict]:
    """Per micro-batch, the replica's local gradient of each parameter (the engine rank's)."""
    found = []
    for micro in range(case.accumulation):
        loss = replica(*batch(case, step, rank, micro))
        (loss * (scale / case.accumulation)).backward()
        names = {id(p): name for name, p in replica.named_parameters()}
        found.append({names[id(p)]: p.grad.detach().clone() for p in replica.parameters() if p.grad is not None})
        replica.zero_grad(set_to_none=True)
    return found


def mirror_reductions(engine: ZeroOptimizer, local: list[dict], case: MuonCase, scale: float) -> dict:
    """:func:`mirror_reduction` of every parameter, the local gradients of each group's
    parameters sent in one all-gather per micro-batch."""
    found = {}
    for group in engine.layout.groups:
        names = [slot.name for slot in group.params]
        comm = engine.group_comms[group.index]
        flat = [torch.cat([micro[name].reshape(-1) for name in names]) for micro in local]
        rounds = _reduction_rounds(flat, case)
        sizes = [slot.numel for slot in group.params]
        value, bound = mirror_reduction(rounds, comm, case, scale)
        for name, slot, v, b in zip(names, group.params, value.split(sizes), bound.split(sizes)):
            found[name] = (v.view(slot.spec.shape), b.view(slot.spec.shape))
    return found


def _gather(tensor: torch.Tensor, comm) -> list[torch.Tensor]:
    if comm.world_size == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(comm.world_size)]
    dist.all_gather(parts, tensor.contiguous(), group=comm.group)
    return parts


def _reduction_rounds(local: list[torch.Tensor], case: MuonCase) -> list[torch.Tensor]:
    """What the engine reduces: stage 1 the micro-batches summed in fp32, once; stage 2 each
    micro-batch's gradient."""
    if case.stage == 2:
        return list(local)
    accumulated = torch.zeros(local[0].shape, dtype=torch.float32)
    for grad in local:
        accumulated.add_(grad)
    return [accumulated]


def mirror_reduction(rounds: list[torch.Tensor], comm, case: MuonCase, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's reduced, unscaled gradient from this rank's local values of each
    reduction (``rounds``) and every other rank's, summed in rank order, and the bound on
    its difference from the engine's (zero where the engine's sum has one order: two terms,
    or the bf16 reduction, which the engine sums in rank order)."""
    divisor = dist.get_world_size() if dist.is_initialized() else 1  # W, for expert groups too
    widened = case.reduce_dtype != "float32" and divisor > 1
    result = bound = None
    for value in rounds:
        if widened:  # divided by W and rounded once, before the sum
            payload = torch.div(value, divisor, out=torch.empty(value.shape, dtype=getattr(torch, case.reduce_dtype)))
        else:
            payload = value.float()
        parts = _gather(payload, comm)
        total = parts[0].float().clone()
        for part in parts[1:]:
            total.add_(part)
        reduced = total if widened else total.div_(divisor)
        slack = torch.zeros_like(reduced)
        if not widened and len(parts) > 2:  # another order of the sum, then the division's rounding
            absolute = sum(part.float().abs() for part in parts)
            slack = (2 * (len(parts) - 1) * U * absolute + 2 * U * total.abs() * divisor) / divisor
        if result is None:
            result, bound = reduced, slack
        else:
            result = result + reduced
            bound = bound + slack + (2 * U * result.abs() if not widened and len(parts) > 2 else 0)
    if scale != 1.0:
        result = result / scale
        bound = bound / scale
    return result, bound


# ---- the step, on one process -------------------------------------------------------------------------


def full_state(engine: ZeroOptimizer, muon: set[str], step: int) -> dict:
    """Every parameter's fp32 master and optimizer state, whole (collective)."""
    masters = gather_params(engine, list(engine.masters))
    states: dict[tuple[str, str], torch.Tensor] = {}
    if step:
        for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
            partitions = [
                partition_state(engine, g)[0].get(key, torch.zeros(group.partition_numel))
                for g, group in enumerate(engine.layout.groups)
            ]
            for name, value in gather_params(engine, partitions).items():
                if (key == "momentum_buffer") == (name in muon):
                    states[(name, key)] = value
    adam_group = next(i for i, group in enumerate(engine.layout.groups) if not group.owner)
    scalars = {key: value.clone() for key, value in partition_state(engine, adam_group)[1].items()}
    return {"masters": masters, "states": states, "scalars": scalars}


def _clip_coefficient(engine: ZeroOptimizer) -> torch.Tensor | None:
    """The engine's clip coefficient of the last step, as it computes it (None: no clip)."""
    if engine.max_grad_norm is None:
        return None
    total = torch.tensor(engine.last_grad_norm, dtype=torch.float32)
    coefficient = torch.clamp(engine.max_grad_norm / (total + 1e-6), max=1.0)
    return None if coefficient.item() == 1.0 else coefficient


def reference_step(engine: ZeroOptimizer, before: dict, grads: dict, muon: set[str], experts: set[str]):
    """torch.optim.Muon (each matrix, each expert) and torch.optim.AdamW (the rest) on fp32
    tensors from the engine's state before the step and its gradient; the masters and
    states after."""
    coefficient = _clip_coefficient(engine)
    muon_params: dict[str, list[nn.Parameter]] = {}
    adam_params: dict[str, nn.Parameter] = {}
    for name, value in before["masters"].items():
        grad = grads[name] if coefficient is None else grads[name] * coefficient
        if name in muon:
            matrices = list(value) if name in experts else [value]
            gradients = list(grad) if name in experts else [grad]
            muon_params[name] = [nn.Parameter(m.clone()) for m in matrices]
            for param, g in zip(muon_params[name], gradients):
                param.grad = g.clone()
        else:
            adam_params[name] = nn.Parameter(value.clone())
            adam_params[name].grad = grad.clone()
    muon_optimizer = torch.optim.Muon([p for ps in muon_params.values() for p in ps], **MUON_OPTIONS)
    adam_optimizer = torch.optim.AdamW(list(adam_params.values()), **ADAMW_OPTIONS)
    for name, params in muon_params.items():
        if (name, "momentum_buffer") in before["states"]:
            buffers = before["states"][(name, "momentum_buffer")]
            for param, buffer in zip(params, list(buffers) if name in experts else [buffers]):
                muon_optimizer.state[param]["momentum_buffer"] = buffer.clone()
    for name, param in adam_params.items():
        if (name, "exp_avg") in before["states"]:
            adam_optimizer.state[param] = {
                "step": before["scalars"]["step"].clone(),
                "exp_avg": before["states"][(name, "exp_avg")].clone(),
                "exp_avg_sq": before["states"][(name, "exp_avg_sq")].clone(),
            }
    muon_optimizer.step()
    adam_optimizer.step()
    masters = {name: torch.stack([p.detach() for p in ps]) if name in experts else ps[0].detach() for name, ps in muon_params.items()}
    masters.update({name: p.detach() for name, p in adam_params.items()})
    states = {}
    for name, params in muon_params.items():
        buffers = [muon_optimizer.state[p]["momentum_buffer"] for p in params]
        states[(name, "momentum_buffer")] = torch.stack(buffers) if name in experts else buffers[0]
    for name, param in adam_params.items():
        for key in ("exp_avg", "exp_avg_sq"):
            states[(name, key)] = adam_optimizer.state[param][key]
    return masters, states


# ---- checks ---------------------------------------------------------------------------------------------


def max_diff(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        return math.inf
    return max((float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].numel()), default=0.0)


def views_diff(model: nn.Module, masters: dict[str, torch.Tensor], dtype: torch.dtype) -> float:
    """The model's parameters against the masters cast: the all-gather put them in place."""
    params = dict(model.named_parameters())
    return max(float((params[name].detach().float() - value.to(dtype).float()).abs().max()) for name, value in masters.items())


def _padding_nonzero(engine: ZeroOptimizer) -> float:
    """The largest magnitude in the padding of this rank's masters and optimizer states."""
    worst = 0.0
    for index, group in enumerate(engine.layout.groups):
        tensors = [engine.masters[index].detach(), *partition_state(engine, index)[0].values()]
        for begin, end in group.padding_ranges(engine.rank_in(group)):
            for tensor in tensors:
                if end > begin:
                    worst = max(worst, float(tensor[begin:end].abs().max()))
    return worst
