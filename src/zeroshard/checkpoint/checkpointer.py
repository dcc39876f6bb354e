"""Checkpointer: periodic saves that barely stall training, retention, and resume.

    ckpt = Checkpointer(engine, "runs/ckpt", lr_scheduler=sched, state={"data": loader})
    start = ckpt.load()                    # ResumePoint: the step to run next (0, or the saved step + 1)
    for step in range(start, total):
        ...forward, engine.backward(loss)...
        ckpt.report_loss(loss)             # optional: the audit compares it too
        engine.step(); sched.step()
        if step % 100 == 0:
            ckpt.save(step, extra={...})   # the step just completed; returns once snapshotted
    ckpt.close()                           # waits for the last save, reports its error if any

Every save also records every rank's random state and the registered states (the data
position) in resume files (:mod:`.run_state`), and the first step after it into an audit
record beside the checkpoint; every load restores them, and the first step after it is
compared with that record (:mod:`.audit`).

An asynchronous save copies this rank's state into a reusable host buffer
(:class:`~.snapshot.HostSnapshot`) and returns; a writer thread (:mod:`.async_save`) then
runs the save's plan, write and commit (:mod:`.save`). The write (CRC, bytes, fsync)
releases the GIL. Every collective of a save runs on a gloo process group the Checkpointer
makes at construction (collectively) and destroys in :meth:`Checkpointer.close`, so none
interleaves with training's. One save is in flight at a time: the next
:meth:`~Checkpointer.save` first waits for the previous one. The ranks agree on each save's
outcome inside its collectives, so an error on any rank is raised on every rank, by the
next ``save``, ``wait`` or ``close``; ``latest`` only ever names a committed checkpoint.
"""

from __future__ import annotations

import atexit
import copy
import datetime
import functools
import logging
import os
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from .async_save import BackgroundWriter
from .audit import Verdict
from .coordinator import Coordinator, SingleProcessCoordinator, TorchDistributedCoordinator
from .attest.attestation import Attestation
from .exact_resume import ExactResume, ResumePoint
from .engine_io import LR_SCHEDULER_KEY, load_checkpoint_attested
from .resume import decided_on_rank0, load_newest, plan_resume
from .retention import apply_retention, step_tag
from .root_check import foreign_root_problem, warm_start_problem
from .native.save import FaultHook, commit_save, plan_save, write_rank_files
from .snapshot import HostSnapshot

if TYPE_CHECKING:
    from ..engine import ZeroOptimizer
    from ..state import ShardedState

log = logging.getLogger(__name__)

STEP_KEY = "step"  # extra: the training loop's step the checkpoint was saved after
USER_EXTRA_KEY = "user"  # extra: what the training script passed to save(extra=...)


class CheckpointSaveError(RuntimeError):
    """A save failed (on this rank or another); ``latest`` still names the previous checkpoint."""


@dataclass
class SaveStats:
    """What one save cost. ``stall_s`` is the time :meth:`Checkpointer.save` blocked the
    training loop: ``waited_s`` for the previous save, then ``snapshot_s`` copying the state
    (for a synchronous save, the whole save). ``write_s`` (plan, write, commit, retention)
    is known once the save is done."""

    tag: str
    step: int
    root: Path | None = None  # where the save goes: the Checkpointer's root unless save() named another
    waited_s: float = 0.0
    snapshot_s: float = 0.0
    stall_s: float = 0.0
    write_s: float | None = None
    path: Path | None = None
    deleted: tuple[str, ...] = ()  # tags retention removed (rank 0)


class Checkpointer:
    """Saves a ZeRO run every so often under ``root``, keeps the newest, resumes from ``latest``.

    Args:
        engine: the ZeroOptimizer whose state is saved and loaded.
        root: the directory holding the checkpoints (``step-<step>`` tags and ``latest``).
        keep_last: keep this many newest checkpoints (None: keep all). Older ones are deleted
            only after a newer one is committed, never the one ``latest`` names.
        keep_every: also keep every checkpoint whose step is a multiple of this.
        async_save: snapshot and write in the background (True), or save before returning.
        lr_scheduler: saved and restored with the run (its ``state_dict``).
        timeout_s: how long a save's collectives wait for the other ranks.
        fault: ``fault(point, rank)`` at the save's fault points (tests simulate crashes).
        rng: save every rank's random state (torch CPU and CUDA, Python, NumPy) and restore it
            at load; False leaves the resumed run's streams its own.
        state: objects with ``state_dict()`` / ``load_state_dict()`` (a torchdata
            ``StatefulDataLoader``, a sampler, the script's own iterator), by name, each rank
            saving and restoring its own: saved with every checkpoint (as JSON: tensors come
            back as torch tensors), restored by :meth:`load`. At another world size rank r
            takes saved rank ``r mod D_old``'s.
        global_state: the same for states equal on every rank (a global sample position):
            rank 0's is saved, and every rank gets it back at any world size.
        audit: record the first step after each save and compare the first step after a
            resume with it (True); ``"strict"`` raises :class:`~.audit.ResumeAuditError`
            instead of warning, and when the checkpoint has no record; False does neither.
        fallback: when the checkpoint to resume is damaged (its directory or a file missing,
            a link, truncated or corrupted, its manifest unreadable, or its attestation fails),
            :meth:`load` resumes from the newest older ``step-*`` checkpoint that loads and
            attests, warns which and why, and renames each damaged one it passed over
            ``<tag>.damaged`` (kept for inspection; the resumed run saves that step again).
            Off by default: resuming from an older step costs the steps since, and can hide a
            failing disk; a run that turns it on should watch for the warning.

    Construction and :meth:`close` are collective (they create and destroy the gloo group),
    as are :meth:`load` and :meth:`save`. Use it as a context manager, or call :meth:`close`.

    Raises:
        ValueError: on every rank, at construction, when ``root`` holds a checkpoint of another
            kind (universal, DeepSpeed, an fp32 export) or is itself a tag directory: such a
            root is never silently treated as empty. Start from it with ``load(warm_start=...)``.
    """

    def __init__(
        self,
        engine: ZeroOptimizer,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        async_save: bool = True,
        lr_scheduler: Any = None,
        timeout_s: float = 1800.0,
        fault: FaultHook | None = None,
        fallback: bool = False,
        rng: bool = True,
        state: Mapping[str, Any] | None = None,
        global_state: Mapping[str, Any] | None = None,
        audit: bool | str = True,
    ) -> None:
        for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        self._exact = ExactResume(engine, rng=rng, states=state, global_states=global_state, audit=audit, say=_say)
        self.engine = engine
        self.root = Path(root)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.lr_scheduler = lr_scheduler
        self.extra: dict[str, Any] = {}  # the user extra of the checkpoint load() resumed from
        self.fallback = fallback
        self.attestation: Attestation | None = None  # of the checkpoint load() loaded
        self.resumed_from: Path | None = None  # the checkpoint load() loaded, if any
        self.history: list[SaveStats] = []
        self._fault = fault
        self._buffer_names = [name for name, _ in engine.model.named_buffers()]
        self._snapshot = HostSnapshot(pin_memory=engine.device.type == "cuda")
        self._writer: BackgroundWriter[SaveStats] = BackgroundWriter()
        self._group, self._coord = _coordination_group(engine, timeout_s)
        self._closed = False
        # A script that exits with a save in flight: the daemon writer would die with the
        # interpreter, so the exit waits for it (and fails loudly if it failed).
        self._exit_hook = functools.partial(_finish_at_exit, weakref.ref(self))
        atexit.register(self._exit_hook)
        self._refuse_foreign_root()  # closes (and unregisters the hook) before it raises

    # ---- public API ---------------------------------------------------------------------------

    def load(self, warm_start: str | os.PathLike[str] | None = None) -> ResumePoint:
        """Collective. Resume from the checkpoint ``latest`` names, resharding to this run's
        world size and policy; without ``latest``, from the newest ``step-*`` checkpoint (with
        a warning: a root holding checkpoints is never taken for empty); without either, from
        ``warm_start`` if given (a native, universal or DeepSpeed ZeRO-1/2 checkpoint
        elsewhere: a DeepSpeed run carried on), else nothing is changed.

        Returns a :class:`~.exact_resume.ResumePoint`, an int: the step to run next, named
        ``.next_step``; ``.saved_step`` is the step passed to ``save()`` (the step just
        completed), so ``next_step == saved_step + 1``. For a checkpoint not saved by a
        Checkpointer, the optimizer steps it had taken; 0 when nothing was resumed. Start the
        loop at it (``range(ckpt.load(), total)``), not one after.

        Every rank also gets its random state and registered states back (at another world
        size by the rule in :mod:`.run_state`), and the first step is armed for the audit.
        Sets :attr:`extra`, :attr:`resumed_from` and :attr:`attestation` (``.line()`` says
        what the load proved), and says on rank 0 what it loaded, proved and restored (logged
        at INFO, or printed to stderr when logging is not configured). Rank 0 reads the root;
        every rank gets its verdict.

        Raises:
            CheckpointDamagedError: on every rank, when the checkpoint is damaged (its tag
                missing, a symbolic link, a file missing, truncated or corrupted, or its
                attestation fails) and ``fallback`` is off or no older checkpoint loads; with
                ``fallback``, the newest older ``step-*`` checkpoint that loads is taken instead
                (with a warning).
            ValueError: on every rank, when the checkpoint cannot be loaded (nothing changed),
                a ``step-*`` checkpoint newer than the one ``latest`` names is there (the
                resumed run would save over it), ``warm_start`` is an fp32 export (weights
                only: load it into the model), a state is registered with another scope than
                it was saved with, or a registered state's ``load_state_dict`` failed.
            ResumeAuditError: ``audit="strict"`` and the checkpoint has no usable audit record.
        """
        self._check_open()
        self.wait()
        plan = decided_on_rank0(self._coord, lambda: plan_resume(self.root, self.fallback))
        if plan.note is not None and self._coord.rank == 0:
            log.warning("%s", plan.note)
        if not plan.candidates and warm_start is None:
            self._exact.fresh_start()
            return ResumePoint(0)
        if plan.candidates:
            saved, path, self.attestation, prepared = load_newest(
                self.engine,
                self.root,
                plan,
                self._coord,
                fallback=self.fallback,
                lr_scheduler=self.lr_scheduler,
                prepare=lambda tag: self._exact.prepare(tag, self._coord),
            )
        else:
            path = Path(warm_start)
            problem = decided_on_rank0(self._coord, lambda: warm_start_problem(path))
            if problem is not None:
                raise ValueError(problem)
            prepared = self._exact.prepare(path, self._coord)
            saved, self.attestation = load_checkpoint_attested(self.engine, path, lr_scheduler=self.lr_scheduler)
        self.extra = dict(saved.get(USER_EXTRA_KEY) or {})
        self.resumed_from = path
        saved_step = int(saved[STEP_KEY]) if STEP_KEY in saved else None
        start = saved_step + 1 if saved_step is not None else int(saved.get("global_steps", 0))
        restored = self._exact.finish(prepared, self._coord, path, start)
        if self._coord.rank == 0:
            how = "resumed" if plan.candidates else f"warm start (no checkpoint in {self.root} yet)"
            _say(f"{how} from {path}: training goes on at step {start}; {self.attestation.line()}; {restored}")
        return ResumePoint(start, saved_step, path)

    def report_loss(self, loss: Any, terms: int | None = None) -> None:
        """Not collective. Tell the resume audit this rank's loss of the step about to be
        taken: call it between the forward pass and ``engine.step()``, every step (it is
        ignored, at no cost, unless the step is audited; several calls in a step, one per
        micro-batch, are averaged). ``terms``: how many samples (tokens, for a per-token mean)
        the loss averages; with it, the first step after a resume at another world size is
        judged within the bound of :func:`~.audit.relative_bound`."""
        self._exact.steps.report_loss(loss, terms)

    @property
    def audit_verdict(self) -> Verdict | None:
        """The audit's verdict on the first step after :meth:`load` (None until it ran, or
        without a record to compare with): ``.causes`` names what differs, ``.line()`` says it."""
        return self._exact.verdict

    def save(
        self,
        step: int,
        extra: dict[str, Any] | None = None,
        *,
        root: str | os.PathLike[str] | None = None,
        tag: str | None = None,
    ) -> SaveStats:
        """Collective. Save the run as ``step-<step>``: ``step`` is the training-loop step just
        completed (the state after it), so :meth:`load` returns ``step + 1``, the step to run
        next. A step that does not follow the engine's steps since the last save or load is
        warned about once (a loop that saves ``step + 1`` resumes a step late; saves with a
        ``root`` or ``tag`` of their own are not counted). Never over a
        checkpoint: a ``step-<step>`` that exists fails the save on every rank before
        anything is written. Every rank's random state and registered states are taken now.

        Waits for the previous save first (raising its error, if any). Asynchronous: returns
        once this rank's state is copied to host memory; :meth:`wait` for the outcome.
        ``extra`` (JSON-able) comes back as :attr:`extra` after :meth:`load`.

        ``root`` and ``tag`` save elsewhere: as ``<root>/<tag>`` with its own ``<root>/latest``
        (a trainer's ``checkpoint-N/`` folder holding one checkpoint beside the trainer's own
        files). Retention applies to the Checkpointer's root only, and :meth:`load` reads only that.
        """
        started = time.perf_counter()
        self._check_open()
        self.wait()
        target = self.root if root is None else Path(root)
        stats = SaveStats(tag or step_tag(step), step, target, waited_s=time.perf_counter() - started)
        if root is None and tag is None:  # load() resumes the Checkpointer's own step-* tags only
            self._exact.before_save(step)
        snapshot_start = time.perf_counter()
        state, problem = self._take_state(step, extra)
        stats.snapshot_s = time.perf_counter() - snapshot_start
        self.history.append(stats)
        self._exact.after_save(lambda: stats.path, stats.step, self._coord.rank, self._writer.after)
        if self.async_save:
            self._writer.submit(stats, functools.partial(self._run_save, stats, state, problem))
        else:
            try:
                self._run_save(stats, state, problem)
            except (OSError, ValueError) as err:
                raise CheckpointSaveError(_not_saved(stats.root / stats.tag, err)) from err
        stats.stall_s = time.perf_counter() - started
        return stats

    def wait(self) -> SaveStats | None:
        """Wait for the save in flight; returns its stats (None if there was none). Raises
        :class:`CheckpointSaveError` on every rank if it failed on any."""
        finished = self._writer.finish()
        if finished is None:
            return None
        stats, error = finished
        if error is not None:
            raise CheckpointSaveError(_not_saved(stats.root / stats.tag, error)) from error
        return stats

    @property
    def snapshot_bytes(self) -> int:
        """Host memory the reusable snapshot buffer holds (0 before the first async save)."""
        return self._snapshot.nbytes

    @property
    def in_flight(self) -> bool:
        """A background save is still being written."""
        return self._writer.writing

    def close(self) -> None:
        """Collective. Wait for the last save (raising its error), free the host buffer and
        destroy the gloo group. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            atexit.unregister(self._exit_hook)
            self._exact.close()
            self._writer.stop()
            self._snapshot.release()
            if self._group is not None:
                import torch.distributed as dist

                dist.destroy_process_group(self._group)
                self._group = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Checkpointer is closed")

    def _take_state(self, step: int, extra: dict[str, Any] | None) -> tuple[ShardedState | None, str | None]:
        """This rank's state to save, or the reason it has none (then every rank's save
        fails in the plan's agreement, instead of this rank alone raising here)."""
        try:
            if self.async_save:
                state = self._snapshot.take(self.engine.state_views(), with_model=self.engine.rank == 0)
            else:
                state = self.engine.export_state()
            if self.lr_scheduler is not None:
                state.extra[LR_SCHEDULER_KEY] = _copied(self.lr_scheduler.state_dict())
            state.extra[STEP_KEY] = step
            state.extra[USER_EXTRA_KEY] = _copied(extra or {})
            state.resume = self._exact.capture()
            return state, None
        except Exception as err:  # noqa: BLE001 - reported on every rank by the agreement
            return None, f"taking the state failed: {type(err).__name__}: {err}"

    def _run_save(self, stats: SaveStats, state: ShardedState | None, problem: str | None) -> None:
        """Plan, write and commit one save (collective on the gloo group), then retention."""
        started = time.perf_counter()
        plan = plan_save(stats.root, stats.tag, state, self._coord, problem=problem, replace=False)
        assert state is not None  # plan_save raised on every rank otherwise

        def retain() -> None:  # rank 0, still holding the root's lock
            stats.deleted = self._apply_retention(stats.tag)

        try:
            written = write_rank_files(plan, state, self._buffer_names, self._coord, self._fault)
            after_publish = retain if stats.root == self.root else None
            stats.path = commit_save(plan, state, written, self._coord, self._fault, after_publish=after_publish)
        finally:
            plan.release()
        stats.write_s = time.perf_counter() - started

    def _apply_retention(self, committed: str) -> tuple[str, ...]:
        """Rank 0 deletes old tags, under the root's writer lock, reading ``latest`` there: a
        second writer on the root cannot move it meanwhile. A failure here is only logged:
        the checkpoint is committed, and an error that rank 0 alone raised at the next save
        would leave the other ranks waiting for it in the save's first collective."""
        try:
            return tuple(apply_retention(self.root, committed, self.keep_last, self.keep_every))
        except Exception as err:  # noqa: BLE001 - see above
            log.warning("%s: retention after %s failed, old tags kept: %s", self.root, committed, err)
            return ()

    def _refuse_foreign_root(self) -> None:
        """Collective: rank 0 looks at the root; a root of another kind fails every rank."""
        problem = None
        if self._coord.rank == 0:
            try:
                problem = foreign_root_problem(self.root)
            except OSError as err:
                problem = f"checkpoint root {self.root}: {err}"
        problem = self._coord.broadcast_object(problem)
        if problem is not None:
            self.close()
            raise ValueError(problem)


def _say(line: str) -> None:
    """What the resume did, where the user sees it: logged at INFO where logging is configured
    (a handler on the way up from this logger), else printed to stderr."""
    if log.hasHandlers():
        log.info("%s", line)
    else:
        print(f"zeroshard: {line}", file=sys.stderr, flush=True)


def _finish_at_exit(ref: weakref.ref[Checkpointer]) -> None:
    """At interpreter exit: finish the save in flight (the daemon writer would be killed
    mid-save, silently); if it fails, say so on stderr and exit with status 1."""
    ckpt = ref()
    if ckpt is None or ckpt._closed or ckpt._writer.in_flight is None:
        return
    stats = ckpt._writer.in_flight
    print(
        f"zeroshard: exiting with a checkpoint save in flight: finishing the save of {stats.root / stats.tag} "
        "(call Checkpointer.close() before exiting)",
        file=sys.stderr,
        flush=True,
    )
    try:
        ckpt.wait()
    except CheckpointSaveError as err:
        print(f"zeroshard: error: {err}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # the exit status is fixed by now otherwise; a lost save must not read as success


def _not_saved(path: Path, error: BaseException) -> str:
    prefix = f"checkpoint {path} not saved: "
    text = f"{error}" if isinstance(error, (OSError, ValueError)) else f"{type(error).__name__}: {error}"
    return text if text.startswith(prefix) else prefix + text


def _copied(value: Any) -> Any:
    return copy.deepcopy(value)  # the save reads it later, after training changed the original


def _coordination_group(engine: ZeroOptimizer, timeout_s: float) -> tuple[Any, Coordinator]:
    """A gloo group over the engine's ranks, for the saves' collectives alone."""
    if engine.world_size == 1:
        return None, SingleProcessCoordinator()
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if engine.comm.group is None:
        group = dist.new_group(backend="gloo", timeout=timeout)
    else:  # a data-parallel subgroup: only its members take part
        ranks = dist.get_process_group_ranks(engine.comm.group)
        group = dist.new_group(ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)
    return group, TorchDistributedCoordinator(group)
