"""Tensor dtypes by name, and the host arrays that stand for tensors in checkpoint files.

Reading and converting checkpoints needs no torch: the converters move bytes and cast fp32,
and ``import torch`` costs more than converting a checkpoint of a few hundred MB. Checkpoint
code that only moves data therefore holds tensors as numpy arrays, with ``ml_dtypes`` for
the dtypes numpy lacks (bfloat16, float8), and names dtypes as torch does ("bfloat16").
:func:`to_torch` and :func:`to_numpy` cross to torch where the engine needs it; torch is
imported there, on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DtypeInfo:
    """One dtype a checkpoint may hold: its torch-style name, safetensors code, numpy dtype."""

    name: str
    code: str
    numpy: np.dtype

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.numpy.itemsize

    @property
    def is_floating_point(self) -> bool:
        """A float type (float8 to float64, bfloat16), as torch's ``is_floating_point``."""
        return self.name.startswith(("float", "bfloat"))


def _info(name: str, code: str, numpy_dtype: Any) -> DtypeInfo:
    return DtypeInfo(name, code, np.dtype(numpy_dtype))


_ALL = (
    _info("float64", "F64", np.float64),
    _info("float32", "F32", np.float32),
    _info("float16", "F16", np.float16),
    _info("bfloat16", "BF16", ml_dtypes.bfloat16),
    _info("int64", "I64", np.int64),
    _info("int32", "I32", np.int32),
    _info("int16", "I16", np.int16),
    _info("int8", "I8", np.int8),
    _info("uint8", "U8", np.uint8),
    _info("uint16", "U16", np.uint16),
    _info("uint32", "U32", np.uint32),
    _info("uint64", "U64", np.uint64),
    _info("bool", "BOOL", np.bool_),
    _info("float8_e4m3fn", "F8_E4M3", ml_dtypes.float8_e4m3fn),
    _info("float8_e5m2", "F8_E5M2", ml_dtypes.float8_e5m2),
)
_NOT_IN_NUMPY = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})  # ml_dtypes has them; torch.from_numpy not
_BY_NAME = {info.name: info for info in _ALL}
_BY_CODE = {info.code: info for info in _ALL}
_BY_NUMPY = {info.numpy: info for info in _ALL}


def dtype_info(name: object) -> DtypeInfo:
    """The dtype called ``name`` ("bfloat16", or a torch.dtype); ValueError if unknown."""
    key = str(name).removeprefix("torch.")
    info = _BY_NAME.get(key)
    if info is None:
        raise ValueError(f"unknown dtype {name!r}")
    return info


def dtype_of_code(code: str) -> DtypeInfo:
    """The dtype of a safetensors dtype code ("BF16"); ValueError if unknown."""
    info = _BY_CODE.get(code)
    if info is None:
        raise ValueError(f"unknown safetensors dtype {code!r}")
    return info


def dtype_of(array: np.ndarray | torch.Tensor) -> DtypeInfo:
    """The dtype of a numpy array or a torch tensor; ValueError for one no checkpoint holds."""
    if isinstance(array, np.ndarray):
        info = _BY_NUMPY.get(array.dtype)
        if info is None:
            raise ValueError(f"dtype {array.dtype} cannot be stored in a checkpoint")
        return info
    return dtype_info(array.dtype)


def itemsize_of(name: str) -> int:
    """Bytes per element of the dtype called ``name``; ValueError if unknown."""
    return dtype_info(name).itemsize


def from_bytes(data: Any, name: str) -> np.ndarray:
    """A 1-D array of dtype ``name`` over the bytes in ``data`` (shared, not copied)."""
    return np.frombuffer(data, dtype=dtype_info(name).numpy)


def to_float32(array: np.ndarray) -> np.ndarray:
    """``array`` as float32: a new array, or ``array`` itself when it is float32 already."""
    return array if array.dtype == np.float32 else array.astype(np.float32)


def cast(array: np.ndarray, name: str) -> np.ndarray:
    """``array`` cast to dtype ``name``, rounding to nearest even as torch's ``.to`` does
    (NaN payloads aside); ``array`` itself when it has that dtype already."""
    target = dtype_info(name).numpy
    if array.dtype == target:
        return array
    with np.errstate(over="ignore", invalid="ignore"):  # overflow gives inf, as in torch
        return array.astype(target)


def to_torch(array: np.ndarray) -> torch.Tensor:
    """A contiguous torch tensor sharing ``array``'s memory (a copy first if ``array`` is
    read-only or not C-contiguous)."""
    import torch

    info = dtype_of(array)
    if not (array.flags.writeable and array.flags.c_contiguous):
        array = array.copy(order="C")
    # Built flat and reshaped in torch, so the strides are torch's own (numpy may give a
    # size-1 dimension any stride, which some torch views refuse).
    flat = array.reshape(-1)
    if info.name in _NOT_IN_NUMPY:
        # bfloat16 and float8: torch cannot take these numpy dtypes; pass the raw bits (as a
        # signed integer of the same size, which torch has for every width) and view them.
        tensor = torch.from_numpy(flat.view(np.dtype(f"i{info.itemsize}"))).view(getattr(torch, info.name))
    else:
        tensor = torch.from_numpy(flat)
    return tensor.reshape(array.shape)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array sharing a CPU tensor's memory (contiguous first if it is not)."""
    import torch

    info = dtype_of(tensor)
    tensor = tensor.detach().cpu().contiguous()
    if info.name in _NOT_IN_NUMPY:
        signed = getattr(torch, f"int{8 * info.itemsize}")
        return tensor.view(signed).numpy().view(info.numpy)
    return tensor.numpy()


def torch_dtype(name: str) -> torch.dtype:
    """torch's dtype called ``name`` (imports torch)."""
    import torch

    return getattr(torch, dtype_info(name).name)


def as_array(value: np.ndarray | torch.Tensor) -> np.ndarray:
    """``value`` as a numpy array: itself, or a CPU tensor's memory."""
    return value if isinstance(value, np.ndarray) else to_numpy(value)


def arrays_to_torch(value: Any) -> Any:
    """``value`` with every numpy array in it (through dicts, lists and tuples) a torch tensor."""
    if isinstance(value, np.ndarray):
        return to_torch(value)
    if isinstance(value, dict):
        return {key: arrays_to_torch(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(arrays_to_torch(item) for item in value)
    return value
