"""The sharded optimizer: ZeRO stages 1 and 2.

Owns :class:`ZeroOptimizer` (:mod:`.optimizer`) and its parts: torch param groups to layout
groups (:mod:`.grouping`), the set-up of collectives, layout and initial values
(:mod:`.setup`), gradient hooks and bucketed reduction (:mod:`.gradients`,
:mod:`.bucket_pool`), loss scaling (:mod:`.scaler`), per-parameter access
(:mod:`.fragments`), torch's optimizer surface (:mod:`.torch_api`), the state exported and
imported as a ShardedState (:mod:`.state_io`) or in torch's state_dict form
(:mod:`.shard_state`), the memory report (:mod:`.memory`), what those helpers use of the
engine (:mod:`.parts`), and a probe of its peak gradient memory (:mod:`.probe`).

May import: ``zeroshard.layout``, ``state``, ``buffers`` and ``comm``; not ``moe`` (an expert
group is a param group with ``"expert": True``) nor the checkpoint layer, which drives the
engine through its public methods.
"""

from .optimizer import ZeroOptimizer
from .scaler import DeepSpeedLossScaler, LossScaler, MinimumLossScaleError

__all__ = ["DeepSpeedLossScaler", "LossScaler", "MinimumLossScaleError", "ZeroOptimizer"]
