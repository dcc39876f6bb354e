"""Readers for checkpoints written by other ZeRO implementations.

Each presents its checkpoint as a :class:`~zeroshard.checkpoint.source.ShardSource`, so
universal conversion, fp32 export and resharded loading work on it unchanged, and each is a
:class:`~zeroshard.checkpoint.formats.SourceFormat` that ``zeroshard.CHECKPOINT_FORMATS``
lists, so :func:`~zeroshard.checkpoint.formats.open_source` recognises it.

* :func:`open_deepspeed`: DeepSpeed ZeRO stage 1/2 (docs/DEEPSPEED.md); an AutoEP run's as
  :class:`AutoEPSource`, in the transformers model's names and layout.
"""

from ...checkpoint.formats import SourceFormat
from .autoep import AutoEPSource
from .source import DeepSpeedSource
from .paths import find_tag_dir, is_deepspeed_checkpoint, is_deepspeed_universal, recognise_deepspeed
from .pickled import ALLOWED_GLOBALS, DeepSpeedFormatError
from .opener import open_deepspeed

# Recognises DeepSpeed's own universal format too, so that opening it refuses it by name.
DEEPSPEED_FORMAT = SourceFormat("deepspeed", recognise_deepspeed, open_deepspeed, "DeepSpeed ZeRO stage 1/2 checkpoint")

__all__ = [
    "ALLOWED_GLOBALS",
    "AutoEPSource",
    "DEEPSPEED_FORMAT",
    "DeepSpeedFormatError",
    "DeepSpeedSource",
    "find_tag_dir",
    "is_deepspeed_checkpoint",
    "is_deepspeed_universal",
    "open_deepspeed",
]
