"""DeepSpeed ZeRO stage 1/2 checkpoints (AutoEP's among them) read without DeepSpeed or torch.

Each is presented as a :class:`~zeroshard.checkpoint.source.ShardSource`, so universal
conversion, fp32 export and resharded loading work on it unchanged, and the format is a
:class:`~zeroshard.checkpoint.formats.SourceFormat` that ``zeroshard.CHECKPOINT_FORMATS``
lists, so :func:`~zeroshard.checkpoint.formats.open_source` recognises it.

* :func:`open_deepspeed` (:mod:`.opener`): DeepSpeed ZeRO stage 1/2 (docs/DEEPSPEED.md) as a
  :class:`DeepSpeedSource` (:mod:`.source`; files found by :mod:`.paths`, read by
  :mod:`.files` with the checks of :mod:`.fields` and the stand-ins of :mod:`.pickled`; a
  Muon run's groups and momentum by :mod:`.muon`); an
  AutoEP run's as :class:`AutoEPSource` (:mod:`.autoep`), in the transformers model's names
  and layout (:mod:`.autoep_names`; AutoEP's own files: :mod:`.autoep_files`,
  :mod:`.autoep_layout`, :mod:`.autoep_experts`).

May import: the checkpoint layer, ``zeroshard.torchfile`` (every file is a torch.save
archive), ``io``, ``layout``, ``state`` and ``collector``; not the rest of ``zeroshard.deepspeed`` (the
config side), and no torch.
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
