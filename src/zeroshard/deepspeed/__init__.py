"""DeepSpeed users' way in: a DeepSpeed config to a zeroshard run, and DeepSpeed's checkpoints read.

Owns :func:`~.config.from_deepspeed_config` (:mod:`.config`: a DeepSpeed config to a
:class:`~.config.DeepSpeedRun`; :mod:`.plan`: the config read and checked before anything is
built; :mod:`.keys`: every config key, mapped, no-op or refused; :mod:`.values`: one value
read and checked; :mod:`.optimizer`: the torch optimizer a config names;
:mod:`.lr_schedules`: DeepSpeed's schedules as torch schedulers) and the readers of DeepSpeed
ZeRO-1/2 and AutoEP checkpoints (:mod:`.checkpoint`).

May import: the engine, the checkpoint layer and everything below them (``zeroshard.io``,
``zeroshard.torchfile``, ``zeroshard.layout``, ...); nothing above imports it but the trainer
integrations, the demos and the CLI. Its exports are imported on first use, so reading a
DeepSpeed checkpoint (:mod:`.checkpoint`) imports no torch.
"""

from __future__ import annotations

from ..lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "from_deepspeed_config": ".config",
        "DeepSpeedRun": ".config",
    },
)

__all__ = ["DeepSpeedRun", "from_deepspeed_config"]
