"""Load DeepSpeed's pickled checkpoint files without unpickling arbitrary objects, or torch.

Every file is read with :func:`~...torchfile.torch_file.load_torch_file`: a restricted unpickler, the
rule ``torch.load(weights_only=True)`` applies (only tensors, containers, plain values and
explicitly allowed globals are built), without importing torch, whose import costs more
than converting a checkpoint of a few hundred MB. DeepSpeed's ZeRO-1/2 optimizer files need
three globals besides torch's tensor rebuilders: ``ZeroStageEnum``, ``fragment_address`` and
the loss scaler. We allow stand-ins defined here under DeepSpeed's exact names, so no
DeepSpeed code runs and DeepSpeed need not be installed. The unpickler only calls an allowed
class (``ZeroStageEnum(2)``), creates an instance of one without running ``__init__`` and
fills its ``__dict__`` (charged to the file's budget): the stand-ins hold data and have no
behaviour a file could trigger. ``ZeroStageEnum``'s members are shared by the process, so
they refuse that filling. Tensors come back as lazy :class:`~...torchfile.torch_file.StoredTensor` records.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any

from ...io.budget import Budget, quoted
from ...torchfile.torch_file import TorchFileError, read_torch_file
from ...torchfile.torch_records import fills_state, refuses_state


class DeepSpeedFormatError(ValueError):
    """A DeepSpeed checkpoint is missing, damaged, inconsistent or of an unsupported kind."""


@refuses_state  # its members are shared by the whole process: a file must not set their attributes
class ZeroStageEnum(int, enum.Enum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (same values)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


@fills_state
@dataclasses.dataclass(repr=False)
class FragmentAddress:
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address``: a run of ``numel``
    elements starting at ``start`` in a rank's partition."""

    numel: int
    start: int

    def __repr__(self) -> str:  # what a file put there, by type unless short: a chain of them would print forever
        fields = vars(self)
        return f"FragmentAddress(numel={quoted(fields.get('numel'))}, start={quoted(fields.get('start'))})"


@fills_state
class LossScaler:
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler``; attributes come from
    the file (``cur_scale``, ``dynamic``)."""


@fills_state
class DynamicLossScaler(LossScaler):
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler`` (fp16 runs)."""


ALLOWED_GLOBALS: dict[str, type] = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageEnum,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScaler,
}


def load_checkpoint_file(path: Path) -> tuple[dict[str, Any], bytes, Budget]:
    """One DeepSpeed ``.pt`` file as plain values with lazy tensors (opening a file costs its
    pickle, not its tensors), the bytes of its pickle, and the file's budget (what reading it
    costs, charged on by the caller).

    Raises DeepSpeedFormatError with the file name and a one-line cause.
    """
    try:
        loaded = read_torch_file(path, allowed=ALLOWED_GLOBALS)
    except TorchFileError as err:
        raise DeepSpeedFormatError(str(err)) from None
    if not isinstance(loaded.value, dict):
        raise DeepSpeedFormatError(f"{path}: expected a dict at the top level, found {type(loaded.value).__name__}")
    return loaded.value, loaded.pickle, loaded.budget
