"""The fragment API: full and local get/set of a parameter's master, gradient and optimizer
state, on parameters that span ranks and sit next to padding (3 gloo ranks)."""

from __future__ import annotations

import fragment_workers
import pytest

from zeroshard.launch import spawn


@pytest.fixture(scope="module")
def per_rank():
    return spawn(fragment_workers.check_fragments, 3, timeout_s=240)


def test_some_parameters_span_ranks(per_rank):
    assert len(per_rank[0]["spanning"]) >= 2


@pytest.mark.parametrize(
    "check",
    ["get_fp32", "get_grad", "set_fp32", "set_updates_model", "set_grad", "local_set", "optimizer_state", "set_optimizer_state"],
)
def test_round_trips_on_every_rank_and_parameter(per_rank, check):
    failures = [(rank, name) for rank, result in enumerate(per_rank) for name, checks in result["checks"].items() if not checks[check]]
    assert not failures


def test_local_get_returns_this_ranks_run(per_rank):
    checked = [checks["local_get"] for result in per_rank for checks in result["checks"].values() if "local_get" in checks]
    assert checked and all(checked)


def test_padding_stays_zero_after_setting_values(per_rank):
    assert all(result["padding_zero"] for result in per_rank)
