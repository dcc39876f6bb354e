"""Load DeepSpeed's pickled checkpoint files without unpickling arbitrary objects.

Every file is read with ``torch.load(weights_only=True)``, whose unpickler builds only
tensors, containers and plain values plus the globals explicitly allowed. DeepSpeed's
ZeRO-1/2 optimizer files need three more: ``ZeroStageEnum``, ``fragment_address`` and the
loss scaler. We allow stand-ins defined here under DeepSpeed's exact names, so no DeepSpeed
code runs and DeepSpeed need not be installed. The unpickler only calls an allowed class
(``ZeroStageEnum(2)``), creates an instance of one without running ``__init__`` and fills its
``__dict__``: the stand-ins hold data and have no behaviour a file could trigger.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch


class DeepSpeedFormatError(ValueError):
    """A DeepSpeed checkpoint is missing, damaged, inconsistent or of an unsupported kind."""


class ZeroStageEnum(int, enum.Enum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (same values)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


@dataclasses.dataclass
class FragmentAddress:
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address``: a run of ``numel``
    elements starting at ``start`` in a rank's partition."""

    numel: int
    start: int


class LossScaler:
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler``; attributes come from
    the file (``cur_scale``, ``dynamic``)."""


class DynamicLossScaler(LossScaler):
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler`` (fp16 runs)."""


ALLOWED_GLOBALS: tuple[tuple[type, str], ...] = (
    (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
)


def load_checkpoint_file(path: Path) -> dict[str, Any]:
    """One DeepSpeed ``.pt`` file as plain values; tensors are memory-mapped where the file
    allows it, so opening a file costs its pickle, not its tensors.

    Raises DeepSpeedFormatError with the file name and a one-line cause.
    """
    if not path.is_file():
        raise DeepSpeedFormatError(f"{path}: file is missing")
    try:
        loaded = _load(path, mmap=True)
    except RuntimeError as err:
        if "mmap" not in str(err):
            raise DeepSpeedFormatError(f"{path}: cannot be read: {_first_line(err)}") from None
        loaded = _load(path, mmap=False)  # the legacy (non-zip) format cannot be mapped
    if not isinstance(loaded, dict):
        raise DeepSpeedFormatError(f"{path}: expected a dict at the top level, found {type(loaded).__name__}")
    return loaded


def _load(path: Path, *, mmap: bool) -> Any:
    try:
        with torch.serialization.safe_globals(list(ALLOWED_GLOBALS)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        cause = _unpickler_cause(err)
        if any(word in cause for word in _REFUSAL_WORDS):
            raise DeepSpeedFormatError(f"{path}: refused to unpickle: {cause}") from None
        raise DeepSpeedFormatError(f"{path}: truncated or corrupt: {cause}") from None
    except (EOFError, zipfile.BadZipFile, OSError) as err:
        raise DeepSpeedFormatError(f"{path}: truncated or corrupt: {_first_line(err)}") from None
    except RuntimeError as err:
        if mmap and "mmap" in str(err):
            raise
        raise DeepSpeedFormatError(f"{path}: truncated or corrupt: {_first_line(err)}") from None


# Words in torch's weights-only refusals (as opposed to malformed pickle streams).
_REFUSAL_WORDS = ("global", "allowlist", "reduce for", "Can only")


def _unpickler_cause(err: BaseException) -> str:
    """The part of torch's weights-only error that says what went wrong, on one line
    (the rest is generic advice, including advice to drop weights_only, which we never do)."""
    text = str(err)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1].split("Check the documentation", 1)[0]
    return _first_sentence(text) or type(err).__name__


def _first_line(err: BaseException) -> str:
    return _first_sentence(str(err)) or type(err).__name__


def _first_sentence(text: str) -> str:
    flat = " ".join(text.split())
    return flat.split(". ", 1)[0].rstrip(".")
