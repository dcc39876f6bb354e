"""Open a DeepSpeed ZeRO stage 1/2 checkpoint as the source that fits it.

:class:`~.source.DeepSpeedSource` reads the files as DeepSpeed laid them out; an AutoEP
run's is presented in the transformers model's names and layout by
:class:`~.autoep.AutoEPSource`, which builds on it. The choice between them is made here,
above both: the module of the source an AutoEP source builds on cannot pick the AutoEP source
without importing what imports it.
"""

from __future__ import annotations

from pathlib import Path

from .autoep import AutoEPSource
from .source import DeepSpeedSource
from .paths import find_tag_dir, refuse_deepspeed_universal


def open_deepspeed(path: str | Path) -> DeepSpeedSource | AutoEPSource:
    """Open a DeepSpeed ZeRO stage 1/2 checkpoint, check its layout, and return a source:
    an AutoEP run's in the transformers model's names and layout (:class:`~.autoep.AutoEPSource`;
    its ``raw`` is DeepSpeed's own). DeepSpeed's own universal format is refused by name
    (UnsupportedCheckpointError)."""
    refuse_deepspeed_universal(path)
    raw = DeepSpeedSource(find_tag_dir(path))
    if raw.autoep is None:
        return raw
    try:
        return AutoEPSource(raw)
    except BaseException:
        raw.close()
        raise
