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

from ...io.digest import RunningDigest
from ...io.checksum import FileRecord
from ...io.dtypes import dtype_of_code, torch_dtype
from .manifest import ModelTensorRecord, dtype_name
from ...io.safetensors_io import ReadStats, VerifiedRanges, check_entries, read_header, write_safetensors


@dataclass(frozen=True)
class SavedModel:
    """What writing model.safetensors produced, for the manifest: the file's block checksums,
    the stored tensors' records, the aliases of tied names and each stored tensor's digest."""

    record: FileRecord
    tensors: dict[str, ModelTensorRecord]
    aliases: dict[str, str]
    digests: dict[str, int]  # stored name -> digest of its bytes (computed while writing)


def save_model_state(
    path: Path,
    model_state: Mapping[str, torch.Tensor],
    trainable: Collection[str],
    buffer_names: Collection[str] | None,
    block_size: int,
) -> SavedModel:
    """Write ``model_state`` (a module's full state_dict) to ``path``, tied tensors stored once,
    and fsync it. Each tensor's kind: "trainable" if its name is in ``trainable``, else
    "buffer" or "frozen" by ``buffer_names`` ("other" when that is None). Not collective:
    rank 0 calls it.

    Raises:
        ValueError: a name safetensors cannot hold, or a dtype no checkpoint stores.
    """
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
    digesters = {name: RunningDigest() for name, _ in stored}
    record = write_safetensors(path, stored, block_size, observers=digesters)
    return SavedModel(record, tensors, aliases, {name: digester.value for name, digester in digesters.items()})


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
        state[name] = tensor_from_bytes(data.view(entry.begin, entry.end), torch_dtype(dtype_of_code(entry.dtype).name), entry.shape)
    for alias, target in aliases.items():
        state[alias] = state[target]
    return state


def tensor_from_bytes(data: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A new tensor holding a copy of ``data`` (copied, so it is aligned and owns its memory)."""
    if len(data) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).clone().view(dtype).reshape(shape)
