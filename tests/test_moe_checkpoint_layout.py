"""Checkpoints of expert layouts, as pure layout math: which rank writes which global expert
elements, and the reads that reshard them across changes of both EP and DP.

Global elements (zeroshard.layout.coordinates) name an expert weight's elements with every
expert stacked by global id; a save writes each rank's partition, a load plans range reads.
Hypothesis draws (W, EP) pairs on both sides, expert counts, shapes and policies, including
alignments that leave ranks of an expert-DP group with padding only.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroshard.checkpoint.reshard import plan_reads
from zeroshard.checkpoint.testing import expected_partition, local_pattern, pattern
from zeroshard.layout import ExpertMesh, LayoutPolicy, ParamSpec, build_layout, global_shape, locate_global, rank_runs

WORLDS = [(w, ep) for w in (1, 2, 3, 4, 6, 8) for ep in (1, 2, 3, 4, 8) if w % ep == 0]


def moe_layout(world_size, ep_size, num_experts, expert_shapes, dense_shapes, policy=None, dtype="float32"):
    mesh = ExpertMesh(world_size, ep_size)
    local = num_experts // ep_size
    experts = [ParamSpec.of(f"moe.experts.w{i}", (local, *shape), dtype) for i, shape in enumerate(expert_shapes)]
    dense = [ParamSpec.of(f"dense.{i}", shape, dtype) for i, shape in enumerate(dense_shapes)]
    return build_layout([dense, mesh.expert_group(experts, num_experts)], world_size, policy or LayoutPolicy.native())


def written_elements(layout):
    """(name, global element) -> how many ranks write it, over every rank's partition."""
    counts: dict[tuple[str, int], int] = {}
    for rank in range(layout.world_size):
        for group in layout.groups:
            for run in rank_runs(group, rank):
                for element in range(run.global_start, run.global_start + run.length):
                    counts[(run.name, element)] = counts.get((run.name, element), 0) + 1
    return counts


def all_elements(layout):
    return {
        (slot.name, element)
        for group in layout.groups
        for slot in group.params
        for element in range(math.prod(global_shape(group, slot)))
    }


def apply_plan(old, new, rank, kind="fp32"):
    """New rank ``rank``'s partitions filled by plan_reads from the old ranks' pattern partitions."""
    partitions = []
    for plan in plan_reads(old, new, rank):
        out = torch.zeros(new.groups[plan.group].partition_numel)
        for copy in plan.copies:
            source = expected_partition(old, copy.source_rank, copy.source_group, kind)
            out[copy.dest_start : copy.dest_start + copy.length] = source[
                copy.source_start : copy.source_start + copy.length
            ]
        partitions.append(out)
    return partitions


@st.composite
def moe_cases(draw):
    (old_w, old_ep), (new_w, new_ep) = draw(st.sampled_from(WORLDS)), draw(st.sampled_from(WORLDS))
    num_experts = math.lcm(old_ep, new_ep) * draw(st.integers(1, 2))
    expert_shapes = draw(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 6)), min_size=1, max_size=3))
    dense_shapes = draw(st.lists(st.tuples(st.integers(1, 9)), min_size=1, max_size=3))

    def policy():
        alignment = draw(st.sampled_from([16, 64, 1024]))
        bucket = draw(st.sampled_from([None, 8, 40]))
        return LayoutPolicy.native(alignment, bucket_numel=bucket)

    old = moe_layout(old_w, old_ep, num_experts, expert_shapes, dense_shapes, policy())
    new = moe_layout(new_w, new_ep, num_experts, expert_shapes, dense_shapes, policy())
    return old, new


@settings(max_examples=60, deadline=None)
@given(moe_cases())
def test_every_expert_element_is_written_by_exactly_one_rank(case):
    for layout in case:
        counts = written_elements(layout)
        assert set(counts) == all_elements(layout)
        assert set(counts.values()) == {1}


@settings(max_examples=60, deadline=None)
@given(moe_cases())
def test_planned_reads_reshard_across_ep_and_dp_bit_for_bit(case):
    old, new = case
    for rank in range(new.world_size):
        for group, partition in enumerate(apply_plan(old, new, rank)):
            assert torch.equal(partition, expected_partition(new, rank, group, "fp32")), (rank, group)


@settings(max_examples=40, deadline=None)
@given(moe_cases())
def test_locate_global_finds_each_expert_where_its_rank_holds_it(case):
    layout, _ = case
    group = layout.groups[1]
    for slot in group.params:
        numel = math.prod(global_shape(group, slot))
        expected = pattern(slot.name, "fp32", numel)
        for run in locate_global(group, slot, 0, numel):
            held = expected_partition(layout, run.rank, group.index, "fp32")
            assert torch.equal(
                held[run.partition_start : run.partition_start + run.length],
                expected[run.global_start : run.global_start + run.length],
            )


def test_padding_only_ranks_write_nothing_and_lose_nothing():
    """1024-byte alignment, a bucket per weight: the second rank of each expert-DP group owns
    only padding of the expert group at (4, 2); coverage and resharding still hold."""
    policy = LayoutPolicy.native(1024, bucket_numel=200)
    old = moe_layout(4, 2, 4, [(16, 8), (8, 16)], [(40,)], policy)
    experts = old.groups[1]
    assert [bool(rank_runs(experts, rank)) for rank in range(4)] == [True, True, False, False]
    counts = written_elements(old)
    assert set(counts) == all_elements(old) and set(counts.values()) == {1}
    for new_w, new_ep in [(2, 1), (4, 4), (1, 1), (8, 2)]:
        new = moe_layout(new_w, new_ep, 4, [(16, 8), (8, 16)], [(40,)], policy)
        for rank in range(new_w):
            for group, partition in enumerate(apply_plan(old, new, rank)):
                assert torch.equal(partition, expected_partition(new, rank, group, "fp32")), (new_w, new_ep, rank)


def test_global_expert_is_local_index_on_its_ep_rank():
    """Expert g of a stacked weight: local index g % (E/EP) on EP rank g // (E/EP), held by
    global ranks ep, ep + EP, ... (the expert-DP group), at the same values at every EP."""
    for world_size, ep in [(4, 2), (4, 4), (2, 1)]:
        layout = moe_layout(world_size, ep, 4, [(3, 2)], [(5,)])
        for rank in range(world_size):
            stacked = local_pattern(layout, rank, "moe.experts.w0", "fp32")
            full = pattern("moe.experts.w0", "fp32", 4 * 6).reshape(4, 3, 2)
            first = (rank % ep) * (4 // ep)
            assert torch.equal(stacked, full[first : first + 4 // ep])


def test_dense_and_expert_mismatch_is_refused_by_name():
    mesh = ExpertMesh(2, 1)
    experts = [ParamSpec.of("moe.experts.w0", (4, 3, 2), "float32")]
    dense = [ParamSpec.of("dense.0", (5,), "float32")]
    as_experts = build_layout([dense, mesh.expert_group(experts, 4)], 2)
    as_dense = build_layout([dense, experts], 2)
    with pytest.raises(ValueError, match="'moe.experts.w0' is an expert weight in one layout and dense in the other"):
        plan_reads(as_experts, as_dense, 0)


def test_rank_coordinates_follow_the_expert_mesh():
    from zeroshard.layout.coordinates import ep_rank, global_rank, shard_rank

    layout = moe_layout(8, 4, 8, [(2, 2)], [(3,)])
    mesh = ExpertMesh(8, 4)
    experts, dense = layout.groups[1], layout.groups[0]
    for rank in range(8):
        assert (shard_rank(experts, rank), ep_rank(experts, rank)) == (mesh.expert_dp_rank(rank), mesh.ep_rank(rank))
        assert global_rank(experts, shard_rank(experts, rank), ep_rank(experts, rank)) == rank
        assert (shard_rank(dense, rank), ep_rank(dense, rank)) == (rank, 0)
    with pytest.raises(ValueError, match="rank 8 is outside world size 8"):
        shard_rank(experts, 8)
