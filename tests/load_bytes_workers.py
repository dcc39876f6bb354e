"""Spawn targets of test_load_bytes: engine loads of native, universal and DeepSpeed
checkpoints, the bytes each rank read, and the bytes each rank needs.

What a rank *needs* is worked out here from the layouts and the files' own records, not
from the loader: the checksum blocks (native, universal) or zip records (DeepSpeed, whose
only checksum is a record's CRC-32) under the ranges of the fp32 masters (and, in full
loads, the optimizer states) of its new partition, the blocks under the module tensors it
is given to read (each buffer and frozen parameter by one rank of the job), and the
optimizer scalars (native: their own bytes, read alone and attested; DeepSpeed: rank 0's
records). A native or universal block or DeepSpeed record that several ranks
read parts of is checked by them together and read once over the job: it counts to the
lowest of them. Opening the files (headers, manifests, directories, pickles) is counted
apart by ReadStats and not compared.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from zeroshard.checkpoint import open_checkpoint, plan_reads
from zeroshard.checkpoint.engine_io import load_checkpoint_attested, save_checkpoint
from zeroshard.checkpoint.format import MODEL_FILE, fp32_key, rank_file_name, scalar_key, state_key
from zeroshard.checkpoint.formats import open_source
from zeroshard.checkpoint.native.source import NativeSource
from zeroshard.checkpoint.shared_module import share_checkpoint
from zeroshard.checkpoint.universal import to_universal
from zeroshard.checkpoint.universal.format import model_key, param_key
from zeroshard.deepspeed.checkpoint.files import read_rank_shard
from zeroshard.deepspeed.checkpoint.paths import rank_file_paths
from zeroshard.engine import ZeroOptimizer
from zeroshard.torchfile.torch_records import StoredTensor
from zeroshard.io import block_reader, checksum, digest, observe, safetensors_io
from zeroshard.io.dtypes import itemsize_of, to_numpy
from zeroshard.torchfile import torch_records
from zeroshard.io.read_stats import ReadStats
from zeroshard.io.safetensors_io import read_header

OPTIONS = {
    "full": {},
    "no_optimizer_states": {"load_optimizer_states": False},
    "module_only": {"load_module_only": True},
}


class BytesModel(nn.Module):
    """Odd widths, a tied head, two layers of trained weights, a frozen layer and two buffers
    (the shared tensors spread over up to 4 ranks): about 130 K trained parameters."""

    def __init__(self, hidden: int = 150, vocab: int = 97) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(4))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.frozen = nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, hidden))
        self.register_buffer("table", torch.arange(3 * vocab, dtype=torch.int64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * self.scale.to(self.embed.weight.dtype)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        x = self.norm(x + self.frozen(x))
        return self.head(x).float().logsumexp(-1).mean()


def make_engine(dtype: torch.dtype = torch.bfloat16) -> ZeroOptimizer:
    torch.manual_seed(0)
    model = BytesModel()
    model.frozen.to(dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.dim() >= 2]}, {"params": [p for p in trainable if p.dim() < 2]}]
    return ZeroOptimizer(model, torch.optim.AdamW, groups, stage=2, param_dtype=dtype, lr=1e-2)


def train_and_save(rank: int, root: Path, tag: str, dtype: torch.dtype = torch.bfloat16) -> ZeroOptimizer:
    """One step (fp32 masters no longer equal to their bf16 weights), then a save."""
    engine = make_engine(dtype)
    tokens = torch.randint(0, 97, (4, 7), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine.model(tokens))
    engine.step()
    save_checkpoint(engine, root, tag)
    return engine


# ---- what a rank needs --------------------------------------------------------------------------


def reads_saved_weights(layout, full: bool) -> bool:
    """Alone, a load without optimizer state reads the saved bf16 weights, not the fp32
    masters (half the bytes); a universal checkpoint has none."""
    return layout.world_size == 1 and not full


def _blocks(record, begin: int, end: int, name: str) -> set[tuple[str, int]]:
    return {(name, index) for index in record.blocks_covering(begin, end)}


def native_needed(path: Path, layout, rank: int, full: bool, shared: list[str]) -> int:
    """Bytes ``rank`` needs of a native checkpoint: the checksum blocks under its ranges (a
    block that several ranks read parts of, where partitions meet in a resharded load, is
    read once over the job and counts to the lowest of them), and its optimizer scalars'
    own bytes (every rank reads them alone; the load attests them)."""
    checkpoint = open_checkpoint(path)
    manifest = checkpoint.manifest
    headers: dict[str, Any] = {}

    def entry(file_name: str, key: str):
        if file_name not in headers:
            headers[file_name] = read_header(checkpoint.path(file_name), manifest.files[file_name].size)
        return headers[file_name][key]

    def blocks_of(reader: int) -> set[tuple[str, int]]:
        blocks: set[tuple[str, int]] = set()
        loaded, module = set(layout.param_names), shared if reader == rank else None
        if module is None:
            with open_source(path) as source:
                module = share_checkpoint(source.info.model_entries, layout, reader).mine
        if reads_saved_weights(layout, full):
            module, loaded = [*module, *layout.param_names], set()
        for plan in plan_reads(manifest.layout, layout, reader, loaded):
            for copy in plan.copies:
                record = manifest.groups[copy.source_group]
                keys = {fp32_key(copy.source_group): record.fp32_dtype}
                if full:
                    keys.update({state_key(copy.source_group, n): dtype for n, dtype in record.states.items()})
                file_name = rank_file_name(copy.source_rank, manifest.world_size)
                for key, dtype in keys.items():
                    begin = entry(file_name, key).begin + copy.source_start * itemsize_of(dtype)
                    blocks |= _blocks(manifest.files[file_name], begin, begin + copy.length * itemsize_of(dtype), file_name)
        for name in module:
            found = entry(MODEL_FILE, name)
            blocks |= _blocks(manifest.files[MODEL_FILE], found.begin, found.end, MODEL_FILE)
        return blocks

    blocks = blocks_of(rank)
    for lower in range(rank):
        blocks -= blocks_of(lower)
    scalar_bytes = 0  # a full load always reads with the job's other ranks, even alone
    for group, record in enumerate(manifest.groups if full else ()):
        for name in record.scalars:
            found = entry(rank_file_name(0, manifest.world_size), scalar_key(group, name))
            scalar_bytes += found.end - found.begin
    return scalar_bytes + sum(_block_bytes(manifest.files[name], index) for name, index in blocks)


def _block_bytes(record, index: int) -> int:
    begin, end = record.block_range(index)
    return end - begin


def universal_needed(path: Path, layout, rank: int, full: bool, shared: list[str]) -> int:
    """Bytes of the checksum blocks ``rank`` needs of a universal checkpoint: a block that
    several ranks read parts of (a parameter split where the new partitions meet, a buffer
    beside a master) is read once over the job, its parts by each rank and checked
    together, so it counts to the lowest of them."""
    from zeroshard.checkpoint.universal.read import open_universal

    checkpoint = open_universal(path)
    manifest = checkpoint.manifest
    opened = open_source(path)
    packed, entries = opened.info.layout, opened.info.model_entries
    headers: dict[str, Any] = {}

    def located(key: str):
        shard = manifest.weight_map[key]
        if shard not in headers:
            headers[shard] = read_header(path / shard, manifest.shards[shard].size)
        return shard, headers[shard][key]

    def blocks_of(reader: int) -> set[tuple[str, int]]:
        blocks: set[tuple[str, int]] = set()
        for plan in plan_reads(packed, layout, reader, set(layout.param_names)):
            for copy in plan.copies:
                group = packed.groups[copy.source_group]
                for fragment in group.fragments(0):
                    lo = max(fragment.partition_start, copy.source_start)
                    hi = min(fragment.partition_start + fragment.length, copy.source_start + copy.length)
                    if lo >= hi:
                        continue
                    start = fragment.param_start + lo - fragment.partition_start
                    param = manifest.params[fragment.name]
                    for kind in ("fp32", *(param.states if full else ())):
                        shard, found = located(param_key(fragment.name, kind))
                        begin = found.begin + 4 * start
                        blocks |= _blocks(manifest.shards[shard], begin, begin + 4 * (hi - lo), shard)
        for name in share_checkpoint(entries, layout, reader).mine if reader != rank else shared:
            shard, found = located(model_key(name))
            blocks |= _blocks(manifest.shards[shard], found.begin, found.end, shard)
        return blocks

    blocks = blocks_of(rank)
    for lower in range(rank):
        blocks -= blocks_of(lower)
    return sum(_block_bytes(manifest.shards[name], index) for name, index in blocks)


def deepspeed_needed(path: Path, layout, rank: int, full: bool, shared: list[str]) -> int:
    """Bytes of the zip records ``rank`` needs of a DeepSpeed checkpoint: a record's CRC-32 is
    its only checksum, so the job needs all of every record any rank reads a part of, once:
    here each record counts to the lowest rank that reads any of it. Rank 0's scalars (the
    step), which every rank reads, count to each."""
    source = open_source(path)

    def records_of(reader: int) -> dict[tuple[str, str], int]:
        records: dict[tuple[str, str], int] = {}

        def need(stored) -> None:
            records[(str(stored.storage.path), stored.storage.record_name)] = stored.storage.record_size

        loaded = set(layout.param_names)
        names = share_checkpoint(source.info.model_entries, layout, reader).mine
        if reads_saved_weights(layout, full):
            names, loaded = [*names, *layout.param_names], set()
        for plan in plan_reads(source.info.layout, layout, reader, loaded):
            for copy in plan.copies:
                tensors = source._ranks[copy.source_rank]
                need(tensors.fp32[copy.source_group])
                if full:
                    for stored in tensors.states[copy.source_group].values():
                        need(stored)
        for name in names:
            need(source._model.module[name])
        return records

    mine = records_of(rank)
    for lower in range(rank):
        for key in records_of(lower):
            mine.pop(key, None)
    first = read_rank_shard(rank_file_paths(source.path)[0], 0)  # every rank reads rank 0's scalars (step)
    for group in first.scalars:
        for value in group.values():
            if isinstance(value, StoredTensor):
                mine[(str(value.storage.path), value.storage.record_name)] = value.storage.record_size
    source.close()
    return sum(mine.values())


NEEDED = {"native": native_needed, "universal": universal_needed, "deepspeed": deepspeed_needed}


# ---- one load ----------------------------------------------------------------------------------


@contextlib.contextmanager
def counting_crc() -> Iterator[list[int]]:
    """The byte counts of every CRC-32 zeroshard computes meanwhile (the checksum checks and
    the attestation's digests), in this process."""
    counts: list[int] = []
    with pytest.MonkeyPatch.context() as patch:
        for module in (block_reader, checksum, digest, observe, safetensors_io, torch_records):
            crc = module.crc32
            patch.setattr(module, "crc32", lambda data, *start, crc=crc: counts.append(memoryview(data).nbytes) or crc(data, *start))
        yield counts


def load_case(rank: int, world: int, kind: str, path: Path, option: str, engine: ZeroOptimizer) -> dict[str, Any]:
    """Load ``path`` into ``engine`` with ``option``; what this rank read and needs, and the
    bytes it CRC'd."""
    stats = ReadStats()
    all_reduce = dist.all_reduce
    all_reduces = []
    with counting_crc() as crc_counts, pytest.MonkeyPatch.context() as patch:
        patch.setattr(dist, "all_reduce", lambda *args, **kwargs: all_reduces.append(1) or all_reduce(*args, **kwargs))
        _, attestation = load_checkpoint_attested(engine, path, stats=stats, **OPTIONS[option])
    crc_bytes = sum(crc_counts)
    with open_source(path) as source:
        shared = share_checkpoint(source.info.model_entries, engine.layout, rank).mine
    full = option == "full"
    needed = NEEDED[kind](Path(source.path), engine.layout, rank, full, shared)
    return {
        "weights_differing": weights_differing_from_file(path, engine) if kind == "native" else 0,
        "model_file_bytes": (Path(path) / MODEL_FILE).stat().st_size if kind == "native" else None,
        "kind": kind,
        "option": option,
        "path": str(path),
        "data": stats.data,
        "crc": crc_bytes,
        "total": stats.total,
        "ranks": stats.ranks,
        "ranks_opening": stats.ranks_opening,
        "needed": needed,
        "files": dict(stats.bytes_by_file),
        "attested": attestation.line(),
        "rebuilt_bytes": sum(p.numel() * p.element_size() for p in engine.model.parameters() if p.requires_grad),
        "all_reduces": len(all_reduces),
    }


def weights_differing_from_file(path: Path, engine: ZeroOptimizer) -> int:
    """Elements of the engine's module that differ, bit for bit, from model.safetensors'
    (the trained weights rebuilt from the masters included): 0 when they are the file's."""
    module = engine.model.state_dict()
    with NativeSource(path) as source:
        saved = source.model_tensors(list(module))
    assert saved.keys() == module.keys(), sorted(set(module) ^ set(saved))
    differing = 0
    for name, values in saved.items():
        mine = to_numpy(module[name]).reshape(-1)
        differing += int(np.count_nonzero(mine.view(f"u{mine.itemsize}") != values.reshape(-1).view(f"u{mine.itemsize}")))
    return differing


def damaged_load(rank: int, root: Path, engine: ZeroOptimizer) -> dict[str, Any]:
    """A copy of the D=2 checkpoint whose frozen weight (read by one rank only) is corrupted:
    every rank must raise the same error, and no rank's engine may change."""
    source, damaged = root / "native" / "d2", root / "damaged"
    if rank == 0:
        shutil.copytree(source, damaged)
        flip_middle_byte(damaged, MODEL_FILE, "frozen.weight")
    dist.barrier()
    before = {name: t.clone() for name, t in engine.model.state_dict().items()}
    try:
        load_checkpoint_attested(engine, damaged)
        error = None
    except Exception as err:  # noqa: BLE001 - what every rank raised is the result
        error = (type(err).__name__, str(err))
    changed = [name for name, t in engine.model.state_dict().items() if not torch.equal(before[name], t)]
    return {"error": error, "changed": changed}


def refused_import(rank: int, root: Path, engine: ZeroOptimizer) -> dict[str, Any]:
    """Rank 1's engine refuses the state it read (its import check raises, as for a model or
    optimizer that does not fit): every rank must raise rank 1's error, which the load's
    agreement carries (the import agrees on nothing again), and nothing may change."""
    before = {name: t.clone() for name, t in engine.model.state_dict().items()}
    with pytest.MonkeyPatch.context() as patch:
        if rank == 1:
            patch.setattr(engine, "check_import", lambda *args, **kwargs: _refuse())
        try:
            load_checkpoint_attested(engine, root / "native" / "d2")
            error = None
        except Exception as err:  # noqa: BLE001 - what every rank raised is the result
            error = (type(err).__name__, str(err))
    changed = [name for name, t in engine.model.state_dict().items() if not torch.equal(before[name], t)]
    return {"error": error, "changed": changed}


def _refuse() -> None:
    raise ValueError("the state does not fit this engine")


def flip_middle_byte(checkpoint: Path, file_name: str, key: str) -> None:
    """Invert the middle byte of tensor ``key`` in ``file_name`` of a native checkpoint."""
    with NativeSource(checkpoint) as opened:
        entry = opened._header(file_name)[key]
    with open(checkpoint / file_name, "r+b") as file:
        file.seek((entry.begin + entry.end) // 2)
        byte = file.read(1)
        file.seek(-1, 1)
        file.write(bytes([byte[0] ^ 0xFF]))


def deepspeed_engine(fixture) -> ZeroOptimizer:
    from test_deepspeed_resume import make_engine as deepspeed_make_engine
    from test_deepspeed_resume import model_as_deepspeed_runs_it

    from deepspeed_fixtures import param_groups

    model = model_as_deepspeed_runs_it(fixture)
    return deepspeed_make_engine(model, param_groups(model), 2)


def run_world(rank: int, world: int, root: str, saved_elsewhere: list[str], deepspeed: list) -> list[dict[str, Any]]:
    """Spawn target at ``world`` ranks: save a native checkpoint at this world size (rank 0
    also converts it to universal when asked), then load, with every option, it, the native
    checkpoints ``saved_elsewhere`` (resharded), the universal one and the DeepSpeed
    fixtures ``deepspeed``."""
    root_path = Path(root)
    tag = f"d{world}"
    engine = train_and_save(rank, root_path / "native", tag)
    native = [root_path / "native" / tag] + [Path(p) for p in saved_elsewhere]
    if world == 2:
        if rank == 0:
            to_universal(native[0], root_path / "universal", progress=False, block_size=4096)
        if dist.is_initialized():
            dist.barrier()
    cases = [("native", path) for path in native]
    if (root_path / "universal").is_dir():
        cases.append(("universal", root_path / "universal"))
    results = []
    for kind, path in cases:
        for option in OPTIONS:
            results.append(load_case(rank, world, kind, path, option, engine))
    for fixture in deepspeed:
        for option in OPTIONS:
            results.append(load_case(rank, world, "deepspeed", fixture.save_dir, option, deepspeed_engine(fixture)))
    if world == 2:
        results.append(refused_import(rank, root_path, engine))
        results.append(damaged_load(rank, root_path, engine))
    return results

