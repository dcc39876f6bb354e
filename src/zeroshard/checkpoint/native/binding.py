"""Rank files bound to their checkpoint: each says which layout, rank and experts it holds.

The sizes, headers and checksums of rank files do not say where they belong: a manifest whose
expert map was permuted, or whose layout was rebuilt at another EP with the same partition
sizes, reads them as something else. So every rank file's safetensors metadata carries its
*binding* (format version 2): the digest of the manifest layout it was written for, its rank
and world size, and per layout group its shard group, its rank and size there, and the global
expert ids it holds. Opening a rank file compares its binding with where the manifest puts
it and refuses, in one line, a file that does not belong there.

The layout digest is SHA-256 of the layout's JSON in canonical form (keys sorted, no spaces),
taken from the manifest as stored, so a later zeroshard that writes layouts differently
still recognises an older checkpoint's files.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

from ...layout import Layout
from ...layout.coordinates import ep_rank, shard_rank
from ...io import jsonvalue
from ...io.damage import CheckpointDamagedError

BINDING_KEY = "zeroshard.binding"  # the safetensors metadata key of a rank file's binding


def layout_digest(layout_dict: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of a layout's JSON (``Layout.to_dict()`` or the manifest's), canonical."""
    return hashlib.sha256(json.dumps(layout_dict, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def rank_binding(layout: Layout, digest: str, rank: int) -> dict[str, Any]:
    """What rank file ``rank`` of a checkpoint with ``layout`` (whose digest is ``digest``) holds."""
    groups = []
    for group in layout.groups:
        entry: dict[str, Any] = {
            "shard_group": group.shard_group,
            "shard_rank": shard_rank(group, rank),
            "shard_size": group.world_size,
        }
        if group.is_expert_group:
            entry["experts"] = list(group.expert_map[ep_rank(group, rank)])
        groups.append(entry)
    return {"layout": digest, "rank": rank, "world_size": layout.world_size, "groups": groups}


def binding_metadata(layout: Layout, digest: str, rank: int) -> dict[str, str]:
    """The safetensors metadata entry binding rank file ``rank`` to its checkpoint."""
    return {BINDING_KEY: json.dumps(rank_binding(layout, digest, rank), separators=(",", ":"))}


def check_binding(path: Path, metadata: Mapping[str, Any], layout: Layout, digest: str | None, rank: int) -> None:
    """Refuse (CheckpointDamagedError, one line naming ``path``) a rank file whose binding says
    it is not rank file ``rank`` of the checkpoint whose layout is ``layout`` (digest ``digest``).

    ``digest`` None: the manifest says format version 1, which wrote no bindings; a rank file
    that carries one was written by version 2, and its manifest edited to claim version 1
    (which would make every check of version 2 be skipped: digests, bindings): refused."""
    raw = metadata.get(BINDING_KEY)
    if digest is None:
        if raw is not None:
            raise CheckpointDamagedError(
                f"{path}: carries a {BINDING_KEY}, which only format version 2 writes, but the manifest says "
                "format version 1: a manifest may not claim an older version than its rank files"
            )
        return
    if not isinstance(raw, str):
        raise CheckpointDamagedError(
            f"{path}: no {BINDING_KEY} metadata; every rank file of a format version 2 checkpoint records where it belongs"
        )
    try:
        found = jsonvalue.loads(raw, path)
    except (json.JSONDecodeError, ValueError):
        raise CheckpointDamagedError(f"{path}: corrupted: its {BINDING_KEY} metadata is not valid JSON") from None
    problem = _difference(found, rank_binding(layout, digest, rank))
    if problem:
        raise CheckpointDamagedError(f"{path}: does not belong where the manifest puts it: {problem}")


def _difference(found: Any, expected: dict[str, Any]) -> str | None:
    if not isinstance(found, dict):
        return f"its binding is a {type(found).__name__}, not an object"
    if (found.get("rank"), found.get("world_size")) != (expected["rank"], expected["world_size"]):
        return (
            f"it is rank {_short(found.get('rank'))} of {_short(found.get('world_size'))}, the manifest reads it as rank "
            f"{expected['rank']} of {expected['world_size']}"
        )
    groups = found.get("groups")
    if not isinstance(groups, list) or len(groups) != len(expected["groups"]):
        count = len(groups) if isinstance(groups, list) else _short(groups)
        return f"it holds {count} layout groups, the manifest's layout has {len(expected['groups'])}"
    for index, (theirs, ours) in enumerate(zip(groups, expected["groups"])):
        if theirs != ours:
            return f"layout group {index}: it holds {_group_text(theirs)}, the manifest puts {_group_text(ours)} there"
    if found.get("layout") != expected["layout"]:
        return f"it was written for another layout (digest {_short(found.get('layout'), 20)}, the manifest's {expected['layout'][:16]})"
    return None


def _short(value: Any, limit: int = 40) -> str:
    """``repr(value)``, cut: a hostile file's values reach the error line only this long."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _group_text(entry: Any) -> str:
    if not isinstance(entry, dict):
        return _short(entry, 80)
    text = f"rank {_short(entry.get('shard_rank'))} of {_short(entry.get('shard_size'))} of shard group {_short(entry.get('shard_group'))}"
    experts = entry.get("experts")
    return text if experts is None else f"{text}, experts {_short(experts, 80)}"
