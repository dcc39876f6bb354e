"""The sharded optimizer: ZeRO stages 1 and 2."""

from .optimizer import ZeroOptimizer
from .scaler import LossScaler

__all__ = ["LossScaler", "ZeroOptimizer"]
