"""``zeroshard inspect`` of an fp32 export (``to-fp32`` output): what it holds, and
``--verify`` of its structure.

An export is a model state dict in safetensors files (``model.safetensors``, or shards and
``model.safetensors.index.json``); it holds weights only, no optimizer state, step, layout or
block checksums. ``--verify`` checks every header parses, every tensor's bytes match its
dtype and shape, no name is held twice (in two files, or twice in one header or the index),
the index names every tensor and file exactly, and, where the export has
``zeroshard.digests.json`` (every export zeroshard writes now), that each tensor's bytes read
as the CRC-32 recorded there when it was written, and that it records exactly the tensors,
and the config files it lists (``config.json``, ``generation_config.json``) each as its CRC-32.
Torch is not imported.
"""

from __future__ import annotations

import math
import os
import zlib
from collections import Counter
from pathlib import Path
from typing import Mapping

from ..checkpoint.export.fp32 import DIGESTS_FILE, DIGESTS_FORMAT, INDEX_FILE, SINGLE_FILE
from ..io.budget import quoted
from ..checkpoint.directory import read_json_file
from ..io.dtypes import dtype_of_code
from ..io.members import member_path, open_member
from ..io.safetensors_io import TensorEntry, read_header
from ..checkpoint.model_config import EXPORTED_CONFIGS
from .inspect_report import file_lines

LISTED_TENSORS = 8
_CHUNK = 1 << 20  # bytes read at a time to digest a tensor
KIND_LINE = (
    "kind: fp32 export (to-fp32 output): a Hugging Face style model state dict, weights only: no optimizer "
    "state, step count or layout; it loads with model.load_state_dict(strict=True), not with load_checkpoint"
)


def describe_fp32_export(path: Path, *, list_all_files: bool = False) -> list[str]:
    """The report of the export at ``path``: its tensors by dtype, the first few, its files.

    Raises:
        ValueError, FileNotFoundError: a file is missing, a link, or its header is damaged.
    """
    files, weight_map = _files(path)
    tensors = {name: entry for file in files for name, entry in _header(path / file).items()}
    by_dtype = Counter(entry.dtype for entry in tensors.values())
    numel = sum(math.prod(entry.shape) for entry in tensors.values())
    lines = [
        f"export {path}",
        KIND_LINE,
        "step: not recorded (an export holds weights only)",
        f"tensors: {len(tensors)} ({numel:,} elements); by dtype: "
        + ", ".join(f"{dtype_of_code(code).name} {count}" for code, count in sorted(by_dtype.items())),
    ]
    names = sorted(tensors)
    shown = names if list_all_files else names[:LISTED_TENSORS]
    lines += [f"  {name}: {dtype_of_code(tensors[name].dtype).name} {list(tensors[name].shape)}" for name in shown]
    if len(shown) < len(names):
        lines.append(f"  ... {len(names) - len(shown)} more (--files lists them all)")
    sizes = {file: (path / file).stat().st_size for file in files}
    records = {DIGESTS_FILE: (path / DIGESTS_FILE).lstat().st_size} if (path / DIGESTS_FILE).is_file() else {}
    records.update({name: (path / name).lstat().st_size for name in EXPORTED_CONFIGS if (path / name).is_file()})
    if weight_map is None:
        return lines + file_lines({**sizes, **records}, {}, "shards", list_all_files)
    index = {INDEX_FILE: (path / INDEX_FILE).stat().st_size, **records}
    return lines + file_lines(index, sizes, "shards", list_all_files)


def verify_fp32_export(path: Path) -> tuple[str, list[str], dict[str, int]]:
    """(summary, problems, every file checked with its size) for the export at ``path``."""
    problems: list[str] = []
    try:
        files, weight_map = _files(path)
    except (ValueError, FileNotFoundError) as err:
        return "", [str(err)], {}
    held: dict[str, str] = {}  # tensor -> the file holding it
    headers: dict[str, dict[str, TensorEntry]] = {}
    for file in files:
        try:
            entries = _header(path / file)
        except (ValueError, FileNotFoundError) as err:
            problems.append(str(err))
            continue
        problems += _entry_problems(path / file, entries)
        problems += [f"{path / file}: tensor {quoted(name)} is also in {held[name]}" for name in entries if name in held]
        held.update({name: file for name in entries if name not in held})
        headers[file] = entries
    if weight_map is not None:
        problems += _index_problems(path, weight_map, held)
        unlisted = sorted(p.name for p in path.glob("*.safetensors") if p.name not in files)
        problems += [f"{path / name}: not listed in {INDEX_FILE}" for name in unlisted]
    digested = (path / DIGESTS_FILE).exists() or (path / DIGESTS_FILE).is_symlink()
    if digested and not problems:
        problems += _digest_problems(path, headers)
    checked = {file: (path / file).stat().st_size for file in files if (path / file).is_file()}
    if weight_map is not None:
        checked = {INDEX_FILE: (path / INDEX_FILE).stat().st_size, **checked}
    if digested:
        checked[DIGESTS_FILE] = (path / DIGESTS_FILE).lstat().st_size
        checked.update({name: (path / name).lstat().st_size for name in _listed_files(path) if (path / name).is_file()})
    how = (
        "every header, tensor size, index entry and tensor digest agrees"
        if digested
        else f"every header, tensor size and index entry agrees (no {DIGESTS_FILE}: written before digests)"
    )
    total = sum(checked.values())
    summary = f"{path}: OK, fp32 export, {len(checked)} files, {total:,} bytes, {len(held)} tensors: {how}"
    return summary, problems, checked


def _digest_problems(path: Path, headers: Mapping[str, Mapping[str, TensorEntry]]) -> list[str]:
    """Each tensor's bytes against the CRC-32 ``zeroshard.digests.json`` recorded for it."""
    where = path / DIGESTS_FILE
    try:
        record = read_json_file(where, "fp32 export")
    except (ValueError, FileNotFoundError) as err:
        return [str(err)]
    if not isinstance(record, dict) or record.get("format") != DIGESTS_FORMAT:
        return [f"{where}: corrupted: not a {DIGESTS_FORMAT} record"]
    recorded = record.get("tensors")
    if not isinstance(recorded, dict) or not all(type(v) is int for v in recorded.values()):
        return [f"{where}: corrupted: no 'tensors' object of tensor names to CRC-32 values"]
    names = {name for entries in headers.values() for name in entries}
    extra, absent = sorted(set(recorded) - names)[:3], sorted(names - set(recorded))[:3]
    if extra or absent:
        return [
            f"{where}: does not record exactly the export's tensors (extra {quoted(extra)}, absent {quoted(absent)})"
        ]
    problems = _file_problems(path, record.get("files", {}))
    for file, entries in headers.items():
        fd = open_member(path / file)
        try:
            for name, entry in entries.items():
                found = _crc_of_range(fd, entry.begin, entry.end)
                if found != recorded[name]:
                    problems.append(
                        f"{path / file}: tensor {quoted(name)} reads as CRC-32 {found:08x}, "
                        f"{DIGESTS_FILE} recorded {recorded[name] & 0xFFFFFFFF:08x}: it is not what was written"
                    )
        finally:
            os.close(fd)
    return problems


def _file_problems(path: Path, files: object) -> list[str]:
    """The files the record lists besides the tensors (config.json, generation_config.json):
    each present, a regular file, reading as the CRC-32 recorded."""
    where = path / DIGESTS_FILE
    if not isinstance(files, dict) or not all(type(v) is int and name in EXPORTED_CONFIGS for name, v in files.items()):
        return [f"{where}: corrupted: 'files' is not an object of {' or '.join(EXPORTED_CONFIGS)} to CRC-32 values"]
    problems = []
    for name, recorded in sorted(files.items()):
        try:
            fd = open_member(member_path(path, name))
        except (OSError, ValueError) as err:
            problems.append(str(err))
            continue
        try:
            found = _crc_of_range(fd, 0, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if found != recorded:
            problems.append(
                f"{path / name}: reads as CRC-32 {found:08x}, {DIGESTS_FILE} recorded {recorded & 0xFFFFFFFF:08x}: "
                "it is not what was written"
            )
    return problems


def _listed_files(path: Path) -> list[str]:
    """The config files the export's record lists (none when it cannot say)."""
    try:
        record = read_json_file(path / DIGESTS_FILE, "fp32 export")
    except (OSError, ValueError):
        return []
    files = record.get("files") if isinstance(record, dict) else None
    return sorted(name for name in files if name in EXPORTED_CONFIGS) if isinstance(files, dict) else []


def _crc_of_range(fd: int, begin: int, end: int) -> int:
    crc = 0
    for position in range(begin, end, _CHUNK):
        chunk = os.pread(fd, min(_CHUNK, end - position), position)
        if not chunk:
            break
        crc = zlib.crc32(chunk, crc)
    return crc


def _files(path: Path) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of the export, and the index's weight map (None: one file)."""
    if not (path / INDEX_FILE).is_file():
        member_path(path, SINGLE_FILE)
        return [SINGLE_FILE], None
    index = read_json_file(path / INDEX_FILE, "fp32 export")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{path / INDEX_FILE}: corrupted: no weight_map of tensor names to file names")
    files = sorted(set(weight_map.values()))
    for file in files:
        member_path(path, file)
    return files, weight_map


def _header(file: Path) -> dict[str, TensorEntry]:
    return read_header(member_path(file.parent, file.name), file.stat().st_size)


def _entry_problems(file: Path, entries: Mapping[str, TensorEntry]) -> list[str]:
    problems = []
    for name, entry in entries.items():
        try:
            itemsize = dtype_of_code(entry.dtype).itemsize
        except ValueError:
            problems.append(f"{file}: tensor {name!r} has unknown dtype {entry.dtype!r}")
            continue
        if entry.end - entry.begin != itemsize * math.prod(entry.shape):
            problems.append(
                f"{file}: tensor {name!r} spans {entry.end - entry.begin} bytes, its shape needs "
                f"{itemsize * math.prod(entry.shape)}"
            )
    return problems


def _index_problems(path: Path, weight_map: Mapping[str, str], held: Mapping[str, str]) -> list[str]:
    problems = []
    for name in sorted(set(weight_map) | set(held)):
        listed, found = weight_map.get(name), held.get(name)
        if listed != found:
            where = f"in {found}" if found else "in no file"
            problems.append(f"{path / INDEX_FILE}: tensor {name!r} is listed in {listed or 'no file'} but {where}")
    return problems
