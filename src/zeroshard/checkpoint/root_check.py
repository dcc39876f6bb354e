"""What a Checkpointer root may hold: its own tags and ``latest``, and nothing that is a
checkpoint of another kind.

A root holding a universal or DeepSpeed checkpoint, an fp32 export, or that is itself a tag
directory would otherwise look empty to the Checkpointer: ``load()`` would return 0, the run
would start from scratch and write its tags beside (or into) what is there. Such a root is
refused instead, in one line that says how to start from what it holds: a checkpoint of any
kind ``load_checkpoint`` reads is a warm start, ``Checkpointer.load(warm_start=PATH)`` with a
root of the Checkpointer's own; an fp32 export holds weights only, loaded into the model
before the engine is built. File names only: nothing is opened.
"""

from __future__ import annotations

from pathlib import Path

from .export.fp32 import is_fp32_export
from .format import MANIFEST_FILE
from .formats import NATIVE, recognise


def foreign_root_problem(root: Path) -> str | None:
    """Why ``root`` cannot be a Checkpointer root, in one line; None when it is absent,
    empty, or holds the Checkpointer's own tags (or anything that is not a checkpoint)."""
    if not root.exists():
        return None
    if not root.is_dir():
        return f"checkpoint root {root}: exists and is not a directory"
    if (root / MANIFEST_FILE).is_file():
        return f"checkpoint root {root}: is a checkpoint tag, not a root of tags; give the Checkpointer its parent"
    if is_fp32_export(root):
        return (
            f"checkpoint root {root}: holds an fp32 export (to-fp32 output: model weights only), not checkpoints of "
            "the Checkpointer's own; load it into the model before building the engine "
            "(model.load_state_dict(safetensors.torch.load_file(...))) and give the Checkpointer another root"
        )
    found = recognise(root)
    if found is None or found.kind == NATIVE:
        return None
    what = found.description or f"{found.kind} checkpoint"
    return (
        f"checkpoint root {root}: holds a {what}, not checkpoints of the Checkpointer's own; to start from it, "
        f"give the Checkpointer another root and call load(warm_start={str(root)!r})"
    )


def warm_start_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a warm start, in one line; None when ``load_checkpoint`` may try
    it (it checks the rest). An fp32 export holds weights only."""
    if is_fp32_export(path):
        return (
            f"warm start {path}: an fp32 export (to-fp32 output) holds model weights only, no optimizer state; "
            "load it into the model before building the engine (model.load_state_dict(safetensors.torch.load_file(...)))"
        )
    return None
