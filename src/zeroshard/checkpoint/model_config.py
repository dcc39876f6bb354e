"""The model's configuration files: recorded in a checkpoint, carried by ``to-universal``,
written by ``to-fp32`` as the ``config.json`` (and ``generation_config.json``) that
``from_pretrained(OUT)`` reads.

The engine records them from the model (:func:`zeroshard.state.model_config_files`: a
transformers-style ``config`` and ``generation_config``, by duck typing). A checkpoint
stores them as ``model.config.json`` and ``model.generation_config.json`` (so a tag does not
pass for a Hugging Face folder), each listed in the manifest with its block checksums like
every file. Read back they are hostile like any file: at most :data:`MAX_CONFIG_BYTES`,
checksummed, UTF-8, one JSON object, nested no deeper than :mod:`..io.jsonvalue` allows.
Torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from ..state import CONFIG_FILE, EXPORTED_CONFIGS, GENERATION_CONFIG_FILE
from ..io import jsonvalue
from ..io.budget import quoted
from ..io.checksum import BlockHasher, FileRecord, block_crc
from ..io.damage import CheckpointDamagedError
from .directory import write_file_durably
from ..io.members import member_path, open_member

__all__ = ["CONFIG_FILE", "EXPORTED_CONFIGS", "GENERATION_CONFIG_FILE"]

MAX_CONFIG_BYTES = 16 << 20  # a model's config is kilobytes; this bounds what a file can make us read


def stored_name(exported: str) -> str:
    """The name a checkpoint stores ``exported`` (``config.json``) under: ``model.config.json``."""
    return f"model.{exported}"


STORED_NAMES = {stored_name(name): name for name in EXPORTED_CONFIGS}  # stored -> exported


def parse_config(text: str, where: object) -> dict[str, Any]:
    """The JSON object of a config file's ``text``; ValueError naming ``where`` otherwise."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"{where}: {size:,} bytes, more than a model config holds ({MAX_CONFIG_BYTES:,})")
    try:
        value = jsonvalue.loads(text, where)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: a JSON {type(value).__name__}, not the object a model config is")
    return value


def config_problem(name: object, text: object) -> str | None:
    """Why ``text`` cannot be recorded as config file ``name``, or None."""
    if name not in EXPORTED_CONFIGS:
        return f"model config file {quoted(name)} is not one of {', '.join(EXPORTED_CONFIGS)}"
    if not isinstance(text, str):
        return f"model config {name} is a {type(text).__name__}, not JSON text"
    try:
        parse_config(text, f"model config {name}")
    except ValueError as err:
        return str(err)
    return None


def write_config(directory: Path, name: str, text: str, block_size: int) -> FileRecord:
    """Write ``text`` as file ``name`` of ``directory`` (UTF-8, fsynced); its record."""
    data = text.encode("utf-8")
    write_file_durably(directory / name, data)
    hasher = BlockHasher(block_size)
    hasher.update(data)
    return hasher.record()


def read_config(directory: Path, name: str, record: FileRecord) -> str:
    """Config file ``name`` of a checkpoint, checked against its ``record`` and parsed: its
    text. CheckpointDamagedError (a ValueError) naming the file for anything amiss."""
    path = member_path(directory, name)
    if record.size > MAX_CONFIG_BYTES:
        raise CheckpointDamagedError(f"{path}: the manifest says {record.size:,} bytes, more than a model config holds")
    with open(open_member(path), "rb") as handle:
        data = handle.read(record.size + 1)
    if len(data) != record.size:
        raise CheckpointDamagedError(f"{path}: size {len(data):,} bytes or more, the manifest says {record.size:,}")
    for index, expected in enumerate(record.crc32):
        begin, end = record.block_range(index)
        if block_crc(data[begin:end]) != expected:
            raise CheckpointDamagedError(
                f"{path}: checksum mismatch in block {index} (bytes {begin}-{end}): the file is corrupted"
            )
    try:
        text = data.decode("utf-8")
        parse_config(text, path)
    except UnicodeDecodeError:
        raise CheckpointDamagedError(f"{path}: corrupted: not UTF-8 text") from None
    except ValueError as err:
        raise CheckpointDamagedError(str(err)) from None
    return text


def config_records(records: Mapping[str, FileRecord]) -> dict[str, FileRecord]:
    """The stored config files among a manifest's file records."""
    return {name: record for name, record in records.items() if name in STORED_NAMES}
