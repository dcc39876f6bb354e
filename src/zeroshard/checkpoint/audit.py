"""The resume audit: the first step after a save, recorded; the first step after a resume, compared.

After each save, the first step that follows records what it saw (:class:`StepRecord`): its
gradient norm before clipping, every param group's lr, the loss if the script reports it,
the fingerprints of every rank's random state and registered states (the data position),
summed over the ranks by one small all-reduce (:mod:`.audit_step`). Rank 0 writes it into
the tag as ``audit.json`` once the save is committed (write-temp-then-rename: a reader sees
a whole record or none; the manifest, written before, does not list it, and no committed
file changes). The record carries its own CRC-32: a record that is missing or damaged means
only that the first resumed step is not audited (said once), never that the checkpoint is.

A resumed run's first step is compared with it (:func:`compare`). Under the saved layout
(world size, EP, policy) it must be the same bit for bit. Under another one the lr and the
optimizer state (against the manifest's digests, exact at any layout) must still be equal;
the gradient norm and the loss are judged within :func:`relative_bound`, when the loss was
reported with its terms, and when the step's random numbers are the saved ones (same world
size) or it drew none. A mismatch names which of the RNG, the data position, the lr or the
optimizer state differs.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .format import AUDIT_FILE
from ..io import jsonvalue
from ..io.checksum import block_crc
from .directory import replace_file_atomically
from ..io.members import read_small_file

AUDIT_FORMAT = "zeroshard.audit"
AUDIT_VERSION = 1
_MAX_RECORD_BYTES = 1 << 20

# The unit roundoff (half the gap between 1 and the next float) of the dtypes a step computes in.
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


class ResumeAuditError(RuntimeError):
    """``audit="strict"``: the first resumed step is not what the saved run's was, or cannot be audited."""


class ResumeAuditWarning(UserWarning):
    """The first resumed step is not what the saved run's was (said once, on every rank)."""


@dataclass(frozen=True)
class StepRecord:
    """What one step showed, the same on every rank."""

    world_size: int
    layout: str  # the engine's layout digest: the same one computes the same sums in the same order
    stepped: bool  # False: skipped (an fp16 overflow)
    grad_norm: float | None  # before clipping; None when skipped
    lrs: tuple[float, ...]  # per param group, the lr the step used
    loss: float | None  # the mean over ranks of the reported losses; None unless every rank reported
    terms: int | None  # the terms those losses average, summed over ranks; None unless every rank said
    rng: int  # sum over ranks of each rank's random-state fingerprint at the step
    rng_drew: int  # ranks whose random streams advanced since the save (or the restore)
    data: int | None  # sum over ranks of the fingerprints of the per-rank states; None: none registered
    global_data: int | None  # fingerprint of the global states (rank 0's); None: none registered
    unit_roundoff: float  # of the lowest precision the step computes in

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``audit.json`` holds under ``"step"``."""
        return {**asdict(self), "lrs": list(self.lrs)}

    @classmethod
    def from_dict(cls, data: Any) -> StepRecord:
        """Parse, every field of its type; ValueError naming the first that is not."""
        if not isinstance(data, dict):
            raise ValueError("the step is not a JSON object")
        kinds = {
            "world_size": (int,), "layout": (str,), "stepped": (bool,), "grad_norm": (float, type(None)),
            "lrs": (list,), "loss": (float, type(None)), "terms": (int, type(None)), "rng": (int,),
            "rng_drew": (int,), "data": (int, type(None)), "global_data": (int, type(None)), "unit_roundoff": (float,),
        }  # fmt: skip
        for name, types in kinds.items():
            if type(data.get(name)) not in types:
                raise ValueError(f"{name} is {type(data.get(name)).__name__}")
        if not all(type(lr) in (float, int) for lr in data["lrs"]):
            raise ValueError("lrs are not numbers")
        return cls(**{**{name: data[name] for name in kinds}, "lrs": tuple(float(lr) for lr in data["lrs"])})


def record_path(tag_dir: Path) -> Path:
    """Where a tag's audit record lives."""
    return tag_dir / AUDIT_FILE


def write_record(tag_dir: Path, saved_step: int | None, record: StepRecord) -> None:
    """Write ``audit.json`` into ``tag_dir`` atomically (a temporary file renamed over it)."""
    body = {"format": AUDIT_FORMAT, "version": AUDIT_VERSION, "tag": tag_dir.name, "saved_step": saved_step}
    body["step"] = jsonvalue.encode(record.to_dict(), "audit record")  # a NaN loss is tagged, not refused
    body["crc32"] = block_crc(_canonical(body))
    replace_file_atomically(record_path(tag_dir), json.dumps(body, indent=1, allow_nan=False) + "\n")


def record_missing(tag_dir: Path) -> bool:
    """No audit record at all (a run that stopped right after the save), as opposed to a damaged one."""
    return not os.path.lexists(record_path(tag_dir))


def read_record(tag_dir: Path) -> tuple[StepRecord | None, str | None]:
    """The tag's record, or None and why not in one line: missing, or damaged (its own CRC,
    its JSON or a field). Never raises for what the file holds."""
    path = record_path(tag_dir)
    try:
        raw = read_small_file(path, _MAX_RECORD_BYTES, follow_links=False)
    except FileNotFoundError:
        return None, f"{tag_dir} has no audit record (the run that saved it took no step after the save)"
    except (OSError, ValueError) as err:
        return None, f"{path}: unreadable ({err})"
    try:
        body = jsonvalue.loads(raw, path)
        if not isinstance(body, dict) or body.get("format") != AUDIT_FORMAT:
            raise ValueError("not a zeroshard audit record")
        if body.get("version") != AUDIT_VERSION:
            raise ValueError(f"version {body.get('version')!r}, this zeroshard reads {AUDIT_VERSION}")
        crc = body.pop("crc32", None)
        if crc != block_crc(_canonical(body)):
            raise ValueError("its checksum does not match: the file is corrupted")
        return StepRecord.from_dict(jsonvalue.decode(body["step"])), None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        return None, f"{path}: damaged ({err}); the first resumed step is not audited"


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def relative_bound(terms: int | None, unit_roundoff: float) -> float | None:
    """How far apart, relatively, the loss or gradient norm of one step may be at two layouts.

    Another world size (or EP, or policy) sums the same ``n`` terms (the per-sample losses
    and gradients of the global batch) in another order and grouping. Any order of a sum of
    ``n`` terms in a type of unit roundoff ``u`` is within ``gamma(n - 1) * sum |x_i|`` of the
    exact sum, ``gamma(k) = k u / (1 - k u)`` (Higham, Accuracy and Stability of Numerical
    Algorithms, 2nd ed., eq. 4.4), so two orders are within twice that. Taking ``sum |x_i|``
    as ``|sum x_i|`` (terms that do not cancel: a loss's are all positive) gives the bound
    ``2 gamma(n - 1)``, relative. None when ``n`` is unknown or the bound says nothing (n u >= 1).
    """
    if terms is None or terms < 1:
        return None
    k = (terms - 1) * unit_roundoff
    return None if k >= 1 else 2 * k / (1 - k)


@dataclass(frozen=True)
class Expectation:
    """What the first step after a resume is compared with."""

    path: str  # the checkpoint resumed
    record: StepRecord
    kinds: tuple[str, ...]  # optimizer state kinds the manifest has digests of ("fp32", "exp_avg", ...)
    state_terms: dict[str, int]  # kind -> XOR of its logical tensors' terms, from the manifest's digests
    scalars: tuple[tuple[str, int], ...]  # every optimizer scalar's (name, digest), sorted
    rng_restored: bool  # this run restored the saved random streams exactly (same world size, rng on)


@dataclass
class Verdict:
    """The comparison's outcome: the causes named (empty: it matches) and one line of details."""

    causes: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    exact: bool = True  # compared bit for bit (same layout), else within the bound
    failed: bool = False  # not audited: a rank could not take its part

    def line(self, path: str) -> str:
        """One line for the warning, the error or the resume's confirmation."""
        start = f"resume audit: the first step after resuming {path}"
        details = "; ".join(self.details)
        if self.failed:
            return f"{start} is not audited: {details}"
        if self.causes:
            verb = "differs" if len(self.causes) == 1 else "differ"
            return f"{start} differs from the run that saved it: {', '.join(self.causes)} {verb} ({details})"
        how = "bit for bit" if self.exact else "within the bound of another layout"
        return f"{start} matches the run that saved it {how} ({details})"


def compare(expected: Expectation, seen: StepRecord, differing_state: list[str], data_registered: bool) -> Verdict:
    """Judge the first resumed step ``seen`` against the saved run's record; ``differing_state``
    names the optimizer state kinds that are not the checkpoint's."""
    saved = expected.record
    same_world = saved.world_size == seen.world_size
    verdict = Verdict(exact=same_world and saved.layout == seen.layout)
    if len(saved.lrs) != len(seen.lrs) or not all(map(_same, saved.lrs, seen.lrs)):
        verdict.causes.append("lr")
        verdict.details.append(f"lr {_floats(seen.lrs)}, the saved run's {_floats(saved.lrs)}")
    if differing_state:
        verdict.causes.append(f"optimizer state ({', '.join(differing_state)})")
        verdict.details.append("the state the step started from is not the checkpoint's")
    if same_world and saved.rng != seen.rng:
        verdict.causes.append("RNG")
        verdict.details.append(_rng_detail(expected))
    per_rank = same_world and saved.data is not None and saved.data != seen.data
    if per_rank or (saved.global_data is not None and saved.global_data != seen.global_data):
        verdict.causes.append("data position")
        verdict.details.append("the registered states' state_dict() at the step differs from the saved run's")
    if saved.stepped != seen.stepped:
        here, there = ("skipped", "taken") if saved.stepped else ("taken", "skipped")
        verdict.details.append(f"the step was {here} here, {there} by the saved run (an fp16 overflow)")
    _judge_outputs(verdict, expected, seen, data_registered)
    if not verdict.causes:
        checked = ["lr", "optimizer state"] + (["RNG"] if same_world else [])
        checked += ["data position"] if saved.global_data is not None or (saved.data is not None and same_world) else []
        verdict.details.insert(0, f"{', '.join(checked[:-1])} and {checked[-1]} as saved")
    return verdict


def _judge_outputs(verdict: Verdict, expected: Expectation, seen: StepRecord, data_registered: bool) -> None:
    """The gradient norm and the loss: equal under the saved layout, else within the bound.
    A difference no fingerprint explains is named by elimination."""
    saved = expected.record
    pairs = [("gradient norm", saved.grad_norm, seen.grad_norm), ("loss", saved.loss, seen.loss)]
    pairs = [(name, a, b) for name, a, b in pairs if a is not None and b is not None]
    if verdict.exact:
        differing = [(name, a, b) for name, a, b in pairs if not _same(a, b)]
        verdict.details += [f"{name} {b!r}, the saved run's {a!r}" for name, a, b in differing]
        verdict.details += [f"{name} {b!r} as saved" for name, a, b in pairs if _same(a, b)]
    else:
        terms = max(saved.terms or 0, seen.terms or 0) or None
        bound = relative_bound(terms, max(saved.unit_roundoff, seen.unit_roundoff))
        if bound is None or ((saved.rng_drew or seen.rng_drew) and not expected.rng_restored):
            why = "no loss terms reported" if bound is None else "the step drew random numbers from other streams"
            verdict.details.append(f"gradient norm and loss not judged at another layout ({why})")
            return
        differing = [(name, a, b) for name, a, b in pairs if not abs(a - b) <= bound * max(abs(a), abs(b))]
        for name, a, b in pairs:
            apart = abs(a - b) / max(abs(a), abs(b), 1e-300)
            verdict.details.append(f"{name} {b!r}, the saved run's {a!r}: {apart:.1e} apart, bound {bound:.2e}")
    if differing and not verdict.causes:
        if data_registered:
            verdict.causes.append("something the audit does not fingerprint (frozen weights, buffers)")
        else:
            verdict.causes.append("data position")
            verdict.details.append("no data state is registered (Checkpointer(state=...)); RNG, lr and state match")


def _rng_detail(expected: Expectation) -> str:
    if not expected.rng_restored:
        return "this run did not restore the saved random state (rng=False, or a checkpoint without one)"
    return (
        "the random state at the step is not the saved run's: something drew random numbers between load() and the "
        "step that the saved run did not draw (iter() of a DataLoader without a generator of its own draws one)"
    )


def _floats(values: tuple[float, ...]) -> str:
    return "[" + ", ".join(repr(v) for v in values) + "]"


def _same(a: float, b: float) -> bool:
    """Equal, a NaN counting as equal to a NaN (the same step gives the same NaN)."""
    return a == b or (math.isnan(a) and math.isnan(b))
