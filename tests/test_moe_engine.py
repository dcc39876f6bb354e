"""ZeroOptimizer with expert parallelism: MoEGPT trained at (W, EP) on spawned gloo ranks
equals one process training the same model on the concatenation of every rank's batches.

Dense groups are sharded and reduced over all W ranks, expert groups over the W / EP ranks
holding the same experts; both gradients are divided by W. Both runs sum the same per-token
terms, the EP run per rank and then over ranks, the reference in one pass over the
n = W x BATCH x SEQ (at most 64) tokens. Tolerances, relative for losses and gradient norms
(4 AdamW steps at lr 1e-2, clipping active):
* fp32: another order of n-term sums, within 2 n u (u = 2^-24): 7.6e-6 (seen 7e-8). Masters
  1e-4 absolute (seen 1e-5): that relative error of the gradient, turned into a larger one by
  Adam's division for the few elements whose gradient is within its own rounding of zero;
* bf16 (parameters or reduction): the EP run rounds each rank's gradient to bf16, the
  reference the whole batch's, so the two runs' bf16 weights and gradients are one rounding
  apart (2^-8 relative each, 2 x 2^-8 together): 7.8e-3 (seen 1.6e-4). Masters 4e-2 =
  4 steps x lr: Adam turns a different sign of a near-zero gradient into a full-lr step, the
  most a step can differ. Training moves the dense masters by 4e-2 over the run.
"""

from __future__ import annotations

import pytest
from moe_engine_workers import BATCH, MODEL, OPTIONS, SEQ, STEPS, MoECase, run_moe_cases

from zeroshard.launch import spawn
from zeroshard.layout import ExpertMesh

TOKENS = 4 * BATCH * SEQ  # the most a sum runs over (W = 4)
FP32 = {"loss_diff": 2 * TOKENS * 2.0**-24, "norm_diff": 2 * TOKENS * 2.0**-24, "masters_diff": 1e-4}
LOW_PRECISION = {"loss_diff": 2 * 2.0**-8, "norm_diff": 2 * 2.0**-8, "masters_diff": STEPS * OPTIONS["lr"]}

# Expert weights are [E/EP, 16, 8] (256 elements at EP = 2); 1024-byte alignment with one
# bucket per weight pads each to 256 fp32 elements per partition, so at W / EP = 2 the second
# rank of every expert-DP group owns padding only.
PADDING_ONLY = dict(alignment_bytes=1024, bucket_numel=200)

CASES = {
    4: [
        MoECase(2, 1, "float32"),
        MoECase(2, 2, "bfloat16"),
        MoECase(2, 2, "float32", **PADDING_ONLY),
        MoECase(4, 2, "float32"),
        MoECase(1, 1, "bfloat16"),
    ],
    2: [
        MoECase(2, 2, "float32"),
        MoECase(2, 1, "bfloat16"),
        MoECase(1, 2, "float32", reduce_dtype="bfloat16"),
    ],
}


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_expert_parallel_training_equals_single_process(world_size):
    cases = CASES[world_size]
    overflow = world_size == 4  # the fp16 overflow check runs once
    results = spawn(run_moe_cases, world_size, (cases, overflow), backend="gloo", timeout_s=400)
    if overflow:
        check_overflow_in_experts([per_rank.pop() for per_rank in results])
    for index, case in enumerate(cases):
        mesh = ExpertMesh(world_size, case.ep_size)
        low_precision = "bfloat16" in (case.dtype, case.reduce_dtype)
        tolerance = LOW_PRECISION if low_precision else FP32
        local = MODEL.num_experts // case.ep_size
        for rank, outcome in enumerate(per_rank[index] for per_rank in results):
            where = f"W={world_size} {case.label} rank {rank}"
            for key, bound in tolerance.items():
                assert outcome[key] <= bound, f"{where}: {key} {outcome[key]} (worst master {outcome['worst_master']})"
            assert outcome["dense_moved"] > 10 * tolerance["masters_diff"] or low_precision, where
            assert outcome["dense_world_size"] == world_size, where
            assert outcome["expert_dp_size"] == mesh.expert_dp_size, where
            first = mesh.ep_rank(rank) * local
            assert outcome["expert_ids"] == list(range(first, first + local)), where
            assert outcome["partition_misalignment"] == [0] * len(outcome["partition_misalignment"]), where
            assert outcome["expert_storage_kept"] and outcome["experts_in_buffer"], where
            assert outcome["expert_view_shapes"][0] == [local, MODEL.n_embd, MODEL.expert_hidden], where
            if mesh.expert_dp_size > 1:  # expert groups move over the expert-DP group only
                assert outcome["bytes"]["expert_dp"]["reduce_scatter"] > 0, where
        padding_only = [per_rank[index]["expert_padding_only"] for per_rank in results]
        if case.alignment_bytes == PADDING_ONLY["alignment_bytes"]:
            assert padding_only == [mesh.expert_dp_rank(rank) == 1 for rank in range(world_size)], case.label


def check_overflow_in_experts(outcomes: list[dict]) -> None:
    """Rank 3's inf expert gradient (reduced over ranks 1 and 3 only) skips step 1 everywhere."""
    for rank, outcome in enumerate(outcomes):
        assert outcome["stepped"] == [True, False, True], (rank, outcome)
        assert outcome["masters_changed"] == [True, False, True], (rank, outcome)
        first = outcome["scales"][0]
        assert outcome["scales"] == [first, first, first / 2, first / 2], (rank, outcome)


def _model_and_groups():
    from zeroshard.moe import MoEGPT, moe_param_groups

    model = MoEGPT(MODEL)
    return model, moe_param_groups(model)


def test_expert_groups_build_in_a_world_of_one_without_a_process_group():
    """Issue 20: at W = 1 the expert-DP group is the world of one (it used to be refused);
    at W > 1 it is still required (tests/hf_moe_workers.py)."""
    import torch

    from zeroshard.engine import ZeroOptimizer

    model, groups = _model_and_groups()
    engine = ZeroOptimizer(model, torch.optim.AdamW, groups)
    assert engine.layout.shard_groups == {"dp": 1, "expert_dp": 1}
    assert engine.comms["expert_dp"] is engine.comms["dp"]


def test_expert_flag_must_be_a_bool():
    import torch

    from zeroshard.engine import ZeroOptimizer

    model, groups = _model_and_groups()
    groups[1]["expert"] = "yes"
    with pytest.raises(ValueError, match=r"param group 1: 'expert' must be True or False, got 'yes'"):
        ZeroOptimizer(model, torch.optim.AdamW, groups)
