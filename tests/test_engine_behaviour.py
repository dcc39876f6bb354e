"""Engine behaviour other than numerical equivalence: aligned zero-copy parameters, gradient
memory per stage, fp16 overflow on one rank, frozen and tied parameters, and clear errors.

The multi-process checks share one spawn of two gloo ranks (``dist_helpers.run_checks``);
the errors that need no process group run in this process, where the engine sees a world
of one.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import RunConfig, build_model, make_engine, run_checks, torch_param_groups
from torch import nn

from zeroshard.engine import ZeroOptimizer
from zeroshard.engine.gradients import MAX_IN_FLIGHT
from zeroshard.launch import spawn
from zeroshard.models import OddSizedModel

WORLD_SIZE = 2
CHECKS = [
    ("alignment", "alignment", ()),
    ("memory", "gradient_memory", ()),
    ("peak-memory", "stage2_peak_gradient_memory", ()),
    ("peak-memory-bf16-reduce", "stage2_peak_gradient_memory", ("bfloat16",)),
    ("overflow-stage1", "overflow", (1,)),
    ("overflow-stage2", "overflow", (2,)),
    ("frozen-tied", "frozen_and_tied", ()),
    ("different-models", "different_models", ()),
    ("shard-state-dict", "shard_state_dict", ()),
    ("reduce-dtype", "reduce_dtype", ()),
    ("all-gather", "all_gather", ()),
]


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    """Every check's result on each rank: per_rank[rank][label]."""
    return spawn(run_checks, WORLD_SIZE, (CHECKS,), timeout_s=240)


# ---- alignment and zero-copy views ---------------------------------------------------------------


def test_params_are_aligned_views_inside_the_flat_buffer_across_steps(per_rank):
    for result in (ranks["alignment"] for ranks in per_rank):
        assert all(result["aligned_before"].values()), result["aligned_before"]
        assert all(result["aligned_after"].values()), result["aligned_after"]
        assert all(result["inside_before"].values()) and all(result["inside_after"].values())
        assert result["data_ptr_unchanged"]  # after 3 steps and zero_grad
        assert result["module_is_view"]
        assert max(result["num_buckets"]) > 1


def test_grouped_mm_runs_on_the_3d_expert_view(per_rank):
    for result in (ranks["alignment"] for ranks in per_rank):
        assert result["experts_shape"] == (OddSizedModel.num_experts, 8, 16)
        assert result["experts_in_buffer"] and result["experts_aligned"]
        assert result["grouped_mm_equal"]


def test_compact_policy_does_misalign_the_odd_fixture(per_rank):
    """The control: without per-parameter padding the same model has misaligned views."""
    for result in (ranks["alignment"] for ranks in per_rank):
        assert result["compact_misaligned"], "compact layout should leave some parameter off 16 bytes"


# ---- gradient memory -------------------------------------------------------------------------------


@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_stage2_keeps_only_the_partitions_and_a_bounded_bucket_pool_across_backwards(per_rank, reduce_dtype):
    """What outlives a stage-2 backward is the gradient partition plus the bucket pool: the
    same storages after every step's backward (reused, not grown), within MAX_IN_FLIGHT + 1
    of the largest bucket's reduction buffers. Two micro-batches per step: the second one's
    fp32 temporaries come from the pool too."""
    for result in (ranks["memory"][f"2-{reduce_dtype}"] for ranks in per_rank):
        assert sum(result["num_buckets"]) >= 5
        first, *later = result["held_after_backward"]
        assert len(later) == 2
        for held in result["held_after_backward"]:
            assert held == first, "the reducer's storages changed from one backward to the next"
            assert set(held["partitions"]) <= set(map(tuple, held["held"]))
        pool_bytes = sum(nbytes for _, nbytes in first["held"]) - sum(nbytes for _, nbytes in first["partitions"])
        assert 0 < pool_bytes <= (MAX_IN_FLIGHT + 1) * result["largest_bucket_reduction_bytes"]
        partition_bytes = sum(nbytes for _, nbytes in first["partitions"])
        assert tuple(result["report_bytes"]) == (partition_bytes, pool_bytes)  # memory_report tells them apart
        assert result["grads_none"]


def test_stage1_holds_full_size_gradients(per_rank):
    for result in (ranks["memory"][1] for ranks in per_rank):
        for full in result["group_numels"]:
            assert full in result["held_numels"]
        assert result["grads_none"]


@pytest.mark.parametrize("label", ["peak-memory", "peak-memory-bf16-reduce"])
def test_stage2_peak_gradient_memory_during_backward_is_bounded_by_buckets(per_rank, label):
    """Stage 2 exists to avoid holding a full-size gradient. Allowing one bucket filling and
    two in flight, the peak while backward runs must stay below partitions + 3 buckets.
    (It once held every bucket's reduction until backward ended: stage 1's peak.) A bf16
    reduction stages buckets in bf16 but receives every rank's part of it: the same bound.
    """
    for result in (ranks[label] for ranks in per_rank):
        assert result["num_buckets"] > 4
        bound = result["partition_bytes"] + 3 * result["largest_bucket_bytes"]
        assert result["peak_bytes"] <= bound, (
            f"peak {result['peak_bytes']} B > partitions + 3 buckets {bound} B "
            f"(full fp32 gradient {result['full_gradient_bytes']} B, {result['num_buckets']} buckets)"
        )


# ---- collectives ------------------------------------------------------------------------------------


def test_all_gather_into_equals_torchs_all_gather_however_called(per_rank):
    """Two gloo ranks swap their inputs by an all-to-all instead of gloo's all-gather: the
    result must be torch's all-gather's, with the input a slice of the output or not."""
    for result in (ranks["all-gather"] for ranks in per_rank):
        assert len(result) == 8
        assert all(difference == 0.0 for difference in result.values()), result


@pytest.mark.parametrize("world_size", [3, 4])
def test_all_gather_into_by_broadcasts_equals_torchs_all_gather(world_size):
    """More than two gloo ranks broadcast each rank's input into its place instead of gloo's
    all-gather: the same result, however it is called."""
    per_rank = spawn(run_checks, world_size, ([("all-gather", "all_gather", ())],), timeout_s=120)
    for result in (ranks["all-gather"] for ranks in per_rank):
        assert len(result) == 8
        assert all(difference == 0.0 for difference in result.values()), result


# ---- reduce dtype ----------------------------------------------------------------------------------


def test_low_precision_reduction_equals_the_reference_that_rounds_the_same_way(per_rank):
    """With bf16/fp16 reduction the reduced gradient is bit for bit the reference's that
    divides, rounds each rank's part once and sums in fp32 in rank order; the reduce-scatter
    payload is half the fp32 run's."""
    for result in (ranks["reduce-dtype"] for ranks in per_rank):
        for name, report in result.items():
            assert report["vs_rounding_reference"] == 0.0, (name, report)
            assert report["fp32_run_vs_fp32_reference"] == 0.0, (name, report)
            assert report["reduce_scatter_bytes"] * 2 == report["fp32_reduce_scatter_bytes"] > 0, (name, report)
        # Where rounding loses bits (stage 1's sum over micro-batches, fp32 gradients), the
        # fp32 reference is visibly different: the comparison above can tell them apart.
        for name in ("reduce-bf16-stage1", "reduce-bf16-stage2-fp32-params", "reduce-param-dtype-bf16-stage1"):
            report = result[name]
            assert report["vs_fp32_reference"] > 2**-12 * report["largest_gradient"], (name, report)


# ---- fp16 overflow ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2])
def test_overflow_on_one_rank_skips_the_step_on_every_rank(per_rank, stage):
    scale = 2.0**16
    for result in (ranks[f"overflow-stage{stage}"] for ranks in per_rank):
        # Only rank 1 saw the inf, at step 1.
        assert result["stepped"] == [True, False, True]
        assert result["scales"] == [scale, scale, scale / 2, scale / 2]
        assert result["masters_changed"] == [True, False, True]
        assert result["buffer_changed"] == [True, False, True]
        assert result["skipped_steps"] == 1 and result["global_steps"] == 2
        assert result["masters_finite"]


# ---- frozen and tied parameters ------------------------------------------------------------------


def test_frozen_params_stay_out_and_tied_params_count_once(per_rank):
    for rank, result in enumerate(ranks["frozen-tied"] for ranks in per_rank):
        names = result["layout_names"]
        assert "wpe.weight" not in names and "lm_head.weight" not in names
        assert names.count("wte.weight") == 1
        assert result["layout_param_numel"] == result["unique_trainable_numel"]
        assert result["frozen_unchanged"] and not result["frozen_in_a_buffer"]
        assert result["still_tied"] and result["tied_in_a_buffer"]
        if rank == 0:
            comparison = result["comparison"]
            tolerance = comparison["tolerance"]  # the equivalence tests' bounds
            assert comparison["masters_max_error"] <= tolerance.masters
            assert comparison["state_max_relative_error"] <= tolerance.state_relative
            assert comparison["losses_equal"]
            assert comparison["masters_moved"] > 1e-3


# ---- errors ----------------------------------------------------------------------------------------


def test_ranks_with_different_models_are_refused_naming_the_ranks(per_rank):
    for result in (ranks["different-models"] for ranks in per_rank):
        assert "ranks [1]" in result and "rank 0" in result, result


# ---- state_dict of a rank's shard ----------------------------------------------------------------


def test_state_dict_shard_resumes_on_its_rank_and_is_refused_on_another_by_every_rank(per_rank):
    for rank, result in enumerate(ranks["shard-state-dict"] for ranks in per_rank):
        assert result["masters_max_error"] == 0.0 and result["params_equal"]
        assert result["global_steps"] == 4
        errors = result["errors"]
        # Only rank 1 got a wrong shard: rank 0 refuses too, naming rank 1's problem.
        assert "rank 1: the shard is rank 0's, this is rank 1" in errors["rank 1 given rank 0's"]
        assert "rank 0:" not in errors["rank 1 given rank 0's"]
        assert "rank 0: the shard is rank 1's, this is rank 0" in errors["swapped"]
        assert "rank 1: the shard is rank 0's, this is rank 1" in errors["swapped"]
        assert errors["rank 1 given rank 0's unchanged"] and errors["swapped unchanged"]


def _config() -> RunConfig:
    return RunConfig("errors", param_dtype=None)


def test_params_on_two_devices_are_refused():
    config = _config()
    model = build_model(config)
    model.head.bias = nn.Parameter(torch.empty(13, device="meta"))
    with pytest.raises(ValueError, match=r"several devices \(cpu, meta\)"):
        make_engine(model, config)


def test_non_contiguous_param_is_refused():
    config = _config()
    model = build_model(config)
    model.proj.weight = nn.Parameter(torch.randn(7, 5).t())
    with pytest.raises(ValueError, match=r"'proj.weight' is not contiguous"):
        make_engine(model, config)


def test_empty_param_group_is_refused():
    model = build_model(_config())
    groups = torch_param_groups(model, _config()) + [{"params": [], "lr": 1.0}]
    with pytest.raises(ValueError, match="param group 2 has no trainable parameters"):
        ZeroOptimizer(model, torch.optim.AdamW, groups)


def test_layout_for_another_world_size_is_refused():
    config = _config()
    layout = make_engine(build_model(config), config).layout
    with pytest.raises(ValueError, match="layout is for world size 2 but the process group has 1 ranks"):
        make_engine(build_model(config), config, layout=layout.with_world_size(2))
