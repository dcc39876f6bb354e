"""The consolidated module state_dict of a saved run, as Hugging Face style safetensors.

Every name of the module's state_dict is written: trained parameters from their fp32
masters (cast to ``dtype``), frozen parameters (floating ones cast to ``dtype``) and
buffers (in their own dtype), and a tied parameter under each of its names with its own
bytes (safetensors refuses shared storage). Expert stacks are written in each stack's own
export form (:mod:`..experts`): one global ``[E, ...]`` tensor under its own name and
orientation (``model.layers.0.mlp.experts.gate_up_proj``, what transformers'
``from_pretrained`` loads), or one ``[out, in]`` tensor per global expert (MoEGPT's
``blocks.0.moe.experts.3.w1.weight``, which ``GroupedExperts`` loads with ``strict=True``);
``experts="stacked"`` or ``"per_expert"`` forces one form. One ``model.safetensors``, or, when
``max_shard_size`` is given and exceeded, ``model-00001-of-0000N.safetensors`` shards and a
``model.safetensors.index.json``. Streaming and atomic like :func:`to_universal`, and like
it torch-free: :func:`load_fp32_state_dict` alone hands out torch tensors. Every master read
is checked against the checkpoint's digests (:mod:`..attest.read_digests`), and ``DIGESTS_FILE``
records the digest (``zlib.crc32``) of every tensor written.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from ...layout import canonical_dtype
from ...io.checksum import block_crc
from ..directory import write_file_durably
from ...io.dtypes import cast, dtype_info, to_torch
from ..format import DEFAULT_BLOCK_SIZE, MANIFEST_FILE
from ..formats import open_source
from ..output_dir import OutputKind, output_path, staged_output
from ...io.safetensors_io import PlannedTensor
from ..experts import EXPERT_FORMS, ExportedParam, exported_params, read_exported
from ...io.digest import ALGORITHM
from ..attest.read_digests import ReadChecker
from ..model_config import CONFIG_FILE, EXPORTED_CONFIGS, parse_config
from ..source import ModelEntry, ShardSource, read_model_configs
from ...io.streaming import OutputTensor, plan_shards, write_shards
from ..universal.read import UniversalCheckpoint
from ..universal.source import UniversalSource

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DIGESTS_FILE = "zeroshard.digests.json"  # the digest of every tensor written, by name
DIGESTS_FORMAT = "zeroshard.fp32-digests"
# "format": "pt" is what transformers checks before loading a file; "zeroshard" marks the
# files as an export of ours, the only kind of directory an --overwrite replaces.
METADATA = {"format": "pt", "zeroshard": "fp32 export"}
OUTPUT_KIND = OutputKind(
    "model export",
    r"model\.safetensors(\.index\.json)?|model-\d{5,}-of-\d{5,}\.safetensors|" + re.escape(DIGESTS_FILE),
    (SINGLE_FILE, INDEX_FILE),
    METADATA,
    DIGESTS_FILE,  # its "files": the config.json and generation_config.json written with the export
    "|".join(map(re.escape, EXPORTED_CONFIGS)),
)
if TYPE_CHECKING:
    import torch

Input = str | os.PathLike[str] | ShardSource | UniversalCheckpoint


def is_fp32_export(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder :func:`to_fp32` wrote (``model.safetensors``, or the shard
    index), from file names alone; a native checkpoint tag holds a ``model.safetensors`` too,
    beside its manifest."""
    path = Path(path)
    exported = (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file()
    return exported and not (path / MANIFEST_FILE).is_file()


def shard_file_name(index: int, count: int) -> str:
    """``model-00001-of-00003.safetensors`` for shard ``index`` (from 0) of ``count``."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


@dataclass(frozen=True)
class _ModelView:
    """What an export needs of its input, whatever the input is."""

    trained: list[tuple[str, tuple[int, ...]]]  # layout order
    entries: list[ModelEntry]  # buffers and frozen parameters
    aliases: dict[str, str]
    master: Callable[[str], np.ndarray]  # a trained parameter's fp32 master, flat
    model_tensor: Callable[[str], np.ndarray]
    close: Callable[[], None]
    origin: Path  # the checkpoint directory read
    configs: Callable[[], dict[str, str]]  # the model's config files the checkpoint recorded


def to_fp32(
    path: Input,
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str = "float32",
    max_shard_size: int | None = None,
    progress: bool | None = None,
    overwrite: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    experts: str | None = None,
) -> Path:
    """Export the module state_dict of ``path`` (a native, universal or DeepSpeed checkpoint,
    or an opened ShardSource / UniversalCheckpoint) to ``out_dir``; returns ``out_dir``.
    ``experts``: None writes each expert stack in its own form; ``"stacked"`` or
    ``"per_expert"`` writes every stack in that one."""
    dtype = _as_dtype(dtype)
    out_dir = output_path(out_dir)  # once: publishing may replace the current directory
    view = _open(path, experts)
    inputs = (path, view.origin) if isinstance(path, (str, os.PathLike)) else (view.origin,)
    try:
        tensors = _outputs(view, dtype)
        configs = {name: exported_config(name, text, dtype) for name, text in view.configs().items()}
        sizes = [t.planned.nbytes for t in tensors]
        shards = plan_shards(sizes, max_shard_size)
        names = [SINGLE_FILE] if len(shards) == 1 else [shard_file_name(i, len(shards)) for i in range(len(shards))]
        with staged_output(out_dir, kind=OUTPUT_KIND, overwrite=overwrite, inputs=inputs) as staging:
            digests: dict[str, int] = {}
            write_shards(
                staging,
                tensors,
                shards,
                names,
                block_size=block_size,
                metadata=dict(METADATA),
                progress=progress,
                description="to-fp32",
                digests=digests,
            )
            record = {"format": DIGESTS_FORMAT, "version": 1, "algorithm": ALGORITHM, "dtype": dtype}
            record["tensors"] = digests
            if configs:
                record["files"] = {name: _write_config(staging / name, text) for name, text in configs.items()}
            write_file_durably(staging / DIGESTS_FILE, json.dumps(record, indent=1) + "\n")
            if len(shards) > 1:
                weight_map = {tensors[i].planned.key: name for shard, name in zip(shards, names) for i in shard}
                index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
                write_file_durably(staging / INDEX_FILE, json.dumps(index, indent=2) + "\n")
    finally:
        view.close()
    return out_dir


def load_fp32_state_dict(
    path: Input, dtype: torch.dtype | str = "float32", experts: str | None = None
) -> dict[str, torch.Tensor]:
    """The consolidated module state_dict of ``path`` in memory, as :func:`to_fp32` writes it,
    as torch tensors (tied names share one tensor here)."""
    dtype = _as_dtype(dtype)
    view = _open(path, experts)
    try:
        state: dict[str, torch.Tensor] = {}
        made: dict[int, torch.Tensor] = {}
        for entry in _outputs(view, dtype):
            key = id(entry.produce)
            if key not in made:
                made[key] = to_torch(entry.produce().reshape(entry.planned.shape))
            state[entry.planned.key] = made[key]
        return state
    finally:
        view.close()


def _outputs(view: _ModelView, dtype: str) -> list[OutputTensor]:
    """One entry per state_dict name; a target and its aliases share one producer, in a row."""
    aliases_of: dict[str, list[str]] = {}
    for alias, target in view.aliases.items():
        aliases_of.setdefault(target, []).append(alias)
    tensors: list[OutputTensor] = []
    stored: set[str] = set()
    for name, shape in view.trained:
        produce = functools.partial(_cast, view.master, name, dtype)
        tensors += [OutputTensor(PlannedTensor(n, dtype, shape), produce) for n in [name, *aliases_of.get(name, [])]]
        stored.add(name)
    for entry in view.entries:
        own = entry.dtype
        out = dtype if entry.kind == "frozen" and dtype_info(own).is_floating_point else own
        produce = functools.partial(_cast, view.model_tensor, entry.name, out)
        tensors += [OutputTensor(PlannedTensor(n, out, entry.shape), produce) for n in [entry.name, *aliases_of.get(entry.name, [])]]
        stored.add(entry.name)
    dangling = sorted(alias for alias, target in view.aliases.items() if target not in stored)
    if dangling:
        raise ValueError(f"tied names {dangling} point at tensors the checkpoint does not hold")
    return tensors


def exported_config(name: str, text: str, dtype: str) -> str:
    """Config file ``name`` as an export writes it: ``config.json`` says the weights' ``dtype``
    (``from_pretrained`` loads in it by default), the rest as recorded."""
    if name != CONFIG_FILE:
        return text
    value = parse_config(text, name)
    value["dtype"] = dtype
    if "torch_dtype" in value:  # what transformers before v5 read
        value["torch_dtype"] = dtype
    return json.dumps(value, indent=2, sort_keys=True) + "\n"


def _write_config(path: Path, text: str) -> int:
    """Write a config file; the CRC-32 of its bytes, which the digests record lists so that
    ``--overwrite`` knows it for ours."""
    data = text.encode("utf-8")
    write_file_durably(path, data)
    return block_crc(data)


def _cast(read: Callable[[str], np.ndarray], name: str, dtype: str) -> np.ndarray:
    return cast(read(name), dtype)


def _open(path: Input, experts: str | None) -> _ModelView:
    if experts not in (None, *EXPERT_FORMS):
        raise ValueError(f"experts must be None or one of {', '.join(EXPERT_FORMS)}, got {experts!r}")
    if isinstance(path, UniversalCheckpoint):
        return _source_view(UniversalSource(path), experts, close=False)
    if isinstance(path, (str, os.PathLike)):
        source = open_source(path)
        try:
            return _source_view(source, experts, close=True)
        except BaseException:
            source.close()
            raise
    return _source_view(path, experts, close=False)


def _source_view(source: ShardSource, experts: str | None, *, close: bool) -> _ModelView:
    params = exported_params(source.info.layout, experts)
    _check_names_unique(source, params)
    exported = {param.name: param for param in params}
    checker = ReadChecker(source)  # every master and module tensor read, against the saved digests

    def model_tensor(name: str) -> np.ndarray:
        values = source.model_tensor(name)
        checker.model_tensor(name, values)
        return values

    return _ModelView(
        trained=[(name, param.shape) for name, param in exported.items()],
        entries=list(source.info.model_entries),
        aliases=dict(source.info.aliases),
        master=lambda name: read_exported(source, exported[name], "fp32", checker.param),
        model_tensor=model_tensor,
        close=source.close if close else _nothing,
        origin=source.path,
        configs=lambda: read_model_configs(source),
    )


def _check_names_unique(source: ShardSource, params: list[ExportedParam]) -> None:
    """ValueError naming the checkpoint when two tensors of the export would have one name
    (two expert stacks' per-expert tensors, or one and a module tensor): the last line of
    defence behind the layout's and the manifests' checks, which refuse such stacks."""
    owner: dict[str, str] = {}
    named = [(param.name, param.param) for param in params]
    named += [(entry.name, entry.name) for entry in source.info.model_entries]
    named += [(alias, f"{target} (tied)") for alias, target in source.info.aliases.items()]
    for name, origin in named:
        if name in owner:
            raise ValueError(
                f"{source.path}: cannot export: {owner[name]!r} and {origin!r} would both be written as tensor {name!r}"
            )
        owner[name] = origin


def _nothing() -> None:
    pass


def _as_dtype(dtype: torch.dtype | str) -> str:
    name = canonical_dtype(dtype)
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"export dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return name
