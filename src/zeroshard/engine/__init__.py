"""The sharded optimizer: ZeRO stages 1 and 2."""

from .optimizer import ZeroOptimizer
from .scaler import DeepSpeedLossScaler, LossScaler, MinimumLossScaleError

__all__ = ["DeepSpeedLossScaler", "LossScaler", "MinimumLossScaleError", "ZeroOptimizer"]
