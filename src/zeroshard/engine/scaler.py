"""Loss scaling for fp16: a dynamic scaler with the usual grow / back-off rule."""

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

    def update(self, overflow: bool) -> None:
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
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    @classmethod
    def disabled(cls) -> LossScaler:
        return cls(scale=1.0, dynamic=False)
