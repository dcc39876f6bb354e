"""DeepSpeed's learning-rate schedules as torch lr schedulers, value for value.

DeepSpeed's ``scheduler`` config section names one of its own schedules (WarmupLR,
WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest; deepspeed/runtime/lr_schedules.py).
None of them is a product of torch's built-in schedulers in the same float arithmetic, so
each is a :class:`torch.optim.lr_scheduler.LRScheduler` here that computes DeepSpeed's
formula in DeepSpeed's order of operations: the same lr, bit for bit, at every step
(``tests/test_lr_schedules.py`` runs both side by side). Being torch schedulers they take a
``ZeroOptimizer`` (or any torch optimizer), and ``state_dict`` / ``get_last_lr`` work as usual.

Counting. DeepSpeed calls its counter ``last_batch_iteration`` and starts it at -1: the lrs
set at construction are those of iteration -1, and every ``step()`` (DeepSpeed's
``engine.step`` calls it after each optimizer step that was not skipped) moves to the next
iteration. Here ``last_epoch`` is that counter plus one (torch steps once at construction),
:attr:`DeepSpeedSchedule.last_batch_iteration` gives DeepSpeed's number, and
:meth:`~DeepSpeedSchedule.load_state_dict` also takes DeepSpeed's own state dict
(``{"last_batch_iteration": N}``, what a DeepSpeed checkpoint stores), so a DeepSpeed run's
schedule carries on where it stopped.

Where DeepSpeed only warns, these raise ValueError: an unknown ``warmup_type`` (DeepSpeed
falls back to "log"). OneCycle without ``betas`` in the optimizer's defaults cycles no
momentum, as in DeepSpeed, and says so in :attr:`OneCycle.notes`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch.optim.lr_scheduler import LRScheduler

WARMUP_TYPES = ("log", "linear")
ONE_CYCLE_BETA2 = 0.99  # the second beta DeepSpeed's OneCycle sets, whatever the optimizer had


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[Any]:
    """A scalar for every param group, or a list with one value per group."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{name}: {len(value)} values given, the optimizer has {groups} param groups")
        return list(value)
    return [value] * groups


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _warmup_type(value: Any) -> str:
    if value not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {', '.join(WARMUP_TYPES)}, got {value!r}")
    return value


class DeepSpeedSchedule(LRScheduler):
    """Base of the DeepSpeed schedules: subclasses give :meth:`lrs_at` (and :meth:`betas_at`).

    ``last_batch_iteration`` other than -1 resumes at that iteration the way DeepSpeed does:
    the optimizer's lrs are left as they are until the next :meth:`step`. Not collective.

    Raises:
        ValueError: at construction, naming the argument: a per-group list whose length is
            not the optimizer's number of param groups, a step count that is not a positive
            integer, an unknown ``warmup_type``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        groups = optimizer.param_groups
        before = [(group["lr"], group.get("betas")) for group in groups]
        super().__init__(optimizer)  # steps once: the values of iteration -1
        if last_batch_iteration != -1:
            self.last_epoch = last_batch_iteration + 1
            for group, (lr, betas) in zip(groups, before):
                group["lr"] = lr
                if betas is not None:
                    group["betas"] = betas
            self._last_lr = [lr for lr, _ in before]

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's counter: the iteration whose lrs are set (-1 before the first step)."""
        return self.last_epoch - 1

    def lrs_at(self, iteration: int) -> list[float]:
        """The lr of every param group at ``iteration`` (-1: the values set at construction)."""
        raise NotImplementedError

    def betas_at(self, iteration: int) -> list[tuple[float, float]] | None:
        """The betas of every param group at ``iteration``, or None when the schedule sets none."""
        return None

    def get_lr(self) -> list[float]:
        """The lrs of the current iteration (torch's hook, called by :meth:`step`)."""
        return self.lrs_at(self.last_batch_iteration)

    def step(self, epoch: int | None = None) -> None:
        """Move to the next iteration and set its lrs (and betas) on the optimizer."""
        super().step(epoch)
        betas = self.betas_at(self.last_batch_iteration)
        if betas is not None:
            for group, value in zip(self.optimizer.param_groups, betas):
                group["betas"] = value

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, plus DeepSpeed's ``last_batch_iteration``."""
        return {**super().state_dict(), "last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave, or DeepSpeed's own ``{"last_batch_iteration": N}``
        (the lrs change at the next :meth:`step`, as in DeepSpeed).

        Raises:
            ValueError: ``last_batch_iteration`` is not an integer of at least -1.
        """
        state = dict(state_dict)
        iteration = state.pop("last_batch_iteration", None)
        if iteration is not None and (isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < -1):
            raise ValueError(f"lr scheduler state: last_batch_iteration must be an integer >= -1, got {iteration!r}")
        if state:
            super().load_state_dict(state)
        if iteration is not None:
            self.last_epoch = iteration + 1


class WarmupLR(DeepSpeedSchedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` (default: each group's lr) over
    ``warmup_num_steps`` (at least 2) iterations, log or linear, then constant.
    Arguments as DeepSpeed's; a scalar lr applies to every param group."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [high - low for high, low in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warmup = 1.0 / math.log(self.warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)

    def _warmup_gamma(self, iteration: int) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warmup * math.log(iteration + 1)
        return iteration / self.warmup_num_steps

    def _gamma(self, iteration: int) -> float:
        return self._warmup_gamma(iteration) if iteration < self.warmup_num_steps else 1.0

    def lrs_at(self, iteration: int) -> list[float]:
        """The warmup's lrs: ``warmup_min_lr`` at -1, then ``min + (max - min) * gamma``."""
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then a linear decay to 0 at ``total_num_steps``. As in DeepSpeed,
    ``warmup_max_lr`` defaults to 0.001, not to the groups' lrs."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self._warmup_gamma(iteration)
        remaining = float(self.total_num_steps - iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(DeepSpeedSchedule):
    """Each group's lr times a ratio: from ``warmup_min_ratio`` to 1 over ``warmup_num_steps``
    (log or linear), then a cosine down to ``cos_min_ratio`` at ``total_num_steps``. The
    lr is 0 at construction (iteration -1), as in DeepSpeed."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warmup = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def ratio_at(self, iteration: int) -> float:
        """The factor every group's lr is multiplied by at ``iteration`` (>= 0)."""
        if iteration < self.warmup_num_steps:
            if self.warmup_type == "log":
                ratio = self.inverse_log_warmup * math.log(iteration + 1)
            else:
                ratio = iteration / self.warmup_num_steps
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        since_warmup = iteration - self.warmup_num_steps + 1
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, since_warmup / decay_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs_at(self, iteration: int) -> list[float]:
        """0 at -1 (as in DeepSpeed), then each group's lr times :meth:`ratio_at`."""
        if iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.ratio_at(iteration)
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(DeepSpeedSchedule):
    """DeepSpeed's 1cycle: the lr rises from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` iterations and falls back over ``cycle_second_step_size``
    (optionally in stairs), then decays by ``decay_lr_rate`` every ``decay_step_size``;
    with ``cycle_momentum`` the first beta moves the other way between ``cycle_max_mom``
    and ``cycle_min_mom``, and the second beta is set to 0.99 (DeepSpeed's choice)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (
            self.first_step_size if cycle_second_step_size is None else float(cycle_second_step_size)
        )
        if self.first_step_size <= 0 or self.second_step_size < 0:
            raise ValueError(
                f"cycle_first_step_size must be positive and cycle_second_step_size non-negative, "
                f"got {cycle_first_step_size!r} and {cycle_second_step_size!r}"
            )
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        no_decay_steps = math.isclose(decay_step_size, 0)
        self.decays_lr = not (no_decay_steps or math.isclose(decay_lr_rate, 0))
        self.notes: list[str] = []
        self.cycle_momentum = bool(cycle_momentum) and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            self.notes.append(f"OneCycle cycles no momentum: {type(optimizer).__name__} has no betas (as in DeepSpeed)")
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        self.decay_mom_rate = decay_mom_rate
        self.decays_mom = not (no_decay_steps or math.isclose(decay_mom_rate, 0))
        super().__init__(optimizer, last_batch_iteration)

    def _scale(self, iteration: int) -> float:
        """Where in the cycle ``iteration`` is: 0 at the ends, 1 at the peak."""
        batch = iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        position = 1.0 + batch / self.total_size - cycle
        if position <= self.step_ratio:
            scale, stairs = position / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (position - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # quantised from the integer offset in the cycle, as DeepSpeed does
            offset = batch % self.total_size
            if offset <= self.first_step_size:
                stair = offset * stairs / self.first_step_size
            else:
                stair = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def _decay_interval(self, iteration: int) -> float:
        return (iteration - self.total_size + 1) / self.decay_step_size

    def lrs_at(self, iteration: int) -> list[float]:
        """Up and down the cycle, then ``cycle_min_lr`` decayed (or kept, without a decay)."""
        if iteration < 0:
            return list(self.min_lrs)
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if not self.decays_lr:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_interval(iteration)
        return [low / factor for low in self.min_lrs]

    def betas_at(self, iteration: int) -> list[tuple[float, float]] | None:
        """(first beta, 0.99) per group, the first moving against the lr; None without
        ``cycle_momentum`` (or an optimizer without betas)."""
        if not self.cycle_momentum:
            return None
        if iteration < 0:
            return [(low, ONE_CYCLE_BETA2) for low in self.min_moms]
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [(high - (high - low) * scale, ONE_CYCLE_BETA2) for low, high in zip(self.min_moms, self.max_moms)]
        if not self.decays_mom:
            return [(high, ONE_CYCLE_BETA2) for high in self.max_moms]
        factor = 1 + self.decay_mom_rate * self._decay_interval(iteration)
        return [(high * factor, ONE_CYCLE_BETA2) for high in self.max_moms]


class LRRangeTest(DeepSpeedSchedule):
    """The lr range test: ``lr_range_test_min_lr`` times ``1 + step_rate * (iteration + 1) /
    step_size`` (floored to whole intervals with ``lr_range_test_staircase``)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = lr_range_test_step_rate
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer, last_batch_iteration)

    def lrs_at(self, iteration: int) -> list[float]:
        """``lr_range_test_min_lr`` at -1, then times ``1 + step_rate * interval``."""
        if iteration < 0:
            return list(self.min_lrs)
        interval = float(iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1 + self.step_rate * interval
        return [low * increase for low in self.min_lrs]


SCHEDULES: dict[str, type[DeepSpeedSchedule]] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}
