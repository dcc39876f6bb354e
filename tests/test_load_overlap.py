"""A load gathers the weights while it reads (issue 33): each layout group's fp32 partition is
cast into the parameter buffer and all-gathered as soon as it is read, before that group's
optimizer state, so the gather overlaps the reads; a load that fails on any rank after the
gathers began puts the run's own weights back (they are gathered again from its masters,
which no failed load changes). One rank, and two gloo ranks; the run trains a step past the checkpoint so
that its weights and the checkpoint's differ."""

from __future__ import annotations

import pytest

import load_overlap_workers as workers
from zeroshard.launch import spawn


@pytest.fixture(scope="module", params=[1, 2], ids=["alone", "two-ranks"])
def ranks(tmp_path_factory, request):
    """Alone the gather is the cast into the parameter buffer, overlapped all the same."""
    return spawn(workers.run, request.param, (str(tmp_path_factory.mktemp("overlap")),), timeout_s=300)


def test_each_groups_weights_are_gathered_before_its_optimizer_state_is_read(ranks):
    for report in ranks:
        assert report["gathers"] == list(range(report["groups"])), report  # every group once, in order
        assert report["state_reads"] > 0, report
        assert report["state_read_before_its_gather"] == [], report
        assert report["weights_differing_after_load"] == 0, report  # the saved weights, bit for bit


def test_a_failed_load_leaves_the_runs_weights(ranks):
    assert [report["error"] for report in ranks] == ["CheckpointDamagedError"] * len(ranks)
    assert [report["weights_changed_by_failed_load"] for report in ranks] == [0] * len(ranks)
