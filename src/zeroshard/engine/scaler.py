"""Loss scaling for fp16: a dynamic scaler with the usual grow / back-off rule, and
DeepSpeed's variant of it (hysteresis, its growth count) for runs set up from a DeepSpeed config."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class LossScaler:
    """Multiplies the loss by ``scale``; halves it on overflow, doubles it after
    ``growth_interval`` clean steps. A static scaler has ``dynamic=False``.

    The scale stays a power of two, so scaling and unscaling gradients is exact.
    """

    scale: float = 2.0**16
    dynamic: bool = True
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0
    clean_steps: int = 0
    skipped_steps: int = 0

    @property
    def checks_overflow(self) -> bool:
        """Whether the engine checks the gradients for inf/nan and skips such steps (a dynamic
        scaler must; fp16 parameters always do)."""
        return self.dynamic

    def update(self, overflow: bool) -> None:
        """Record one step's outcome (``overflow``: skipped) and grow or back off the scale."""
        if overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            if self.dynamic:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.clean_steps += 1
        if self.dynamic and self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        """Every field, as plain values."""
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Set the fields ``state`` holds (as :meth:`state_dict` gave them)."""
        for key, value in state.items():
            setattr(self, key, value)

    @classmethod
    def disabled(cls) -> LossScaler:
        """A scale of 1 that never changes: bf16 and fp32 runs."""
        return cls(scale=1.0, dynamic=False)


# DeepSpeed's names for the fields of its loss scalers (deepspeed/runtime/fp16/loss_scaler.py),
# as a DeepSpeed checkpoint stores them, and ours.
_DEEPSPEED_FIELDS = {
    "cur_scale": "scale",
    "cur_iter": "iteration",
    "last_overflow_iter": "last_overflow_iteration",
    "cur_hysteresis": "hysteresis_left",
    "delayed_shift": "hysteresis",
    "scale_window": "growth_interval",
    "min_scale": "min_scale",
    "consecutive_hysteresis": "consecutive_hysteresis",
    "raise_error_at_min_scale": "raise_at_min_scale",
    "dynamic": "dynamic",
}


class MinimumLossScaleError(RuntimeError):
    """fp16 gradients overflowed at the minimum loss scale (DeepSpeed stops the run there too)."""


@dataclass
class DeepSpeedLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scaling, step for step, for runs configured from a DeepSpeed
    config (``zeroshard.from_deepspeed_config``). It differs from :class:`LossScaler` in four ways:

    * hysteresis: an overflow first uses up one of ``hysteresis`` tolerated overflows
      (DeepSpeed's ``fp16.hysteresis``, default 2); the scale backs off only at the last one.
      The count refills when the scale grows, or after every clean step with
      ``consecutive_hysteresis``;
    * growth counts steps since the last overflow the way DeepSpeed does: the scale doubles
      when ``growth_interval`` clean steps have passed since the last overflow, but the
      first time only after ``growth_interval + 1`` steps from the start of the run;
    * the scale backs off by dividing by ``growth_factor`` (DeepSpeed has one ``scale_factor``);
    * an overflow at ``min_scale`` raises :class:`MinimumLossScaleError` when
      ``raise_at_min_scale`` (DeepSpeed always does), instead of skipping on at ``min_scale``.

    ``check_overflow`` makes a static scale skip steps whose gradients hold inf/nan too
    (DeepSpeed's ``bf16.check_grad_overflow``, on by default). :meth:`load_state_dict` also
    takes the fields of DeepSpeed's own scalers (``cur_scale``, ``cur_iter``, ...), as a
    DeepSpeed checkpoint holds them, so a resumed run keeps its scale.
    """

    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    raise_at_min_scale: bool = True
    check_overflow: bool = True
    iteration: int = 0
    last_overflow_iteration: int = -1
    hysteresis_left: int | None = None  # overflows still tolerated; starts at ``hysteresis``

    def __post_init__(self) -> None:
        if self.hysteresis_left is None:
            self.hysteresis_left = self.hysteresis

    @property
    def checks_overflow(self) -> bool:
        """Whether the engine checks for inf/nan: dynamic scaling, or ``check_overflow``."""
        return self.dynamic or self.check_overflow

    def update(self, overflow: bool) -> None:
        """Record one step's outcome with DeepSpeed's rule (see the class docstring).

        Raises:
            MinimumLossScaleError: an overflow at ``min_scale`` with ``raise_at_min_scale``.
        """
        if overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            if self.dynamic:
                self._back_off()
            self.last_overflow_iteration = self.iteration
        else:
            self.clean_steps += 1
            if self.dynamic:
                self._maybe_grow()
        self.iteration += 1

    def _back_off(self) -> None:
        if self.hysteresis != 1 and self.hysteresis_left != 1:
            self.hysteresis_left -= 1
            return
        if self.scale == self.min_scale and self.raise_at_min_scale:
            raise MinimumLossScaleError(
                f"fp16 gradients overflowed at the minimum loss scale {self.min_scale:g} "
                f"(step {self.iteration}); DeepSpeed stops here too: lower the lr or train in bf16"
            )
        self.scale = max(self.scale / self.growth_factor, self.min_scale)  # DeepSpeed's one scale_factor

    def _maybe_grow(self) -> None:
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        stable_steps = self.iteration - self.last_overflow_iteration - 1
        if stable_steps > 0 and stable_steps % self.growth_interval == 0:
            if not self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            self.scale *= self.growth_factor

    def load_state_dict(self, state: dict) -> None:
        """Set the fields ``state`` holds: ours (:meth:`state_dict`), or DeepSpeed's names."""
        ours = {_DEEPSPEED_FIELDS.get(key, key): value for key, value in state.items()}
        if "scale_factor" in ours:  # DeepSpeed grows and backs off by one factor
            ours["growth_factor"] = ours.pop("scale_factor")
        ours = {key: value for key, value in ours.items() if key in self.state_dict()}
        super().load_state_dict(ours)
