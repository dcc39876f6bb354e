"""Names in a checkpoint directory and keys in its files: the format's vocabulary.

docs/FORMAT.md describes the format; this module is the one place that spells its names.
"""

from __future__ import annotations

FORMAT_NAME = "zeroshard.checkpoint"
FORMAT_VERSION = 4  # the newest read; 4: resume files, each rank's random state and states (written only with them)
RESUME_VERSION = 4  # the first version with resume files
CONFIG_VERSION = 3  # the model's config files (written only with them, and without resume files)
DIGESTED_VERSION = 2  # digests of the logical state and rank-file bindings; what a save without either writes
UNDIGESTED_VERSION = 1  # written before digests; still read
UNDIGESTED_LAYOUT_VERSION = 2  # the newest layout a version 1 manifest holds (layout version 3 came after version 2)

MANIFEST_FILE = "manifest.json"
MODEL_FILE = "model.safetensors"
LATEST_FILE = "latest"
AUDIT_FILE = "audit.json"  # written into a tag after the save, by the first step that follows it
LOCK_FILE = ".lock"  # held by the save in progress (writer_lock.py); absent otherwise

# Checksums cover fixed-size blocks of every file, so a rank that reads a byte range checks
# only the blocks under it instead of hashing whole files it mostly does not need.
DEFAULT_BLOCK_SIZE = 1 << 20

TEMP_MARKER = ".tmp-"  # staging directory: "." + tag + TEMP_MARKER + id
OLD_MARKER = ".old-"  # a replaced tag waiting to be deleted: "." + tag + OLD_MARKER + id
DELETE_MARKER = ".del-"  # a tag being deleted by retention: "." + tag + DELETE_MARKER + id


# What readers call a group's fp32 master weights beside its optimizer states (ShardSource.read,
# universal tensor keys ``param/<name>/fp32``): no optimizer state may have this name.
MASTER_KEY = "fp32"


def state_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a partition-shaped optimizer state, or None when it can."""
    if not isinstance(name, str) or not name:
        return f"optimizer state name {name!r} is not a non-empty string"
    if "/" in name:
        return f"optimizer state name {name!r} holds '/'"
    if name == MASTER_KEY:
        return (
            f"an optimizer state is named {MASTER_KEY!r}, the name of the fp32 master weights: "
            "readers could not tell them apart"
        )
    return None


def rank_file_name(rank: int, world_size: int) -> str:
    """``rank-00003-of-00008.safetensors``: the file holding one rank's partitions."""
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def resume_file_name(rank: int, world_size: int) -> str:
    """``resume-00003-of-00008.json``: one rank's random state and user states (version 4)."""
    return f"resume-{rank:05d}-of-{world_size:05d}.json"


def fp32_key(group: int) -> str:
    """``group0.fp32``: a rank file's key for layout group ``group``'s fp32 master partition."""
    return f"group{group}.fp32"


def state_key(group: int, name: str) -> str:
    """``group0.state.exp_avg``: a rank file's key for a group's partition of optimizer state ``name``."""
    return f"group{group}.state.{name}"


def scalar_key(group: int, name: str) -> str:
    """``group0.scalar.step``: a rank file's key for a group's optimizer scalar ``name``."""
    return f"group{group}.scalar.{name}"


def temp_dir_name(tag: str, unique: str) -> str:
    """``.<tag>.tmp-<unique>``: the staging directory a save of ``tag`` writes before renaming it."""
    return f".{tag}{TEMP_MARKER}{unique}"


def old_dir_name(tag: str, unique: str) -> str:
    """``.<tag>.old-<unique>``: where a replaced ``tag`` waits to be deleted."""
    return f".{tag}{OLD_MARKER}{unique}"


def check_tag(tag: str) -> str:
    """A tag names a directory under the root: no separators, no leading dot, not 'latest'."""
    if not isinstance(tag, str) or not tag or tag.strip() != tag:
        raise ValueError(f"checkpoint tag {tag!r} must be a non-empty string without surrounding spaces")
    if "/" in tag or "\\" in tag or tag.startswith(".") or tag == LATEST_FILE or "\n" in tag:
        raise ValueError(f"checkpoint tag {tag!r} must not contain '/', start with '.', or be {LATEST_FILE!r}")
    return tag
