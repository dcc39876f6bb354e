"""Worker code for the MoE engine tests: ZeroOptimizer training MoEGPT with expert
parallelism on spawned gloo ranks, against a single process training the same model.

Every rank builds the same full model (all experts, seeded); its EP model loads its own
experts from the full model's per-expert state dict. Each rank trains on its own batches; the
reference, which every rank computes on its own (the model is tiny), is the full model at
EP = 1 on one process, fed the concatenation of every rank's batch each step (so its mean
loss is the mean of the ranks' losses), with fp32 masters, the same clipping and AdamW.
Workers return max abs differences, not verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.buffers import owns_storage
from zeroshard.engine import ZeroOptimizer
from zeroshard.layout import LayoutPolicy
from zeroshard.moe import MoEConfig, MoEGPT, moe_param_groups, new_expert_groups, per_expert_state_dict

MODEL = MoEConfig(vocab_size=29, block_size=8, n_layer=1, n_head=2, n_embd=16, num_experts=4, top_k=2, expert_hidden=8)
BATCH, SEQ, STEPS = 2, 8, 4
OPTIONS = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


@dataclass(frozen=True)
class MoECase:
    ep_size: int
    stage: int
    dtype: str  # parameter dtype
    reduce_dtype: str = "float32"
    alignment_bytes: int = 16
    bucket_numel: int | None = None
    max_grad_norm: float | None = 0.5  # below the first steps' norms: clipping is active

    @property
    def label(self) -> str:
        precision = f"{self.dtype} reduce {self.reduce_dtype}"
        return f"EP={self.ep_size} stage {self.stage} {precision} align {self.alignment_bytes}"


def full_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return per_expert_state_dict(MoEGPT(MODEL))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 97 + rank)
    idx = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ), generator=generator)
    return idx, (idx * 3 + 1) % MODEL.vocab_size


def global_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [batch(step, rank) for rank in range(world_size)]
    return torch.cat([idx for idx, _ in parts]), torch.cat([targets for _, targets in parts])


def reference_run(case: MoECase, world_size: int) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Losses, grad norms and final fp32 masters of the single-process run (all experts)."""
    model = MoEGPT(MODEL)
    model.load_state_dict(full_state(), strict=True)
    params = dict(model.named_parameters())  # tied weights once
    masters = {name: nn.Parameter(param.detach().clone().float()) for name, param in params.items()}
    dtype = getattr(torch, case.dtype)
    model.to(dtype)
    optimizer = torch.optim.AdamW(list(masters.values()), **OPTIONS)
    losses, norms = [], []
    for step in range(STEPS):
        loss = model(*global_batch(step, world_size))
        loss.backward()
        losses.append(loss.item())
        for name, param in params.items():
            masters[name].grad = param.grad.float()
            param.grad = None
        clip = case.max_grad_norm if case.max_grad_norm is not None else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(masters.values()), clip)))
        optimizer.step()
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(masters[name])
    return losses, norms, {name: master.detach() for name, master in masters.items()}


def train_case(rank: int, world_size: int, case: MoECase) -> dict:
    groups = new_expert_groups(case.ep_size)
    model = MoEGPT(MODEL, ep_group=groups.ep)
    model.load_state_dict(full_state(), strict=True)
    engine = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        moe_param_groups(model),
        stage=case.stage,
        param_dtype=getattr(torch, case.dtype),
        reduce_dtype=getattr(torch, case.reduce_dtype),
        policy=LayoutPolicy.native(case.alignment_bytes, bucket_numel=case.bucket_numel),
        expert_process_group=groups.expert_dp,
        max_grad_norm=case.max_grad_norm,
        **OPTIONS,
    )
    experts = {name: param for name, param in model.named_parameters() if ".experts." in name}
    pointers = {name: param.data_ptr() for name, param in experts.items()}
    losses, norms = [], []
    for step in range(STEPS):
        loss = model(*batch(step, rank))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(sum(engine.comm.all_gather_object(loss.item())) / world_size)
        norms.append(engine.last_grad_norm)

    ref_losses, ref_norms, ref_masters = reference_run(case, world_size)
    expert_ids = list(model.blocks[0].moe.experts.expert_ids)
    master_diffs = {}
    for name in engine.layout.param_names:
        value = engine.get_full_fp32_param(name)
        expected = ref_masters[name][expert_ids] if name in experts else ref_masters[name]
        master_diffs[name] = float((value - expected).abs().max())
    expert_group = next(group for group in engine.layout.groups if group.is_expert_group)
    dense_group = next(group for group in engine.layout.groups if not group.is_expert_group)
    return {
        "loss_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "norm_diff": max(abs(a - b) / abs(b) for a, b in zip(norms, ref_norms)),
        "masters_diff": max(master_diffs.values()),
        "worst_master": max(master_diffs, key=master_diffs.get),
        "dense_moved": max(float((ref_masters[n] - initial).abs().max()) for n, initial in _dense_initial(ref_masters)),
        "losses": losses,
        "expert_dp_size": expert_group.world_size,
        "dense_world_size": dense_group.world_size,
        "expert_map": [list(ids) for ids in expert_group.expert_map],
        "expert_ids": expert_ids,
        "expert_padding_only": not expert_group.fragments(engine.rank_in(expert_group)),
        "partition_misalignment": _partition_misalignment(engine),
        "expert_storage_kept": all(param.data_ptr() == pointers[name] for name, param in experts.items()),
        "experts_in_buffer": all(
            owns_storage(engine.buffers[engine.layout.param(name)[0].index], param) for name, param in experts.items()
        ),
        "expert_view_shapes": [list(param.shape) for param in experts.values()],
        "bytes": {label: dict(comm.bytes_moved) for label, comm in engine.comms.items()},
    }


def _dense_initial(masters: dict[str, torch.Tensor]):
    """(name, initial value) of the dense parameters, to show how far training moved them."""
    return [(name, value) for name, value in full_state().items() if name in masters]


def _partition_misalignment(engine: ZeroOptimizer) -> list[int]:
    """data_ptr() % 16 of this rank's slice of every bucket of every group (all 0 if aligned)."""
    return [
        buffer.rank_slice(bucket.index, engine.rank_in(buffer.group)).data_ptr() % 16
        for buffer in engine.buffers
        for bucket in buffer.group.buckets
    ]


def overflow_in_experts(rank: int, world_size: int, ep_size: int = 2) -> dict:
    """fp16: at step 1 the last rank alone makes its experts' w1 gradient inf. Only the ranks
    of its expert-DP group see the inf after reduction; every rank must skip that step."""
    groups = new_expert_groups(ep_size)
    model = MoEGPT(MODEL, ep_group=groups.ep)
    model.load_state_dict(full_state(), strict=True)
    engine = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        moe_param_groups(model),
        param_dtype=torch.float16,
        expert_process_group=groups.expert_dp,
        **OPTIONS,
    )
    current = [0]

    def poison(grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("inf")) if rank == world_size - 1 and current[0] == 1 else grad

    model.blocks[0].moe.experts.w1.register_hook(poison)
    stepped, masters_changed, scales = [], [], []
    for step in range(3):
        current[0] = step
        before = [master.detach().clone() for master in engine.masters]
        engine.backward(model(*batch(step, rank)))
        scales.append(engine.scaler.scale)
        stepped.append(engine.step())
        engine.zero_grad()
        masters_changed.append(any(not torch.equal(a, b) for a, b in zip(before, engine.masters)))
    return {"stepped": stepped, "masters_changed": masters_changed, "scales": scales + [engine.scaler.scale]}


def run_moe_cases(rank: int, world_size: int, cases: list[MoECase], overflow: bool = False) -> list[dict]:
    """The training comparisons, then (if asked) the fp16 overflow in one rank's experts."""
    results = [train_case(rank, world_size, case) for case in cases]
    return results + ([overflow_in_experts(rank, world_size)] if overflow else [])
