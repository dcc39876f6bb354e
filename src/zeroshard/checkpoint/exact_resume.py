"""What a Checkpointer's load adds to the engine's state, so that a run goes on as if it never stopped.

* :class:`ResumePoint`: ``load()``'s value, the step to run next, named so;
* :func:`prepare_resume` (collective, before the engine's state is loaded): every rank reads
  and checks the resume files it needs (:mod:`.run_state`), and rank 0 the audit record
  beside the checkpoint (:mod:`.audit`), so damage falls back before anything changes;
* :func:`finish_resume` (collective, after it): every rank restores its random streams and
  the registered states, and the audit is armed for the first step;
* :class:`StepNumbers`: the check that the steps passed to ``save()`` follow the engine's
  steps (a loop that resumes one step late, or saves ``step + 1``, is told once);
* :class:`ExactResume`: all of it, as one Checkpointer holds it.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..state import ResumeState
from . import run_state
from .audit import (
    Expectation,
    ResumeAuditError,
    ResumeAuditWarning,
    StepRecord,
    Verdict,
    read_record,
    record_missing,
    write_record,
)
from .audit_step import StepAudit, expected_state
from .rng import rng_fingerprint
from .coordinator import Coordinator
from .formats import NATIVE, checkpoint_kind
from .native.handle import open_checkpoint
from .native.manifest import ResumeRecord
from .resume import agreed_on_every_rank, decided_on_rank0

if TYPE_CHECKING:
    from ..engine import ZeroOptimizer

log = logging.getLogger("zeroshard.checkpoint.checkpointer")


class ResumePoint(int):
    """What :meth:`Checkpointer.load` resumed: the int itself is :attr:`next_step`, the step
    the training loop runs next; :attr:`saved_step` is the step the checkpoint was saved
    after (``save(step)``'s ``step``; None when nothing was resumed or a checkpoint of
    another kind was), :attr:`path` the checkpoint (None when nothing was loaded)."""

    saved_step: int | None
    path: Path | None

    def __new__(cls, next_step: int, saved_step: int | None = None, path: Path | None = None) -> ResumePoint:
        point = super().__new__(cls, next_step)
        point.saved_step, point.path = saved_step, path
        return point

    @property
    def next_step(self) -> int:
        """The step to run next: ``saved_step + 1``, or 0 for a fresh start."""
        return int(self)

    def __repr__(self) -> str:
        return f"ResumePoint(next_step={int(self)}, saved_step={self.saved_step}, path={self.path})"

    __str__ = int.__repr__  # print(ckpt.load()) and f"{...}" show the number, as before


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare_resume` read: this rank's restore, the audit's expectation or why none."""

    restore: run_state.RestorePlan | None
    saved: ResumeRecord | None
    expectation: Expectation | None
    audit_note: str | None
    audit_damaged: bool = False  # the record is there but damaged (a warning), not just missing

def prepare_resume(
    path: Path, engine: ZeroOptimizer, coord: Coordinator, scopes: Mapping[str, str], rng: bool, audit: bool
) -> Prepared:
    """Collective: read what the resume restores besides the engine's state. A state the run
    registers with another scope than the checkpoint's is a ValueError on every rank;
    damage of a resume file a CheckpointDamagedError on every rank (the fallback's)."""
    if checkpoint_kind(path) != NATIVE:  # a warm start from a universal or DeepSpeed checkpoint
        return Prepared(None, None, None, "a checkpoint of another kind has no audit record")

    def read() -> tuple[run_state.RestorePlan | None, ResumeRecord | None]:
        checkpoint = open_checkpoint(path)
        saved = checkpoint.manifest.resume
        _check_scopes(path, saved, scopes)
        return run_state.read_for_rank(checkpoint, engine.rank, engine.world_size), saved

    restore, saved = agreed_on_every_rank(coord, read)
    expectation, note, damaged = None, None, False
    if audit:
        restored = bool(rng and saved is not None and saved.rng and restore is not None and not restore.derive)
        restored = restored and restore.saved_world_size == engine.world_size  # type: ignore[union-attr]
        expectation, note, damaged = decided_on_rank0(coord, lambda: _expectation(path, restored))
    return Prepared(restore, saved, expectation, note, damaged)


def _check_scopes(path: Path, saved: ResumeRecord | None, scopes: Mapping[str, str]) -> None:
    if saved is None:
        return
    for name, scope in scopes.items():
        if name in saved.states and saved.states[name] != scope:
            kind = {"rank": "per rank (state=)", "global": "global (global_state=)"}
            raise ValueError(
                f"{path} saved state {name!r} {kind[saved.states[name]]}, this run registers it {kind[scope]}: "
                "register it as it was saved"
            )


def _expectation(path: Path, rng_restored: bool) -> tuple[Expectation | None, str | None, bool]:
    """On rank 0: the saved run's record and what the manifest's digests say the state is;
    else why not, and whether the record is damaged (not just missing)."""
    record, note = read_record(path)
    if record is None:
        return None, note, not record_missing(path)
    manifest = open_checkpoint(path).manifest
    if manifest.digests is None:
        return None, f"{path} has no digests (format version 1)", False
    kinds, state_terms, scalars = expected_state(manifest)
    return Expectation(str(path), record, kinds, state_terms, scalars, rng_restored), None, False


def finish_resume(
    prepared: Prepared,
    coord: Coordinator,
    rng: bool,
    states: Mapping[str, Any],
    global_states: Mapping[str, Any],
    path: Path,
) -> str:
    """Collective: restore every rank's random streams and registered states (an error in a
    state's ``load_state_dict`` on any rank is a ValueError on every rank). Returns what was
    restored, for the resume line; says on rank 0, once, what the checkpoint lacks."""
    restore, saved = prepared.restore, prepared.saved
    wanted = rng or states or global_states
    if restore is None or saved is None:
        if wanted and coord.rank == 0:
            log.warning(
                "%s holds no random state or data position (saved by an older zeroshard, by save_checkpoint, or with "
                "rng=False and no states): this run goes on from its own random streams and data position",
                path,
            )
        return "no random state or states restored (none saved)"
    agreed_on_every_rank(coord, lambda: restore.apply(rng, states, global_states))
    registered = {**{n: "rank" for n in states}, **{n: "global" for n in global_states}}
    fresh = sorted(set(registered) - set(saved.states))
    dropped = sorted(set(saved.states) - set(registered))
    if coord.rank == 0 and (fresh or dropped):
        said = [f"holds no state {', '.join(map(repr, fresh))} (it starts fresh)"] if fresh else []
        if dropped:
            said.append(f"holds state {', '.join(map(repr, dropped))}, which this run does not register (not restored)")
        log.warning("%s: %s", path, "; ".join(said))
    parts = (["the random state"] if rng and saved.rng else []) + [repr(n) for n in registered if n in saved.states]
    what = parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}" if parts else "nothing"
    return f"restored {what}: {restore.rule()}"


class StepNumbers:
    """Checks that each ``save(step)`` is the step just completed: the previous save's step
    (or ``load()``'s next step minus one) plus the engine's steps since. Warns once."""

    def __init__(self) -> None:
        self._last: int | None = None  # the step completed when the counting started
        self._since: str = ""
        self._warned = False

    def start(self, completed: int, since: str) -> None:
        """Count from here: ``completed`` is the step just completed (-1 before step 0)."""
        self._last, self._since = completed, since

    def check(self, step: int, engine_steps: int) -> None:
        """Called by ``save(step)`` with the engine's step() calls since :meth:`start`."""
        expected = None if self._last is None else self._last + engine_steps
        if expected is not None and step != expected and not self._warned:
            self._warned = True
            log.warning(
                "Checkpointer.save(%d): the engine stepped %d time(s) since %s, so the step just completed is %d: "
                "save(step) takes the training-loop step just completed, and load() returns the step to run next. A "
                "loop that saves step + 1, or starts at load() + 1, resumes a step late",
                step,
                engine_steps,
                self._since,
                expected,
            )
        self.start(step, f"the save of step {step}")


class ExactResume:
    """A Checkpointer's exact-resume part: the resume state it saves, restores and audits.

    Holds the registered states, the step hooks (:class:`~.audit_step.StepAudit`) and the
    step-number check; the Checkpointer calls it at each save and load.
    """

    def __init__(
        self,
        engine: ZeroOptimizer,
        *,
        rng: bool,
        states: Mapping[str, Any] | None,
        global_states: Mapping[str, Any] | None,
        audit: bool | str,
        say: Callable[[str], None],
    ) -> None:
        if audit not in (True, False, "strict"):
            raise ValueError(f"audit must be True, False or 'strict', got {audit!r}")
        self.states = run_state.check_stateful(states or {}, "state")
        self.global_states = run_state.check_stateful(global_states or {}, "global_state")
        both = sorted(set(self.states) & set(self.global_states))
        if both:
            raise ValueError(f"state and global_state both name {both[0]!r}: a state is per rank or global, not both")
        self.engine, self.rng, self.audit, self._say = engine, bool(rng), audit, say
        self.verdict: Verdict | None = None  # of the first step after the last load, once it ran
        self.steps = StepAudit(engine, self.states, self.global_states)  # hooks: counts steps, audits
        self._numbers = StepNumbers()
        self._resumed: Path | None = None
        self._rng_now: int | None = None  # the fingerprint of the random state the last capture took

    def capture(self) -> ResumeState | None:
        """This rank's resume state for a save now (None: nothing to save beside the state)."""
        self._rng_now = None
        if not (self.rng or self.states or self.global_states):
            return None
        resume = run_state.capture(self.rng, self.states, self.global_states)
        self._rng_now = rng_fingerprint(resume.rng) if resume.rng is not None else None
        return resume

    def before_save(self, step: int) -> None:
        """``save(step)`` begins: check its step number against the engine's steps."""
        self._numbers.check(step, self.steps.step_calls)
        self.steps.step_calls = 0

    def after_save(
        self, committed: Callable[[], Path | None], step: int, rank: int, schedule: Callable[[Callable[[], None]], None]
    ) -> None:
        """Record the next step; rank 0 writes the record into the tag ``committed()`` gives
        (None: the save failed), through ``schedule`` (after the save). Called before the save
        is handed to the writer thread: Python work after the hand-off waits for the GIL."""
        if not self.audit:
            return

        def on_record(record: StepRecord) -> None:
            if rank == 0:
                schedule(lambda: _write_audit_record(committed(), step, record))

        self.steps.after_save(on_record, self._rng_now)

    def fresh_start(self) -> None:
        """``load()`` found nothing: the first save should be of step 0 plus the steps taken."""
        self._numbers.start(-1, "load() returned step 0 (nothing to resume)")

    def prepare(self, path: Path, coord: Coordinator) -> Prepared:
        """Collective: :func:`prepare_resume` for this run's registered states."""
        scopes = {**{n: "rank" for n in self.states}, **{n: "global" for n in self.global_states}}
        return prepare_resume(path, self.engine, coord, scopes, self.rng, bool(self.audit))

    def finish(self, prepared: Prepared, coord: Coordinator, path: Path, start: int) -> str:
        """Collective: restore, arm the audit, count steps from ``start``; returns what the
        resume line says of it."""
        restored = finish_resume(prepared, coord, self.rng, self.states, self.global_states, path)
        self._resumed = path
        self._numbers.start(start - 1, f"load() returned step {start}")
        return f"{restored}; {self._arm(prepared, coord)}"

    def close(self) -> None:
        """Remove the step hooks."""
        self.steps.close()

    def _arm(self, prepared: Prepared, coord: Coordinator) -> str:
        """Arm the audit for the first step, or say why not; every rank has the same
        ``prepared`` expectation or note, so every rank raises alike."""
        self.verdict = None
        if not self.audit:
            return "no audit (audit=False)"
        if prepared.expectation is not None:
            self.steps.expect(prepared.expectation, self._judge)
            return "the first step is audited against the saved run's"
        if self.audit == "strict":
            raise ResumeAuditError(f"{prepared.audit_note} (audit='strict')")
        if prepared.audit_damaged and coord.rank == 0:
            log.warning("resume audit: %s", prepared.audit_note)
        return f"the first step is not audited: {prepared.audit_note}"

    def _judge(self, verdict: Verdict) -> None:
        """The first resumed step's verdict, on every rank alike: a warning on every rank (an
        error with ``audit="strict"``) when something differs, else a line on rank 0."""
        self.verdict = verdict
        line = verdict.line(str(self._resumed))
        if (verdict.causes or verdict.failed) and self.audit == "strict":
            raise ResumeAuditError(line)
        if verdict.causes or verdict.failed:
            warnings.warn(line, ResumeAuditWarning, stacklevel=2)
        elif self.engine.rank == 0:
            self._say(line)


def _write_audit_record(tag_dir: Path | None, step: int, record: StepRecord) -> None:
    """Rank 0, once the save is committed: the checkpoint stands without its record if this fails."""
    if tag_dir is None:  # the save failed: nothing to audit
        return
    try:
        write_record(tag_dir, step, record)
    except (OSError, ValueError) as err:
        log.warning("%s: audit record not written: %s", tag_dir, err)
