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


BAD_CALLS = {
    "state_before_first_step": "KeyError",
    "set_state_before_first_step": "KeyError",
    "unknown_parameter": "KeyError",
    "unknown_parameter_grad": "KeyError",
    "ranks_ask_for_different_parameters": "ValueError",
    "wrong_size_on_one_rank": "ValueError",
    "not_a_tensor_on_one_rank": "TypeError",
    "import_another_ranks_state_on_one_rank": "ValueError",
    "load_options_differ": "ValueError",
    "load_missing_on_one_rank": "ValueError",
    "save_tags_differ": "ValueError",
}


@pytest.fixture(scope="module")
def bad_calls(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-calls")
    return spawn(fragment_workers.check_bad_calls, 2, (str(root),), timeout_s=240)


@pytest.mark.parametrize("label", sorted(BAD_CALLS))
def test_a_bad_collective_call_raises_the_same_error_on_every_rank(bad_calls, label):
    rank0, rank1 = bad_calls[0][label], bad_calls[1][label]
    assert rank0["type"] == rank1["type"] == BAD_CALLS[label], (rank0, rank1)
    # One message on both ranks, and the group still answering: a rank that had blocked in a
    # collective its peer never entered would fail with the group's timeout (or the spawn's)
    # instead, so no clock is needed to tell.
    assert rank0["message"] == rank1["message"], (rank0, rank1)
    assert rank0["group_usable"] and rank1["group_usable"]  # a following collective works
    assert rank0["unchanged"] and rank1["unchanged"]  # and the failed call changed nothing


def test_a_bad_collective_call_names_the_failing_rank(bad_calls):
    message = bad_calls[1]["state_before_first_step"]["message"]
    assert message.startswith("get_full_optimizer_state(") and "failed on rank 0: optimizer has no state 'exp_avg'" in message
    assert "rank 1:" in bad_calls[0]["import_another_ranks_state_on_one_rank"]["message"]


def test_ranks_that_ask_for_different_tags_save_nothing(bad_calls):
    assert not [tag for tag in bad_calls[0]["published_tags"] if tag.startswith("tag-of-rank")]
