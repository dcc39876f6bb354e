"""ZeroOptimizer: ZeRO stage 1/2 around any torch.optim optimizer.

Each rank keeps the model's low-precision parameters as views into flat buffers (one per
layout group), its own partition of the fp32 master weights, a torch optimizer over those
partitions (one flat tensor per layout group), and its partition of the reduced gradients.

A step: finish the gradient reduction, unscale (fp16), skip on overflow (decided on all
ranks together), clip by the global norm, let the torch optimizer update the partitions,
then write them back in the parameter dtype and all-gather the flat buffers in place.

Optimizers of whole matrices (``torch.optim.Muon``; see ``matrices``): the layout groups they
train are owner groups, every matrix whole in one rank's partition, and the optimizer gets
each matrix the rank owns as a 2-D view of its master partition. A param group may name its
own optimizer class (``"optimizer": torch.optim.AdamW`` for what is not a matrix); the
optimizers of several classes are stepped as one (``multi.MultiOptimizer``).

Mixture of experts: param groups flagged ``"expert": True`` hold stacked expert weights
(different on each expert-parallel rank). Their layout groups are partitioned over the
expert-data-parallel process group (``expert_process_group``, W / EP ranks) and reduced,
broadcast and gathered over it, with one ``Collectives`` per shard group; everything
per-rank about them uses the rank within that group. Their gradients are divided by W like
the dense ones (see ``gradients``). The norm and the overflow flag need no special case:
every gradient element lies in exactly one rank's partition of one group, so one all-reduce
over all W ranks counts each once.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ..buffers import FlatParamBuffer, bind_flat_buffer
from ..comm import Collectives
from ..layout import GroupLayout, Layout, LayoutPolicy
from ..state import ShardedState
from . import setup, state_io
from .fragments import FragmentAccess
from .gradients import GradientReducer
from .grouping import Grouping, resolve_groups
from .matrices import MatrixStates
from .memory import MemoryReport, rank_memory
from .multi import build_optimizer
from .scaler import LossScaler
from .torch_api import TorchOptimizerAPI


class ZeroOptimizer(FragmentAccess, TorchOptimizerAPI, torch.optim.Optimizer):
    """Shards fp32 master weights, optimizer state (stage 1) and gradients (stage 2).

    It is a full ``torch.optim.Optimizer``: lr schedulers take the engine itself, and step,
    state_dict and load_state_dict hooks fire as on any torch optimizer. Its
    ``param_groups``, ``state`` and ``defaults`` are those of the wrapped optimizer over
    this rank's fp32 master partitions (one tensor per layout group), so a scheduler that
    changes the engine's lr changes the lr the wrapped optimizer uses. ``state_dict()`` is
    this rank's shard (see there); checkpoints that reshard go through ``zeroshard.checkpoint``.

    Args:
        model: the module to train; its trainable parameters become views into flat buffers.
        optimizer_class: a torch.optim.Optimizer class (AdamW, Adam, SGD, ...).
        param_groups: as for torch optimizers: an iterable of parameters or of dicts with
            "params" and per-group options. None means all trainable parameters. A dict
            with ``"expert": True`` holds expert parameters (``zeroshard.moe.moe_param_groups``):
            stacked weights whose first dimension is this rank's E / EP local experts. A
            dict may name its own optimizer class under ``"optimizer"`` (with its own
            options in the dict; ``**defaults`` are ``optimizer_class``'s): Muon for the
            matrices and ``{"params": rest, "optimizer": torch.optim.AdamW, "lr": ...}``.
            An optimizer of whole matrices (``torch.optim.Muon``, or a class with
            ``zeroshard_whole_matrices = True``) gets each matrix whole, on one rank.
        stage: 1 (shard master weights and optimizer state) or 2 (also gradients).
        param_dtype: cast floating-point parameters to this dtype (bf16, fp16); the fp32
            master weights start from the values before the cast. None keeps their dtypes.
        reduce_dtype: the dtype gradients are reduced across ranks in (FSDP2's name,
            DeepSpeed's ``communication_data_type``): torch.float32 (default), bf16 or
            fp16, or None for each group's parameter dtype. A lower precision halves the
            gradient bytes; each rank divides by the world size in fp32 and rounds once
            before sending, and the sum is taken and accumulated in fp32 (on gloo; other
            backends sum in the reduce dtype). Stage 1 rounds its fp32 sum over the
            micro-batches once per step; stage 2 rounds each micro-batch's gradient. At
            world size 1 nothing is reduced and nothing is rounded.
        policy: the flat-buffer layout policy. Default: 16-byte aligned, and for stage 2
            buckets of ``DEFAULT_STAGE2_BUCKET_NUMEL`` elements.
        layout: a precomputed layout to use; it must match the parameters and world size.
        process_group: torch.distributed group of the data-parallel ranks (default: world).
        expert_process_group: the expert-data-parallel group (``new_expert_groups(EP).expert_dp``):
            the W / EP ranks holding the same experts, over which expert groups are sharded
            and reduced. Required when a param group is an expert group.
        gradient_accumulation_steps: micro-batches per step; ``backward`` divides the loss.
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
        loss_scaler: for fp16 parameters a dynamic LossScaler is used unless one is given.
        offload: keep fp32 master weights and optimizer state in host memory.
        sync_module_states: broadcast rank 0's initial parameter values to every rank.
        **defaults: optimizer arguments (lr, betas, weight_decay, ...).

    Construction is collective over ``process_group``: every rank builds its engine with the
    same arguments; the ranks compare their layouts (one all-gather) and, with
    ``sync_module_states``, take rank 0's initial values (a broadcast per group, over the
    group's shard group: expert groups over ``expert_process_group``).

    Raises:
        ValueError: a bad argument, before anything is communicated (a stage other than 1 or
            2, ``gradient_accumulation_steps`` < 1, a param group without trainable
            parameters or with one not in the model, a parameter that is not contiguous or
            not floating-point, parameters on several devices, an expert group without
            ``expert_process_group``, a ``layout`` that does not fit, an unknown
            ``reduce_dtype``, a parameter that is not a matrix in a group of an optimizer
            of whole matrices, options such an optimizer refuses); or, on every rank, when
            the ranks' layouts differ or the expert process group is not the expert
            mesh's (``zeroshard.moe.new_expert_groups``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        param_groups: Iterable[Any] | None = None,
        *,
        stage: int = 2,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = torch.float32,
        policy: LayoutPolicy | None = None,
        layout: Layout | None = None,
        process_group: Any = None,
        expert_process_group: Any = None,
        gradient_accumulation_steps: int = 1,
        max_grad_norm: float | None = None,
        loss_scaler: LossScaler | None = None,
        offload: bool = False,
        sync_module_states: bool = True,
        **defaults: Any,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {stage!r}")
        if gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
        self.model = model
        self.stage = stage
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.offload = offload
        self.comm = Collectives(process_group)
        self.grouping: Grouping = resolve_groups(model, param_groups, param_dtype)
        owners = setup.owner_groups(self.grouping, optimizer_class, defaults)
        self.comms = setup.shard_group_collectives(self.comm, self.grouping, expert_process_group)
        self.layout = setup.resolve_layout(self.grouping, self.comms, stage, layout, policy, owners)
        self.layout_digest = setup.check_same_layout_on_every_rank(self.layout, self.comms)

        self.device = self.grouping.layout_params[0][0].device
        self.master_device = torch.device("cpu") if offload else self.device
        initial = setup.initial_values(self.layout, self.grouping, self.comms, self.device, sync_module_states)
        self.group_comms = [self.comms[group.shard_group] for group in self.layout.groups]
        self.buffers: list[FlatParamBuffer] = [
            bind_flat_buffer(group, params, self.device, self.layout.policy)
            for group, params in zip(self.layout.groups, self.grouping.layout_params)
        ]
        self.masters = [
            setup.master_partition(values, group, self.rank_in(group), self.master_device)
            for values, group in zip(initial, self.layout.groups)
        ]
        for buffer, values in zip(self.buffers, initial):
            buffer.data.copy_(values)  # every rank now holds rank 0's values
        del initial

        self.matrices = MatrixStates.of(self.masters, self.layout.groups, self.rank_in)
        classes = setup.optimizer_classes(self.grouping, optimizer_class)
        self.optimizer = build_optimizer(self._torch_param_groups(), classes, optimizer_class, defaults)
        # torch's own set-up (hooks, profiling, the param-group checks) over the wrapped
        # optimizer's groups; param_groups, state and defaults write through to it. No
        # defaults here: each group already holds its own class's, and torch would write the
        # first class's into the groups of the others (Muon's ns_steps into AdamW's).
        self._groups_fixed = False
        inner_defaults = self.optimizer.defaults
        torch.optim.Optimizer.__init__(self, list(self.optimizer.param_groups), {})
        self.defaults = inner_defaults  # torch's __init__ wrote {} through the setter
        self._groups_fixed = True
        positions = {name: index for index, (name, _) in enumerate(model.named_parameters())}
        self.reduce_dtypes = setup.resolve_reduce_dtypes(self.layout, reduce_dtype)
        self.reducer = GradientReducer(self.buffers, self.comm, stage, positions, self.reduce_dtypes, self.group_comms)
        has_fp16 = any(group.dtype == "float16" for group in self.layout.groups)
        self.scaler = loss_scaler or (LossScaler() if has_fp16 else LossScaler.disabled())
        self._checks_overflow = has_fp16 or self.scaler.checks_overflow
        self.global_steps = 0
        self.last_grad_norm: float | None = None
        self._fragments = [group.fragments(self.rank_in(group)) for group in self.layout.groups]

    # ---- torch-like API ---------------------------------------------------------------------

    # param_groups, state, defaults, state_dict, load_state_dict, add_param_group: TorchOptimizerAPI.

    def __repr__(self) -> str:
        return (
            f"ZeroOptimizer(stage={self.stage}, world_size={self.world_size}, "
            f"optimizer={type(self.optimizer).__name__}, groups={len(self.layout.groups)})"
        )

    @property
    def rank(self) -> int:
        """This rank in ``process_group`` (of all W ranks)."""
        return self.comm.rank

    @property
    def world_size(self) -> int:
        """W: the ranks of ``process_group``."""
        return self.comm.world_size

    def rank_in(self, group: GroupLayout) -> int:
        """This rank's place in the process group ``group`` is partitioned over."""
        return self.comms[group.shard_group].rank

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` divided by the accumulation steps and times the loss scale.

        Collective at stage 2: each bucket's gradient is reduce-scattered over its shard group
        while backward runs, so every rank calls it for every micro-batch.
        At stage 1 it communicates nothing (the reduction waits for :meth:`step`).
        """
        (loss * (self.scaler.scale / self.gradient_accumulation_steps)).backward()

    def step(self, closure: None = None) -> bool:
        """Collective: every rank of ``process_group`` calls it at the same accumulation
        boundary. Update the parameters from the gradients so far: finish the gradient
        reduction (stage 1), agree on overflow (fp16, or a scaler that checks), all-reduce the
        gradient norm (W > 1), step the wrapped optimizer, all-gather the new parameters.
        Returns False, on every rank alike, if the step was skipped: a run that checks for
        overflow found inf/nan gradients on some rank.

        Step pre and post hooks fire on every call, skipped or not, as on torch optimizers.

        Raises:
            ValueError: a ``closure`` is given (before anything is communicated).
            MinimumLossScaleError: a DeepSpeedLossScaler saw an overflow at its minimum scale
                (on every rank alike: the overflow is agreed).
        """
        if closure is not None:
            raise ValueError("ZeroOptimizer.step takes no closure: run forward and engine.backward before it")
        self.reducer.reduce()
        grads = self.reducer.partition_grads
        if self.scaler.scale != 1.0:
            for grad in grads:
                grad.div_(self.scaler.scale)
        # fp16 runs (any scaler) check for inf/nan; bf16/fp32 runs skip the extra all-reduce
        # unless their scaler asks for the check (DeepSpeed's bf16.check_grad_overflow).
        if self._checks_overflow and self._overflow_on_any_rank():
            self.scaler.update(overflow=True)
            self.reducer.zero_grad()
            return False
        self.last_grad_norm = float(self._clip(grads))
        for master, grad, views in zip(self.masters, grads, self.matrices.views):
            grad = grad.to(self.master_device, copy=self.offload)
            if views is None:
                master.grad = grad
            for view in views or ():
                view.param.grad = view.of(grad)
        self.optimizer.step()
        for master, views in zip(self.masters, self.matrices.views):
            master.grad = None
            for view in views or ():
                view.param.grad = None
        self.matrices.adopt(self.optimizer.state)
        self.matrices.agree(self.comm, self.master_device)  # collective, once: the first step with state
        self._write_back_and_gather()
        self.scaler.update(overflow=False)
        self.global_steps += 1
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Not collective. Clear the accumulated gradients (the partitions stay allocated;
        ``set_to_none`` is accepted for torch's signature and changes nothing)."""
        self.reducer.zero_grad()

    def memory_report(self) -> MemoryReport:
        """Not collective. Bytes this rank holds for training state, and what unsharded
        training would hold."""
        return rank_memory(self)

    def export_state(self) -> ShardedState:
        """Not collective. This rank's state as a plain value (CPU copies) for the checkpoint layer."""
        return state_io.export_state(self)

    def state_views(self) -> ShardedState:
        """Not collective. This rank's state as views of the live tensors, valid until the next
        step or load (the Checkpointer copies them into its host snapshot); see
        ``state_io.state_views``."""
        return state_io.state_views(self)

    def import_state(
        self,
        state: ShardedState,
        *,
        load_optimizer_states: bool = True,
        load_module_only: bool = False,
        strict: bool = True,
        take: bool = False,
        weights_from_masters: bool = False,
        params_gathered: bool = False,
        checked: bool = False,
    ) -> None:
        """Collective: every rank of ``process_group`` calls it with its own state. Load a
        state laid out for this engine; see ``state_io.import_state`` (``take=True``: the
        optimizer keeps the state's tensors and the masters its fp32 partitions, not copies;
        ``weights_from_masters=True``: the parameters are the state's fp32 partitions cast, its
        model state holds none; ``params_gathered=True``: and they already hold them, see
        ``start_params_gather``; ``checked=True``: every rank ran :meth:`check_import` and the
        ranks agreed that none raised, so no agreement of its own).

        Raises:
            ValueError: on every rank alike, when any rank's state does not fit (another
                layout, rank or optimizer, or a model state of other shapes, or with
                ``strict`` of other names); nothing changes then.
            CollectiveCallError: the other ranks did not call it.
        """
        state_io.import_state(
            self,
            state,
            load_optimizer_states=load_optimizer_states,
            load_module_only=load_module_only,
            strict=strict,
            take=take,
            weights_from_masters=weights_from_masters,
            params_gathered=params_gathered,
            checked=checked,
        )

    def check_import(
        self,
        state: ShardedState,
        *,
        load_optimizer_states: bool = True,
        load_module_only: bool = False,
        strict: bool = True,
        weights_from_masters: bool = False,
    ) -> None:
        """Not collective: raise the ValueError :meth:`import_state` would refuse this rank's
        ``state`` with; for a caller that agrees on the outcome in a collective of its own
        (a checkpoint load's agreement) and then imports with ``checked=True``."""
        state_io.check_import(
            self,
            state,
            load_optimizer_states=load_optimizer_states,
            load_module_only=load_module_only,
            strict=strict,
            weights_from_masters=weights_from_masters,
        )

    def sync_params_from_masters(self) -> None:
        """Collective: every rank of ``process_group`` calls it. Make the model's parameters
        the fp32 masters cast to their dtype (an all-gather per bucket, over its shard group)."""
        self._write_back_and_gather()

    def start_params_gather(self, group_index: int, partition: torch.Tensor | None = None) -> list[Any]:
        """Collective over layout group ``group_index``'s shard group, asynchronous: write
        ``partition`` (this rank's fp32 partition of the group, shaped as its master; the
        master itself when None) cast to the parameters' dtype into this rank's slices of
        the group's parameter buffer, and start the all-gather of each bucket. Returns the
        handles to wait on; the group's parameters are ``partition`` cast once they are done.
        A checkpoint load gathers the weights so while it reads the optimizer state."""
        buffer, comm = self.buffers[group_index], self.group_comms[group_index]
        source = (self.masters[group_index] if partition is None else partition).detach()
        group, handles = buffer.group, []
        for bucket in group.buckets:
            begin, end, start = group.bucket_slice(bucket.index, comm.rank)
            own = buffer.data[begin:end]
            own.copy_(source[start : start + end - begin])
            sizes = self.reducer.bucket_sizes(group.index, bucket.index)  # None: equal slices
            handles.append(comm.all_gather_into(buffer.bucket_view(bucket.index), own, async_op=True, sizes=sizes))
        return handles

    def own_params(self, group_index: int) -> list[tuple[int, torch.Tensor]]:
        """This rank's slices of layout group ``group_index``'s parameter buffer (the
        parameters' values its fp32 partition makes, which :meth:`start_params_gather`
        writes), each with its offset in the partition, in partition order; together they
        cover the partition. Views, no copy."""
        buffer, comm = self.buffers[group_index], self.group_comms[group_index]
        found = []
        for bucket in buffer.group.buckets:
            begin, end, start = buffer.group.bucket_slice(bucket.index, comm.rank)
            if end > begin:
                found.append((start, buffer.data[begin:end]))
        return sorted(found, key=lambda piece: piece[0])

    # ---- internals ----------------------------------------------------------------------------

    def _torch_param_groups(self) -> list[dict[str, Any]]:
        """Per param group: its options and what its optimizer updates, the fp32 master
        partition of each of its layout groups, or the matrices of an owner group."""
        return [
            {**user.options, "params": [p for g in user.layout_groups for p in self._updated(g)]}
            for user in self.grouping.user_groups
        ]

    def _updated(self, group_index: int) -> list[nn.Parameter]:
        views = self.matrices.views[group_index]
        return [self.masters[group_index]] if views is None else [view.param for view in views]

    def _overflow_on_any_rank(self) -> bool:
        local = torch.zeros(1, device=self.device)
        for grad in self.reducer.partition_grads:
            if not torch.isfinite(grad).all():
                local.fill_(1.0)
        return bool(self.comm.all_reduce_(local, op="max").item())

    def _clip(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Global L2 norm of the gradient (padding is zero, so it adds nothing); clip if asked.

        The norm is taken over per-fragment norms, which at world size 1 are per-parameter
        norms, exactly as torch.nn.utils.clip_grad_norm_ computes it.
        """
        pieces = [
            grad[f.partition_start : f.partition_start + f.length]
            for grad, fragments in zip(grads, self._fragments)
            for f in fragments
        ]
        norms = torch._foreach_norm(pieces, 2.0) if pieces else []
        local = torch.stack(list(norms)) if norms else torch.zeros(1, device=self.device)
        if self.world_size == 1:
            total = torch.linalg.vector_norm(local, 2.0)
        else:
            squared = local.square().sum().reshape(1)
            total = self.comm.all_reduce_(squared, op="sum").sqrt()[0]
        if self.max_grad_norm is not None:
            coefficient = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
            if coefficient.item() != 1.0:  # multiplying by 1.0 would change nothing: skip the pass
                torch._foreach_mul_(grads, coefficient)
        return total

    def _write_back_and_gather(self) -> None:
        handles = [handle for index in range(len(self.buffers)) for handle in self.start_params_gather(index)]
        for handle in handles:
            handle.wait()
