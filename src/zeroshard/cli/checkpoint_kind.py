"""Which kind of checkpoint a path holds, from file names alone (nothing is parsed here).

The kinds the tools read: a native zeroshard checkpoint (a tag directory, or a root whose
``latest`` names one), a zeroshard universal checkpoint, and a DeepSpeed ZeRO-1/2 checkpoint
(a tag folder, or its parent with ``latest``). DeepSpeed's own universal format (the output
of ``ds_to_universal``) is recognised only to refuse it by name: it also holds a
``mp_rank_00_model_states.pt``, so it would otherwise be misread as a DeepSpeed checkpoint
with its optimizer files missing.
"""

from __future__ import annotations

import enum
from pathlib import Path

from ..checkpoint.format import LATEST_FILE, MANIFEST_FILE
from ..checkpoint.universal_format import is_universal_checkpoint

DEEPSPEED_UNIVERSAL_LATEST = "latest_universal"  # ds_to_universal writes it next to its output
_DEEPSPEED_UNIVERSAL_DIR = "zero"  # <output>/zero/<parameter>/fp32.pt, exp_avg.pt, ...


class Kind(enum.Enum):
    NATIVE = "zeroshard checkpoint"
    UNIVERSAL = "zeroshard universal checkpoint"
    DEEPSPEED = "DeepSpeed ZeRO stage 1/2 checkpoint"
    DEEPSPEED_UNIVERSAL = "DeepSpeed universal checkpoint"


def detect(path: Path) -> Kind:
    """The kind of checkpoint at ``path``. NATIVE when nothing else fits: opening it as one
    then says precisely what is missing."""
    if is_universal_checkpoint(path):
        return Kind.UNIVERSAL
    if (path / MANIFEST_FILE).is_file():
        return Kind.NATIVE
    if is_deepspeed_universal(path):
        return Kind.DEEPSPEED_UNIVERSAL
    if _looks_deepspeed(path):
        return Kind.DEEPSPEED
    return Kind.NATIVE


def _looks_deepspeed(path: Path) -> bool:
    """A DeepSpeed tag folder (or its parent with ``latest``) with its model-states file, or
    with optimizer files only: opening it then names the missing model-states file."""
    from ..importers import find_tag_dir, is_deepspeed_checkpoint

    if is_deepspeed_checkpoint(path):
        return True
    try:
        tag_dir = find_tag_dir(path)
    except (OSError, ValueError):
        return False
    return any(tag_dir.glob("*zero_pp_rank_*_optim_states.pt"))


def is_deepspeed_universal(path: Path) -> bool:
    """Whether ``path`` is a ``ds_to_universal`` output folder, or the root whose
    ``latest_universal`` names one (and that has no ``latest`` of its own)."""
    if (path / _DEEPSPEED_UNIVERSAL_DIR).is_dir():
        zero = path / _DEEPSPEED_UNIVERSAL_DIR
        return (zero / "optimizer_state.pt").is_file() or any((entry / "fp32.pt").is_file() for entry in zero.iterdir())
    return (path / DEEPSPEED_UNIVERSAL_LATEST).is_file() and not (path / LATEST_FILE).exists()


def refuse_unreadable_kinds(path: Path) -> None:
    """ValueError in one line when ``path`` is a kind the tools recognise but do not read."""
    if detect(path) is Kind.DEEPSPEED_UNIVERSAL:
        raise ValueError(
            f"{path}: a DeepSpeed universal checkpoint (ds_to_universal output), which zeroshard does not read; "
            "use the DeepSpeed ZeRO checkpoint it was made from (the folder with *zero_pp_rank_*_optim_states.pt)"
        )
