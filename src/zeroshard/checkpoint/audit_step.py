"""The resume audit in the training loop: hooks on the engine's step, one all-reduce when armed.

:class:`StepAudit` registers a step pre hook and a step post hook on the engine. They cost
nothing but a counter unless the step is audited: the first step after a save (recorded) or
after a resume (compared with the saved run's record, :mod:`.audit`). On such a step the post
hook takes this rank's random-state fingerprint, the fingerprint of its registered states
and the loss it reported, and one all-reduce (float64, over the engine's process group) sums
them; the gradient norm and the lrs are the same on every rank already. After a resume the
pre hook also digests the state the step starts from (fp32 masters and optimizer states, by
the logical digests of :mod:`.digests`, so at any layout) and the all-reduce carries those
digests' parity bits: 32 per kind, whose sums' parities are the XOR over the ranks.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from .audit import UNIT_ROUNDOFF, Expectation, StepRecord, Verdict, compare
from .attest.digests import Terms, held_pieces, logical_keys, partition_terms, scalar_digest
from ..io.digest import zeros_crc
from ..io.dtypes import as_array, itemsize_of
from .rng import capture_rng, rng_fingerprint
from .run_state import encoded_states

if TYPE_CHECKING:
    from ..engine import ZeroOptimizer
    from .native.manifest import Manifest

_BITS = 32
_SLOTS = 10  # the all-reduce's sums before the state's parity bits (see StepAudit._local)
log = logging.getLogger("zeroshard.checkpoint.checkpointer")


class StepAudit:
    """Records the first step after each save and checks the first step after a resume."""

    def __init__(self, engine: ZeroOptimizer, states: Mapping[str, Any], global_states: Mapping[str, Any]) -> None:
        self.engine = engine
        self.step_calls = 0  # engine.step() calls, skipped steps included
        self._states, self._global_states = states, global_states
        self._recorders: list[Callable[[StepRecord], None]] = []
        self._expected: Expectation | None = None
        self._on_verdict: Callable[[Verdict], None] | None = None
        self._rng_reference: int | None = None  # this rank's fingerprint at the save or the restore
        self._losses: list[float] = []
        self._terms: int | None = None
        self._steps_before = 0
        self._state_terms: dict[str, int] = {}
        self._scalars_differ = False
        self._failure: str | None = None  # why this rank cannot take its part of the audited step
        self._handles = [
            engine.register_step_pre_hook(lambda *args: self._before()),
            engine.register_step_post_hook(lambda *args: self._after()),
        ]

    @property
    def armed(self) -> bool:
        """The next step is audited."""
        return bool(self._recorders) or self._expected is not None

    def after_save(self, on_record: Callable[[StepRecord], None], rng_now: int | None = None) -> None:
        """Record the next step: ``on_record`` gets its record (on every rank). ``rng_now``:
        the random state's fingerprint now, if the save took it already."""
        self._recorders.append(on_record)
        self._rng_reference = rng_fingerprint(capture_rng()) if rng_now is None else rng_now

    def expect(self, expected: Expectation, on_verdict: Callable[[Verdict], None]) -> None:
        """Compare the next step with ``expected``; ``on_verdict`` gets the verdict (on every rank)."""
        self._expected, self._on_verdict = expected, on_verdict
        self._rng_reference = rng_fingerprint(capture_rng())

    def report_loss(self, loss: Any, terms: int | None = None) -> None:
        """The loss of the step about to be taken (see :meth:`Checkpointer.report_loss`)."""
        if not self.armed:
            return
        self._losses.append(float(loss.detach() if hasattr(loss, "detach") else loss))
        if terms is not None:
            self._terms = (self._terms or 0) + int(terms)

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- the hooks ----------------------------------------------------------------------------

    def _before(self) -> None:
        self.step_calls += 1
        if not self.armed:
            return
        self._steps_before = self.engine.global_steps
        self._failure = None
        if self._expected is not None:
            try:
                self._state_terms, self._scalars_differ = live_state(self.engine, self._expected)
            except Exception as err:  # noqa: BLE001 - the other ranks must still reach the all-reduce
                self._failure = f"digesting the state failed: {type(err).__name__}: {err}"

    def _after(self) -> None:
        if not self.armed:
            return
        try:
            record, differing, failed = self._measure()
        finally:
            self._losses, self._terms = [], None
        recorders, self._recorders = self._recorders, []
        expected, on_verdict = self._expected, self._on_verdict
        self._expected = self._on_verdict = None
        if failed:
            if on_verdict is not None:
                why = f"{failed} rank(s) could not take their fingerprints (each said why)"
                on_verdict(Verdict(details=[why], failed=True))
            return
        for on_record in recorders:
            on_record(record)
        if expected is not None and on_verdict is not None:
            on_verdict(compare(expected, record, differing, bool(self._states or self._global_states)))

    def _local(self) -> list[float]:
        """This rank's part of the all-reduce, but for the state's parity bits."""
        engine = self.engine
        rng = rng_fingerprint(capture_rng())
        reported = bool(self._losses)
        shared_here = bool(self._global_states) and engine.rank == 0  # rank 0's global states count, once
        return [
            sum(self._losses) / len(self._losses) if reported else 0.0,
            float(reported),
            float(self._terms or 0),
            float(self._terms is not None),
            float(rng),
            float(rng != self._rng_reference),
            float(_fingerprint(encoded_states(self._states, "state"), engine.rank)) if self._states else 0.0,
            float(_fingerprint(encoded_states(self._global_states, "global_state"), 0)) if shared_here else 0.0,
            float(self._scalars_differ),
            0.0,  # this rank failed to take its part
        ]

    def _measure(self) -> tuple[StepRecord, list[str], int]:
        """This step's record (one all-reduce), the state kinds that differ from the
        checkpoint's, and how many ranks failed to take their part (then nothing is judged).
        Whatever fails on one rank still reaches the all-reduce: no rank is left waiting."""
        engine = self.engine
        try:
            local = self._local() if self._failure is None else None
        except Exception as err:  # noqa: BLE001 - see above
            self._failure, local = f"{type(err).__name__}: {err}", None
        if local is None:
            log.warning("resume audit: this rank cannot audit the step: %s", self._failure)
            local = [0.0] * (_SLOTS - 1) + [1.0]
        kinds = self._expected.kinds if self._expected is not None else ()
        for kind in kinds:
            value = self._state_terms.get(kind, 0)
            local += [float((value >> bit) & 1) for bit in range(_BITS)]
        summed = engine.comm.all_reduce_(torch.tensor(local, dtype=torch.float64, device=engine.device)).tolist()
        world = engine.world_size
        stepped = engine.global_steps > self._steps_before
        record = StepRecord(
            world_size=world,
            layout=engine.layout_digest,
            stepped=stepped,
            grad_norm=float(engine.last_grad_norm) if stepped and engine.last_grad_norm is not None else None,
            lrs=tuple(float(group["lr"]) for group in engine.param_groups),
            loss=summed[0] / world if summed[1] == world else None,
            terms=int(summed[2]) if summed[3] == world else None,
            rng=int(summed[4]),
            rng_drew=int(summed[5]),
            data=int(summed[6]) if self._states else None,
            global_data=int(summed[7]) if self._global_states else None,
            unit_roundoff=unit_roundoff(engine),
        )
        differing = []
        for index, kind in enumerate(kinds):
            bits = summed[_SLOTS + index * _BITS : _SLOTS + (index + 1) * _BITS]
            combined = sum((int(count) & 1) << bit for bit, count in enumerate(bits))
            if combined != self._expected.state_terms.get(kind):  # type: ignore[union-attr]
                differing.append(kind)
        if summed[8]:
            differing.append("scalars or state names")
        return record, differing, int(summed[9])


def unit_roundoff(engine: ZeroOptimizer) -> float:
    """The unit roundoff of the lowest precision a step computes in (parameters, gradient reduction)."""
    names = {group.dtype for group in engine.layout.groups}
    names |= {str(dtype).removeprefix("torch.") for dtype in engine.reduce_dtypes}
    return max(UNIT_ROUNDOFF.get(name, UNIT_ROUNDOFF["float32"]) for name in names)


def _fingerprint(encoded: Any, rank: int) -> int:
    """31 bits of SHA-256 of a rank's encoded states and its rank (so equal states of two ranks do not cancel)."""
    text = json.dumps(encoded, sort_keys=True, separators=(",", ":")) + f"#{rank}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") >> 1


def expected_state(manifest: Manifest) -> tuple[tuple[str, ...], dict[str, int], tuple[tuple[str, int], ...]]:
    """From a checkpoint's digests: the optimizer state kinds, each kind's XOR of its logical
    tensors' raw CRCs (what every rank's terms XOR to), and every scalar's (name, digest)."""
    digests = manifest.digests
    assert digests is not None
    groups = list(zip(manifest.layout.groups, manifest.groups, strict=True))
    kinds_of = {group.index: ("fp32", *record.states) for group, record in groups}
    itemsize = {
        (group.index, kind): itemsize_of(record.fp32_dtype if kind == "fp32" else record.states[kind])
        for group, record in groups
        for kind in kinds_of[group.index]
    }
    xor: dict[str, int] = {}
    for key, numel in logical_keys(manifest.layout, kinds_of).items():
        name, _, kind = key
        group = manifest.layout.param(name)[0].index
        value = digests.get(key)
        assert value is not None  # the manifest's own check: its digests name exactly these keys
        xor[kind] = xor.get(kind, 0) ^ value ^ zeros_crc(numel * itemsize[(group, kind)])
    scalars = tuple(sorted((name, value) for group in digests.scalars for name, value in group.items()))
    return tuple(sorted(xor)), xor, scalars


def live_state(engine: ZeroOptimizer, expected: Expectation) -> tuple[dict[str, int], bool]:
    """This rank's part of each kind's XOR (its fragments' terms), and whether its optimizer
    scalars, or the names of its states, differ from the checkpoint's. A kind this rank does
    not hold contributes nothing (so its XOR cannot match)."""
    views = engine.state_views()
    xor = {kind: 0 for kind in expected.kinds}
    scalars, other = [], False
    for group in engine.layout.groups:
        pieces = held_pieces(group, engine.rank)
        tensors = {"fp32": views.fp32_partitions[group.index], **views.optimizer_states[group.index]}
        for kind, tensor in tensors.items():
            if kind not in xor:  # a state the checkpoint has none of
                other = True
                continue
            terms = Terms()
            partition_terms(pieces, kind, as_array(tensor.detach().cpu()), terms)
            for term, _ in terms.values.values():
                xor[kind] ^= term
        own = views.optimizer_scalars[group.index]
        scalars += [(name, scalar_digest(value.detach().cpu())) for name, value in own.items()]
    return xor, other or tuple(sorted(scalars)) != expected.scalars
