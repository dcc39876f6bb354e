"""model.safetensors: the module's full state_dict, tied tensors stored once.

Two state_dict names that hold the same view of the same storage (tied embeddings) are one
tensor in the file; the manifest maps the other names to it. Views that merely overlap are
stored separately. Every rank reads the whole file on load, since under ZeRO 1/2 every rank
holds the full module.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Mapping

import torch

from .checksum import FileRecord
from .manifest import ModelTensorRecord, dtype_name
from .safetensors_io import ReadStats, VerifiedRanges, dtype_from_code, read_header, write_safetensors


@dataclass(frozen=True)
class SavedModel:
    record: FileRecord
    tensors: dict[str, ModelTensorRecord]
    aliases: dict[str, str]


def save_model_state(
    path: Path,
    model_state: Mapping[str, torch.Tensor],
    trainable: Collection[str],
    buffer_names: Collection[str] | None,
    block_size: int,
) -> SavedModel:
    stored: list[tuple[str, torch.Tensor]] = []
    aliases: dict[str, str] = {}
    first_name_of: dict[tuple, str] = {}
    tensors: dict[str, ModelTensorRecord] = {}
    for name, tensor in model_state.items():
        kind = (
            "trainable"
            if name in trainable
            else ("other" if buffer_names is None else ("buffer" if name in buffer_names else "frozen"))
        )
        identity = _view_identity(tensor)
        if identity is not None and identity in first_name_of:
            aliases[name] = first_name_of[identity]
            continue
        if identity is not None:
            first_name_of[identity] = name
        stored.append((name, tensor))
        tensors[name] = ModelTensorRecord(tuple(tensor.shape), dtype_name(tensor.dtype), kind)
    record = write_safetensors(path, stored, block_size)
    return SavedModel(record, tensors, aliases)


def _view_identity(tensor: torch.Tensor) -> tuple | None:
    if tensor.numel() == 0:
        return None
    storage = tensor.untyped_storage()
    return (
        tensor.device.type,
        storage.data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
    )


def load_model_state(
    path: Path,
    record: FileRecord,
    expected: Mapping[str, tuple[str, tuple[int, ...]]],
    aliases: Mapping[str, str],
    stats: ReadStats | None = None,
) -> dict[str, torch.Tensor]:
    """Read and verify all of ``path``; tied names come back as the same tensor."""
    entries = read_header(path, record.size, stats)
    check_entries(path, entries, expected)
    data = VerifiedRanges(path, record, [(0, record.size)], stats)
    state = {}
    for name in expected:
        entry = entries[name]
        state[name] = tensor_from_bytes(data.view(entry.begin, entry.end), dtype_from_code(entry.dtype), entry.shape)
    for alias, target in aliases.items():
        state[alias] = state[target]
    return state


def check_entries(path: Path, entries: Mapping, expected: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
    """The file's header must hold exactly the tensors the manifest describes."""
    missing = sorted(set(expected) - set(entries))
    if missing:
        raise ValueError(f"{path}: corrupted or not the manifest's file: tensors {missing} are missing")
    for name, (dtype, shape) in expected.items():
        entry = entries[name]
        found_dtype = dtype_name(dtype_from_code(entry.dtype))
        if found_dtype != dtype or tuple(entry.shape) != tuple(shape):
            raise ValueError(
                f"{path}: tensor {name!r} is {found_dtype} {list(entry.shape)}, the manifest says {dtype} {list(shape)}"
            )
        itemsize = torch.empty(0, dtype=dtype_from_code(entry.dtype)).element_size()
        if entry.end - entry.begin != itemsize * _numel(shape):
            raise ValueError(f"{path}: corrupted: tensor {name!r} spans {entry.end - entry.begin} bytes")


def tensor_from_bytes(data: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A new tensor holding a copy of ``data`` (copied, so it is aligned and owns its memory)."""
    if len(data) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).clone().view(dtype).reshape(shape)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
