"""``zeroshard inspect`` of an fp32 export (``to-fp32`` output): what it holds, and
``--verify`` of its structure.

An export is a model state dict in safetensors files (``model.safetensors``, or shards and
``model.safetensors.index.json``); it holds weights only, no optimizer state, step, layout or
checksums, so ``--verify`` checks what can be checked without them: every header parses, every
tensor's bytes match its dtype and shape, and the index names every tensor and file exactly.
Only headers are read; no tensor is. Torch is not imported.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Mapping

from ..checkpoint.export.fp32 import INDEX_FILE, SINGLE_FILE
from ..checkpoint.io.directory import read_json_file
from ..checkpoint.io.dtypes import dtype_of_code
from ..checkpoint.io.members import member_path
from ..checkpoint.io.safetensors_io import TensorEntry, read_header
from .inspect_report import file_lines

LISTED_TENSORS = 8
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
    if weight_map is None:
        return lines + file_lines(sizes, {}, "shards", list_all_files)
    return lines + file_lines({INDEX_FILE: (path / INDEX_FILE).stat().st_size}, sizes, "shards", list_all_files)


def verify_fp32_export(path: Path) -> tuple[str, list[str], dict[str, int]]:
    """(summary, problems, every file checked with its size) for the export at ``path``."""
    problems: list[str] = []
    try:
        files, weight_map = _files(path)
    except (ValueError, FileNotFoundError) as err:
        return "", [str(err)], {}
    held: dict[str, str] = {}  # tensor -> the file holding it
    for file in files:
        try:
            entries = _header(path / file)
        except (ValueError, FileNotFoundError) as err:
            problems.append(str(err))
            continue
        problems += _entry_problems(path / file, entries)
        held.update({name: file for name in entries})
    if weight_map is not None:
        problems += _index_problems(path, weight_map, held)
        unlisted = sorted(p.name for p in path.glob("*.safetensors") if p.name not in files)
        problems += [f"{path / name}: not listed in {INDEX_FILE}" for name in unlisted]
    checked = {file: (path / file).stat().st_size for file in files if (path / file).is_file()}
    if weight_map is not None:
        checked = {INDEX_FILE: (path / INDEX_FILE).stat().st_size, **checked}
    summary = (
        f"{path}: OK, fp32 export, {len(checked)} files, {sum(checked.values()):,} bytes, {len(held)} tensors: "
        "every header, tensor size and index entry agrees (an export carries no checksums)"
    )
    return summary, problems, checked


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
