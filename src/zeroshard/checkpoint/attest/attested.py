"""Loads that every rank attests together: the loader on every rank, then one verdict.

:func:`load_attested` runs :func:`~..loader.load_state` on every rank of a coordinator and
judges every rank's evidence together (:func:`attested_load`: one all-gather, the same
verdict on every rank); :func:`load_from` is
the entry points' choice between that and a rank loading alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Callable

from ...layout import Layout
from ...state import ShardedState
from . import attestation
from .attestation import Attestation, AttestationError, Evidence, warn_if_unattested
from ...io.damage import CheckpointDamagedError
from ...io.read_stats import ReadStats
from ..loader import load_state
from ..source import ShardSource

if TYPE_CHECKING:
    from ..coordinator import Coordinator


def load_attested(
    open_source: Callable[[], ShardSource],
    path: str,
    layout: Layout,
    rank: int,
    coordinator: Coordinator,
    *,
    agree_on: Any = None,
    stats: ReadStats | None = None,
    **options: Any,
) -> tuple[ShardedState, Attestation]:
    """Collective: :func:`load_state` from the source ``open_source()`` opens (and this closes)
    on every rank of ``coordinator``, then the attestation of every rank's state together.
    Any rank's failure, differing ``agree_on`` values, or a failed attestation raises the same
    one-line error naming ``path`` on every rank (CheckpointDamagedError for damage, else
    ValueError), and nothing is returned. ``stats`` counts what the rank reads, and gets what
    every rank read (:meth:`~...io.read_stats.ReadStats.gathered`)."""

    def read(evidence: Evidence) -> ShardedState:
        with open_source() as source:
            return load_state(source, layout, rank, evidence=evidence, **options)

    return attested_load(coordinator, path, read, layout, agree_on, stats=stats)


def load_from(
    open_source: Callable[[], ShardSource],
    path: str,
    layout: Layout,
    rank: int,
    coordinator: Coordinator | None,
    *,
    stats: ReadStats | None = None,
    **options: Any,
) -> ShardedState:
    """:func:`load_state` from the source ``open_source()`` opens (closed after). Collective
    when given a ``coordinator``: attested with every rank (:func:`load_attested`; ``stats``
    then also gets what every rank read); else the rank loads and attests alone. Raises as
    those do."""
    if coordinator is not None:
        return load_attested(open_source, path, layout, rank, coordinator, stats=stats, **options)[0]
    with open_source() as source:
        return load_state(source, layout, rank, **options)


def attested_load(
    coordinator: Coordinator,
    path: str,
    read: Callable[[Evidence], Any],
    layout: Layout,
    agree_on: Any = None,
    *,
    agree_also: Callable[[Any], Any] | None = None,
    stats: ReadStats | None = None,
) -> tuple[Any, Attestation]:
    """Collective: run ``read(evidence)`` (a load, filling ``evidence``) on every rank, then
    agree: if any rank failed, or the ranks' ``agree_on`` differ (with ``agree_also`` of what
    ``read`` returned), or the attestation fails, every rank raises the same one-line error (a
    CheckpointDamagedError for damage, else a ValueError). Returns ``read``'s result and the
    attestation, the same on every rank. ``stats``: counts every read ``read`` makes, and
    gets what every rank read (:meth:`~...io.read_stats.ReadStats.gathered`)."""
    evidence = Evidence()
    try:
        with stats.counting() if stats is not None else contextlib.nullcontext():
            result, problem = read(evidence), None
        if agree_also is not None:
            agree_on = (agree_on, agree_also(result))
    except Exception as err:  # noqa: BLE001 - any error on one rank fails the load on every rank
        result, problem = None, (f"{type(err).__name__}: {err}", is_damage(err))
    mine = evidence.partial()
    # params and itemsizes are the same on every rank: each judges with its own
    sent = None if problem or mine is None else dataclasses.replace(mine, params=(), itemsizes={}, rebuilt={})
    counted = (stats.total, stats.opening) if stats is not None else (0, 0)
    reports = coordinator.all_gather_object((problem, agree_on, sent, path, counted))
    if stats is not None:
        stats.gathered([report[4] for report in reports])
    for rank, (their_problem, _, _, their_path, _) in enumerate(reports):
        if their_problem:  # the same error on every rank, with the failing rank's path
            text, damaged = their_problem
            error = CheckpointDamagedError if damaged else ValueError
            raise error(f"checkpoint {their_path} not loaded (nothing changed): rank {rank}: {text}")
    prefix = f"checkpoint {reports[0][3]} not loaded (nothing changed)"
    if any(report[1] != agree_on for report in reports):
        per_rank = {rank: report[1] for rank, report in enumerate(reports)}
        raise ValueError(f"{prefix}: the ranks' options differ: {per_rank}")
    evidences = [report[2] for report in reports]
    verdict = attestation.judge(evidences, layout, evidence._expected, evidence.path, evidence.kind, shape=mine)
    if not verdict.ok:
        raise AttestationError(f"{prefix}: {verdict.line()}")
    warn_if_unattested(verdict, evidence.kind, coordinator.rank)
    return result, verdict


def is_damage(error: BaseException) -> bool:
    """Whether ``error`` says a checkpoint's files or values are not what was saved (a file
    missing, truncated or corrupted, an attestation failed), not that the run differs."""
    return isinstance(error, CheckpointDamagedError)
