"""A DeepSpeed config in, a zeroshard run out: :func:`from_deepspeed_config`.

    from zeroshard import from_deepspeed_config

    run = from_deepspeed_config(model, "ds_config.json", param_groups=groups)  # collective
    ckpt = run.checkpointer("runs/ckpt")          # Checkpointer with the run's scheduler
    start = ckpt.load()
    for step in range(start, total):
        for micro_batch in batches(run.batch.micro_batch_size, run.batch.gradient_accumulation_steps):
            run.engine.backward(model(*micro_batch))
        run.step()                                # engine.step, scheduler.step, zero_grad: DeepSpeed's engine.step

Every key of the config is mapped, accepted as a no-op or refused, by the table in
:mod:`zeroshard.deepspeed.keys`; docs/MIGRATING.md lists it. What DeepSpeed does with a key
left out, this does too (its defaults: hysteresis 2, communication in the parameter dtype,
bf16 overflow checks on, ...).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from .plan import BatchSizes, Plan, plan_run, positive, resolve_batch_sizes  # noqa: F401  (re-exported)
from ..engine import ZeroOptimizer

log = logging.getLogger(__name__)

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CheckpointSettings:
    """What the run's :class:`~zeroshard.checkpoint.Checkpointer` is built with. DeepSpeed
    keeps every checkpoint, so ``keep_last`` is None; saves run in the background (the same
    bytes as a synchronous save)."""

    keep_last: int | None = None
    async_save: bool = True


@dataclass
class DeepSpeedRun:
    """What :func:`from_deepspeed_config` built. ``engine`` is a torch optimizer too: step
    it (or :meth:`step`), not ``optimizer``, which is the torch optimizer it wraps over this
    rank's partitions. ``ignored`` holds the accepted no-op keys of the config and why each
    changes nothing; ``notes`` what differs from DeepSpeed in rounding only."""

    engine: ZeroOptimizer
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    checkpoint: CheckpointSettings
    batch: BatchSizes
    ignored: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def step(self) -> bool:
        """Collective. DeepSpeed's ``engine.step()`` at an accumulation boundary: the
        optimizer step, then the lr scheduler's step unless the step was skipped (an fp16
        overflow, or inf/nan gradients with ``bf16.check_grad_overflow``), then ``zero_grad``.
        Returns False when the step was skipped on every rank.

        Raises:
            MinimumLossScaleError: fp16 gradients overflowed at ``fp16.min_loss_scale``.
        """
        stepped = self.engine.step()
        if stepped and self.scheduler is not None:
            self.scheduler.step()
        self.engine.zero_grad()
        return stepped

    def checkpointer(self, root: str | os.PathLike[str], **options: Any):
        """Collective: every rank calls it (a Checkpointer's construction is collective). A
        :class:`~zeroshard.checkpoint.Checkpointer` over ``root`` with the run's scheduler and
        :attr:`checkpoint` settings (``options`` override them).

        Raises:
            ValueError: as the Checkpointer's constructor (a bad option; a root that holds a
                checkpoint of another kind).
        """
        from ..checkpoint import Checkpointer

        settings = {"keep_last": self.checkpoint.keep_last, "async_save": self.checkpoint.async_save, **options}
        return Checkpointer(self.engine, root, lr_scheduler=self.scheduler, **settings)


def from_deepspeed_config(
    model: nn.Module,
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    param_groups: Iterable[Any] | None = None,
    optimizer_class: type[torch.optim.Optimizer] | None = None,
    process_group: Any = None,
    expert_process_group: Any = None,
    device: torch.device | str | None = "auto",
    **engine_options: Any,
) -> DeepSpeedRun:
    """Build the ZeroOptimizer, torch optimizer, lr scheduler and Checkpointer settings a
    DeepSpeed config names, as ``deepspeed.initialize`` would.

    Collective (it builds a ZeroOptimizer): every rank calls it with the same config. The
    config is read and checked on every rank and the ranks agree before anything is built,
    so a refused config raises the same error on every rank.

    Args:
        model: the module; like DeepSpeed, its floating-point parameters (frozen ones too)
            are cast to the bf16 / fp16 dtype the config enables, buffers keep theirs.
        config: a DeepSpeed config dict, or the path of its JSON file.
        param_groups: DeepSpeed's ``model_parameters`` (param groups with per-group options);
            None: every trainable parameter. With ``"optimizer": {"type": "Muon"}`` each is
            split as DeepSpeed splits it (:mod:`zeroshard.deepspeed.muon`): its matrices on
            ``torch.optim.Muon``, the rest on torch's AdamW.
        optimizer_class: a torch optimizer class for a config without an ``optimizer``
            section (DeepSpeed's client optimizer); its options come from ``engine_options``.
        process_group, expert_process_group: as for :class:`~zeroshard.engine.ZeroOptimizer`.
        device: "auto" moves the model to ``cuda:LOCAL_RANK`` when CUDA is available, as
            DeepSpeed does; None leaves it where it is; or a device to move it to.
        **engine_options: ZeroOptimizer arguments that override what the config maps (for
            example ``reduce_dtype=torch.float32``), or the client optimizer's options.

    Returns:
        a :class:`DeepSpeedRun`.

    Raises:
        ValueError: one line naming every refused key and why (features zeroshard does not
            have, values it cannot honour or of another type than the key takes, batch sizes
            that do not add up, unknown keys), on every rank alike, before the model is
            touched; a config file that is not a regular file (a FIFO is never waited on),
            holds more than 16 MiB, nests deeper than 100 levels or is not JSON; or as
            :class:`~zeroshard.engine.ZeroOptimizer` once it is built.
        FileNotFoundError: ``config`` is a path that does not exist.
        CollectiveCallError: the other ranks did not call it.
    """
    from ..comm import Collectives

    comm = Collectives(process_group)
    plan: Plan = comm.checked("from_deepspeed_config", lambda: plan_run(config, comm.world_size, optimizer_class))
    _check_expert_parallel(plan.values, comm.world_size, expert_process_group)
    _place(model, plan.dtype, device)
    options = {**plan.engine_options, **engine_options}
    if plan.muon is not None:  # DeepSpeed's Muon: its groups, split by the parameters' shapes and names
        param_groups = plan.muon.param_groups(model, param_groups)
    engine = ZeroOptimizer(
        model,
        plan.optimizer_class,
        param_groups,
        process_group=process_group,
        expert_process_group=expert_process_group,
        **options,
    )
    scheduler = plan.schedule(engine, **plan.schedule_params) if plan.schedule is not None else None
    notes = list(plan.notes) + list(getattr(scheduler, "notes", []))
    if engine.rank == 0 and plan.ignored:  # a warning: Python prints those even where logging is not configured
        log.warning(
            "DeepSpeed config: %d key(s) change nothing in zeroshard (run.ignored says why): %s",
            len(plan.ignored),
            ", ".join(plan.ignored),
        )
    return DeepSpeedRun(engine, engine.optimizer, scheduler, CheckpointSettings(), plan.batch, plan.ignored, notes)


def _check_expert_parallel(values: Mapping[str, Any], world_size: int, expert_process_group: Any) -> None:
    if values.get("expert_parallel.enabled") is not True:
        return
    if expert_process_group is None:
        raise ValueError(
            "DeepSpeed config refused: expert_parallel.enabled = True: zeroshard does not rewrite MoE layers (AutoEP); "
            "build the model with zeroshard.moe and pass expert_process_group= and its expert param groups"
        )
    ep_size = values.get("expert_parallel.autoep_size")
    if ep_size is not None:
        import torch.distributed as dist

        expert_dp = dist.get_world_size(expert_process_group)
        if expert_dp * positive(ep_size, "expert_parallel.autoep_size") != world_size:
            raise ValueError(
                f"DeepSpeed config refused: expert_parallel.autoep_size = {ep_size}: the expert_process_group has "
                f"{expert_dp} ranks, not world size {world_size} / {ep_size}"
            )


def _place(model: nn.Module, dtype: torch.dtype | None, device: torch.device | str | None) -> None:
    """Cast every floating-point parameter (frozen ones too) to ``dtype`` and move the model,
    as DeepSpeed's engine does; buffers keep their dtype."""
    if dtype is not None:
        for param in model.parameters():
            if param.dtype in _CASTABLE and param.dtype != dtype:
                param.data = param.data.to(dtype)
    if device == "auto":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else None
    if device is not None:
        model.to(device)
