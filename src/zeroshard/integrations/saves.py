"""A framework's checkpoint folder with a zeroshard sharded checkpoint in it.

A trainer saves into a folder of its own (transformers' ``checkpoint-N/``, Accelerate's
``save_state`` directory, Lightning's ``epoch=0-step=4.ckpt/``) and writes its files there.
:class:`FolderSaves` adds the engine's state as the checkpoint tag ``zeroshard/`` with the
folder's ``latest`` naming it: every rank writes its own shard, asynchronously where the
Checkpointer can, and ``zeroshard inspect``, the converters and ``load_checkpoint`` take
the folder as they take any checkpoint root. A resume first checks, on every rank alike,
that the folder holds a committed zeroshard checkpoint (:func:`check_resumable`), so a
folder another trainer wrote (one rank's optimizer state in a single file) is refused
before anything loads. :func:`export_fp32` writes the model's fp32 weights into a folder,
for ``from_pretrained``.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from ..checkpoint.attest.attestation import Attestation
from ..checkpoint.checkpointer import USER_EXTRA_KEY, Checkpointer, SaveStats
from ..checkpoint.engine_io import load_checkpoint_attested, save_checkpoint
from ..checkpoint.export.fp32 import to_fp32
from ..checkpoint.format import LATEST_FILE, MANIFEST_FILE
from ..checkpoint.directory import read_latest
from ..comm import Collectives
from ..engine import ZeroOptimizer

log = logging.getLogger(__name__)

TAG = "zeroshard"  # the sharded checkpoint's tag inside a framework's folder
EXPORT_STAGING = ".zeroshard-export"  # hidden: the sharded state export_fp32 converts


class FolderSaves:
    """Sharded saves of one engine into framework folders, one save in flight at a time.

    Args:
        engine: the ZeroOptimizer whose state is saved.
        lr_scheduler: saved and restored with the state (its ``state_dict``), for frameworks
            that keep no scheduler file of their own.
        async_save: write in the background (the Checkpointer's snapshot), or before returning.

    The Checkpointer behind it is built at the first save (collective, as every save is) and
    closed by :meth:`close`.
    """

    def __init__(self, engine: ZeroOptimizer, *, lr_scheduler: Any = None, async_save: bool = True) -> None:
        self.engine = engine
        self.lr_scheduler = lr_scheduler
        self.async_save = async_save
        self._checkpointer: Checkpointer | None = None

    def save(self, folder: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> SaveStats:
        """Collective. Save the engine as ``<folder>/zeroshard`` (``<folder>/latest`` names it),
        every rank its shard; ``extra`` (JSON-able) comes back from :meth:`load`. Returns once
        this rank's state is copied (asynchronous) or written; a failure is raised on every
        rank by the next save, :meth:`wait` or :meth:`close`."""
        folder = Path(folder)
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(
                self.engine, folder, keep_last=None, async_save=self.async_save, lr_scheduler=self.lr_scheduler
            )
        return self._checkpointer.save(self.engine.global_steps, extra, root=folder, tag=TAG)

    def wait(self) -> SaveStats | None:
        """Wait for the save in flight (raising its error on every rank); its stats, or None."""
        return self._checkpointer.wait() if self._checkpointer is not None else None

    def close(self) -> None:
        """Collective. Wait for the last save and release the Checkpointer (a later save makes a new one)."""
        if self._checkpointer is not None:
            checkpointer, self._checkpointer = self._checkpointer, None
            checkpointer.close()

    def load(
        self, folder: str | os.PathLike[str], *, load_optimizer_states: bool = True
    ) -> tuple[dict[str, Any], Attestation]:
        """Collective. Load ``<folder>/zeroshard`` into the engine at this world size (and EP),
        with the lr scheduler's state when one was saved; returns the ``extra`` given to
        :meth:`save` and the attestation (``.line()`` says what the load proved).

        Raises:
            ValueError, CheckpointDamagedError: on every rank, as ``load_checkpoint``; nothing changes then.
        """
        self.wait()
        saved, attestation = load_checkpoint_attested(
            self.engine,
            Path(folder) / TAG,
            load_optimizer_states=load_optimizer_states,
            lr_scheduler=self.lr_scheduler if load_optimizer_states else None,
        )
        return dict(saved.get(USER_EXTRA_KEY) or {}), attestation


def committed(folder: Path) -> bool:
    """Whether ``folder`` holds a finished zeroshard save: ``latest`` names ``zeroshard`` and
    its manifest is there (a save cut short has neither)."""
    try:
        return read_latest(folder) == TAG and (folder / TAG / MANIFEST_FILE).is_file()
    except (OSError, ValueError):
        return False


def resume_problem(folder: Path, foreign: Callable[[Path], str | None]) -> str | None:
    """Why ``folder`` cannot be resumed from, in one line (None when it can). ``foreign(folder)``
    names what another trainer left there (a stock trainer's optimizer file, or a single-file
    checkpoint where a folder belongs), if anything."""
    if committed(folder):
        return None
    other = foreign(folder)
    if other is not None:
        return other
    if not folder.is_dir():
        return f"{folder}: no such checkpoint folder"
    return (
        f"{folder}: holds no zeroshard checkpoint ({TAG}/ named by {LATEST_FILE}): its save did not finish, "
        "or another program wrote the folder; resume from an earlier checkpoint"
    )


def check_resumable(folder: Path, foreign: Callable[[Path], str | None], process_group: Any = None) -> None:
    """Collective over ``process_group`` (the default group; a world of one without one):
    every rank checks ``folder`` and the ranks agree, before anything is loaded.

    Raises:
        ValueError: on every rank, the one line of :func:`resume_problem` (of the first rank
            that found one).
    """

    def check() -> None:
        problem = resume_problem(folder, foreign)
        if problem is not None:
            raise ValueError(problem)

    Collectives(process_group).checked(f"resume from {folder}", check)


def newest_committed(output_dir: Path, prefix: str) -> Path | None:
    """The ``<prefix><N>`` folder of ``output_dir`` with the largest N that holds a finished
    zeroshard save (a newer one whose save was cut short is passed over), or None."""
    if not output_dir.is_dir():
        return None
    steps = []
    for entry in output_dir.iterdir():
        number = entry.name[len(prefix) :]
        if entry.name.startswith(prefix) and number.isdigit() and committed(entry):
            steps.append((int(number), entry))
    return max(steps)[1] if steps else None


def export_fp32(engine: ZeroOptimizer, folder: str | os.PathLike[str]) -> list[str]:
    """Collective. Write the model's fp32 weights into ``folder`` as ``to_fp32`` writes them
    (``model.safetensors``, or shards and their index; the model's own names, every expert),
    replacing an earlier export there and leaving the folder's other files alone. The state
    is saved to a hidden staging checkpoint in ``folder`` and converted by rank 0. Returns the
    names of the files written (on every rank).

    Raises:
        OSError, ValueError: on every rank, when the save or the conversion failed on any;
            the staging is removed and earlier files stay.
    """
    folder = Path(folder)
    staging = folder / EXPORT_STAGING
    save_checkpoint(engine, staging, tag="state")
    written: list[str] = []
    error: Exception | None = None
    if engine.rank == 0:
        try:
            written = _convert_into(staging, folder)
        except (OSError, ValueError) as err:
            error = err
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    engine.comm.agree(f"export_fp32({folder})", error)
    return engine.comm.all_gather_object(written)[0]


def _convert_into(staging: Path, folder: Path) -> list[str]:
    exported = to_fp32(staging / "state", staging / "fp32", progress=False)
    names = sorted(entry.name for entry in exported.iterdir())
    for stale in folder.glob("model*.safetensors*"):  # an earlier export's shards the new one does not replace
        if stale.name not in names and stale.is_file():
            stale.unlink()
    for name in names:
        os.replace(exported / name, folder / name)
    return names
