"""Owner groups (zeroshard.layout.owners): every matrix whole in one rank's partition.

Property tests over random models, world sizes, alignments and bucket sizes, dense and
expert owner groups next to even ones: the layout invariants of test_layout_properties
hold (tiling, fragments and padding, pieces, logical ranges, JSON), every matrix (a
parameter, or one expert of a stack) lies in one rank, partition starts stay aligned, no
offset depends on the world size, the cuts are what their rules say (the cost-first cut the
cheapest contiguous one, the compact cut the shortest within the cost cap: brute force),
the cost slack never pads more and costs at most 1 + SLACK times the cost-first cut, and
checkpoints reshard between owner and even layouts bit for bit (plan_reads), a layout cut
cost first into today's too.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_layout_properties import COMMON, DTYPES, sample_ranks
from test_moe_checkpoint_layout import apply_plan

from zeroshard.checkpoint.testing import expected_partition
from zeroshard.layout import ExpertMesh, GroupSpec, Layout, LayoutPolicy, ParamSpec, build_layout, itemsize, newton_schulz_cost
from zeroshard.layout.owners import (
    SLACK,
    MatrixUnits,
    balanced_bounds,
    bounds_problem,
    compact_bounds,
    cost_first_bounds,
    matrix_units,
    rank_costs,
)

DIMS = st.sampled_from([0, 1, 2, 3, 5, 8, 13, 16, 31, 64])
OWNER_WORLDS = st.one_of(st.integers(1, 9), st.sampled_from([16, 64, 127, 768]))
OWNER_POLICIES = st.builds(
    LayoutPolicy.native,
    alignment_bytes=st.sampled_from([16, 64, 256]),
    bucket_numel=st.one_of(st.none(), st.integers(1, 3000)),
)


@st.composite
def owner_models(draw, world_sizes=OWNER_WORLDS):
    """(world size, groups): dense owner groups of matrices (and a few vectors), even dense
    groups, and expert groups (owner or even) of stacked weights over W / EP ranks."""
    world = draw(world_sizes)
    ep = draw(st.sampled_from([d for d in range(1, min(world, 8) + 1) if world % d == 0]))
    mesh, local = ExpertMesh(world, ep), draw(st.integers(1, 3))
    groups: list = []
    count = 0
    for _ in range(draw(st.integers(1, 3))):
        dtype, kind = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(["owner", "even", "experts", "owner experts"]))
        tails = draw(st.lists(st.lists(DIMS, min_size=1, max_size=2), min_size=1, max_size=6))
        expert = "experts" in kind
        specs = [ParamSpec(f"p{(count := count + 1)}", ((local,) if expert else ()) + tuple(t), dtype) for t in tails]
        if expert:
            groups.append(mesh.expert_group(specs, local * ep, owner=kind == "owner experts"))
        else:
            groups.append(GroupSpec(tuple(specs), owner=kind == "owner"))
    return world, groups


def matrices(group):
    """(param index, first element, elements) of every matrix of an owner group."""
    for slot in group.params:
        if group.is_expert_group and slot.numel:
            per_expert = slot.numel // slot.spec.shape[0]
            for expert in range(slot.spec.shape[0]):
                yield slot.index, expert * per_expert, per_expert
        elif slot.numel:
            yield slot.index, 0, slot.numel


@COMMON
@given(owner_models(), OWNER_POLICIES)
def test_every_matrix_lies_whole_in_one_rank(model, policy):
    world, groups = model
    layout = build_layout(groups, world, policy)
    for group in (g for g in layout.groups if g.owner):
        for index, first, numel in matrices(group):
            holders = [p for p in group.pieces(index) if p.param_start < first + numel and first < p.param_start + p.length]
            assert len(holders) == 1 and holders[0].param_start <= first
            assert first + numel <= holders[0].param_start + holders[0].length


@COMMON
@given(owner_models(), OWNER_POLICIES)
def test_ranks_hold_consecutive_aligned_runs_of_one_buffer(model, policy):
    world, groups = model
    layout = build_layout(groups, world, policy)
    for group in layout.groups:
        if not group.owner:
            assert group.bounds == ()
            continue
        step = policy.alignment_bytes // itemsize(group.dtype)
        assert len(group.bounds) == group.world_size + 1 and group.bounds[0] == 0 and group.bounds[-1] == group.numel
        assert all(a <= b for a, b in zip(group.bounds, group.bounds[1:]))
        assert all(bound % step == 0 for bound in group.bounds)
        assert all(slot.offset % step == 0 for slot in group.params)
        assert group.tail_padding == group.world_size * group.partition_numel - group.logical_numel
        assert group.partition_numel == max(b - a for a, b in zip(group.bounds, group.bounds[1:]))
        for rank in sample_ranks(group.world_size):
            begin, end = group.bounds[rank], group.bounds[rank + 1]
            assert group.partition_ranges(rank) == (((begin, end),) if end > begin else ())
            slices = [group.bucket_slice(b, rank) for b in range(len(group.buckets))]
            covered = sorted((lo, hi, at) for lo, hi, at in slices if hi > lo)
            assert [(lo, at) for lo, _, at in covered] == [(lo, lo - begin) for lo, _, _ in covered]
            assert sum(hi - lo for lo, hi, _ in covered) == end - begin


@COMMON
@given(owner_models(), OWNER_POLICIES)
def test_the_layout_invariants_hold_for_owner_groups(model, policy):
    """As test_layout_properties checks them for even groups."""
    world, groups = model
    layout = build_layout(groups, world, policy)
    assert Layout.from_json(layout.to_json()) == layout
    for group in layout.groups:
        small = group.world_size <= 64
        owned = {slot.index: 0 for slot in group.params}
        for rank in range(group.world_size) if small else sample_ranks(group.world_size):
            fragments = group.fragments(rank)
            runs = sorted([(f.partition_start, f.partition_start + f.length) for f in fragments] + list(group.padding_ranges(rank)))
            assert [start for start, _ in runs] == [0, *(end for _, end in runs)][: len(runs)]
            assert (runs[-1][1] if runs else 0) == group.partition_numel
            for fragment in fragments:
                owned[fragment.param_index] += fragment.length
                piece = [p for p in group.pieces(fragment.param_index) if p.rank == rank and p.param_start == fragment.param_start]
                assert len(piece) == 1 and piece[0].partition_start == fragment.partition_start
                slot = group.params[fragment.param_index]
                logical = slot.logical_offset + fragment.param_start
                found = group.locate_logical(logical, fragment.length)
                assert [(p.rank, p.partition_start, p.length) for p in found] == [(rank, fragment.partition_start, fragment.length)]
        if small:
            assert owned == {slot.index: slot.numel for slot in group.params}
            logical = sorted((r.logical_start, r.length) for rank in range(group.world_size) for r in group.logical_ranges(rank))
            assert sum(length for _, length in logical) == group.logical_numel
            per_rank = group.padding_per_rank()
            counts = (sum(1 for pad in per_rank if pad), sum(1 for pad in per_rank if pad and pad == group.partition_numel))
            assert group.padded_rank_counts() == counts


@COMMON
@given(owner_models(st.integers(1, 9)), st.sampled_from([1, 2, 3, 5, 8, 64, 768]), OWNER_POLICIES)
def test_no_offset_depends_on_the_world_size(model, other_world, policy):
    """An owner group's flat buffer is its world-of-one buffer: only where each rank's
    partition begins depends on the world size (expert groups: on the EP too, so dense only)."""
    world, groups = model
    dense = [g for g in groups if not g.expert_map]
    if not dense:
        return
    here, there = build_layout(dense, world, policy), build_layout(dense, other_world, policy)
    even = build_layout([GroupSpec(g.params) for g in dense], 1, policy)
    for a, b, c in zip(here.groups, there.groups, even.groups):
        assert [(s.logical_offset, s.padding, s.bucket) for s in a.params] == [
            (s.logical_offset, s.padding, s.bucket) for s in b.params
        ]
        assert [s.logical_offset for s in a.params] == [s.logical_offset for s in c.params]
        if a.owner:  # an even group's flat offsets hold its tail paddings, which depend on it
            assert [s.offset for s in a.params] == [s.offset for s in b.params] == [s.logical_offset for s in a.params]
            assert a.numel == a.logical_numel == c.logical_numel


def contiguous_cuts(costs, sizes, prefill):
    """(largest load, longest run) of every contiguous cut of the units over len(prefill)
    ranks: a rank's load is its prefill plus its units' costs, counted where it takes one."""
    count = len(costs)
    for cuts in itertools.combinations_with_replacement(range(count + 1), len(prefill) - 1):
        edges = (0, *cuts, count)
        runs = list(zip(edges, edges[1:]))
        load = max((extra + sum(costs[a:b]) for extra, (a, b) in zip(prefill, runs) if b > a), default=0)
        yield load, max(sum(sizes[a:b]) for a, b in runs)


@COMMON
@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(1, 20)), min_size=1, max_size=8),
    st.lists(st.integers(0, 60), min_size=1, max_size=4),
    st.integers(0, 200),
)
def test_a_group_is_cut_to_the_shortest_run_within_the_cost_cap(units, prefill, cap):
    """compact_bounds against every contiguous cut: the shortest longest run among those
    whose loads stay within the cap, then at that run the least largest load; None when
    no cut stays within the cap."""
    costs, sizes = [cost for cost, _ in units], [size for _, size in units]
    matrix = MatrixUnits(tuple(itertools.accumulate(sizes)), tuple(costs))
    within = [(size, load) for load, size in contiguous_cuts(costs, sizes, prefill) if load <= cap]
    bounds = compact_bounds(matrix, len(prefill), prefill, cap)
    if not within:
        assert bounds is None
        return
    runs = list(zip(bounds, bounds[1:]))
    loads = [extra + cost for extra, cost, (a, b) in zip(prefill, rank_costs(matrix, bounds), runs) if b > a]
    assert (max(b - a for a, b in runs), max(loads, default=0)) == min(within)


@COMMON
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=7),
    st.integers(1, 4),
    st.sampled_from(["float32", "bfloat16"]),
)
def test_one_group_is_cut_to_the_shortest_run_within_the_slack(shapes, world_size, dtype):
    """Against every contiguous cut: the cost-first cut is the cheapest (then the shortest);
    the layout's is the shortest whose cost stays within the cap (the cheapest cut's, or
    the mean's times 1 + SLACK if more), then the cheapest at that run."""
    group = GroupSpec(tuple(ParamSpec(f"w{i}", shape, dtype) for i, shape in enumerate(shapes)), owner=True)
    layout = build_layout([group], world_size)
    laid = layout.groups[0]
    alignment = 16 // itemsize(dtype)
    costs = [newton_schulz_cost(shape) for shape in shapes]
    sizes = [slot.numel + slot.padding for slot in laid.params]
    cuts = list(contiguous_cuts(costs, sizes, [0] * world_size))
    cost_first = cost_first_bounds([laid], [True], world_size, [alignment])[0]
    assert cost_first == balanced_bounds(matrix_units(laid, alignment), world_size, [0] * world_size)
    cheapest = min(cuts)
    first_run = max(b - a for a, b in zip(cost_first, cost_first[1:]))
    assert (max(rank_costs(matrix_units(laid, alignment), cost_first)), first_run) == cheapest
    cap = max(cheapest[0], math.floor(Fraction(sum(costs), world_size) * (1 + SLACK)))
    shortest = min((size, load) for load, size in cuts if load <= cap)
    assert (laid.partition_numel, max(layout.owner_balance().costs)) == shortest


@st.composite
def dense_then_experts(draw):
    """(world size, groups): a dense owner group of a few matrices, then an owner group of
    many like experts: where the dense matrices leave the ranks' costs uneven, cost first
    pays for evening them with uneven expert runs, which the slack can spare."""
    world = draw(st.sampled_from([2, 3, 4, 8]))
    ep = draw(st.sampled_from([d for d in (1, 2, 4) if world % d == 0]))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    dims = st.tuples(st.integers(1, 8), st.integers(1, 8).map(lambda n: 8 * n))
    dense = draw(st.lists(dims, min_size=1, max_size=4))
    local, expert = draw(st.integers(20, 200)), draw(dims)
    stack = ExpertMesh(world, ep).expert_group([ParamSpec("moe.w", (local, *expert), dtype)], local * ep, owner=True)
    matrices = tuple(ParamSpec(f"d{i}", shape, dtype) for i, shape in enumerate(dense))
    return world, [GroupSpec(matrices, owner=True), stack]


def with_bounds(layout, all_bounds):
    """``layout`` with its owner groups cut at ``all_bounds`` (``()``: a group left as it is)."""
    groups = tuple(dataclasses.replace(g, bounds=tuple(b)) if b else g for g, b in zip(layout.groups, all_bounds))
    return Layout(layout.world_size, layout.policy, groups)


def compact_in_order(layout, alignments, cap):
    """Each owner group in order cut by compact_bounds under ``cap``, its ranks carrying the
    loads of the groups before it (an expert shard rank the largest of those it stands
    for); None where one cannot stay within ``cap``."""
    load, found = [0] * layout.world_size, []
    for group, alignment in zip(layout.groups, alignments):
        if not group.owner:
            found.append(())
            continue
        ep, units = layout.world_size // group.world_size, matrix_units(group, alignment)
        prefill = [max(load[shard * ep : (shard + 1) * ep]) for shard in range(group.world_size)]
        bounds = compact_bounds(units, group.world_size, prefill, cap)
        if bounds is None:
            return None
        for rank in range(layout.world_size):
            load[rank] += rank_costs(units, bounds)[rank // ep]
        found.append(bounds)
    return found


@COMMON
@given(st.one_of(owner_models(), dense_then_experts()), OWNER_POLICIES)
def test_the_slack_pads_no_more_and_costs_at_most_its_share_more(model, policy):
    """Against the cost-first cut of the same groups: no more partition bytes on a rank (its
    partition of every owner group, each the group's longest run: what padding costs in
    memory), the largest cost within the cap (so at most 1 + SLACK times the cost-first
    one), no more bytes than the compact cut either, and every bound between whole matrices."""
    world, groups = model
    layout = build_layout(groups, world, policy)
    alignments = [policy.partition_alignment(g.dtype) for g in layout.groups]
    owners = [g.owner for g in layout.groups]
    cost_first = with_bounds(layout, cost_first_bounds(layout.groups, owners, world, alignments))
    first_costs, costs = cost_first.owner_balance().costs, layout.owner_balance().costs
    cap = max(max(first_costs), math.floor(Fraction(sum(first_costs), world) * (1 + SLACK)))
    assert sum(costs) == sum(first_costs) and max(costs) <= cap <= max(first_costs) * (1 + SLACK)
    assert rank_bytes(layout) <= rank_bytes(cost_first)
    compact = compact_in_order(layout, alignments, cap)
    if compact is not None:
        assert rank_bytes(layout) <= rank_bytes(with_bounds(layout, compact))
    for group, alignment in zip(layout.groups, alignments):
        if group.owner:
            assert bounds_problem(group, list(group.bounds), alignment) is None


def rank_bytes(layout: Layout) -> int:
    """Bytes of one rank's partitions of the owner groups (an expert group's included)."""
    return sum(group.partition_numel * itemsize(group.dtype) for group in layout.groups if group.owner)


def slack_example():
    """A q of cost 64 (float32 [4, 4]) beside E experts of cost 8 ([2, 2], 4 elements each)
    on two ranks. Cost first evens the loads: rank 0, holding q, takes E / 2 - 4 experts
    (64 + 8k = 8(E - k)), so the expert partitions are 4(E / 2 + 4) elements, 32 of them
    padding. Even expert runs cost rank 0 64 + 4E against a mean of 32 + 4E: within
    1 + SLACK from E = 8 / SLACK - 8 on."""
    experts = 2 * math.ceil((8 / SLACK - 8) / 2)
    dense = GroupSpec((ParamSpec("q", (4, 4), "float32"),), owner=True)
    stack = ExpertMesh(2, 1).expert_group([ParamSpec("moe.w", (experts, 2, 2), "float32")], experts, owner=True)
    return experts, build_layout([dense, stack], 2)


def test_the_slack_evens_the_experts_beside_a_costly_matrix():
    experts, layout = slack_example()
    cost_first = with_bounds(layout, cost_first_bounds(layout.groups, [True, True], 2, [4, 4]))
    assert cost_first.groups[1].bounds == (0, 4 * (experts // 2 - 4), 4 * experts)
    assert cost_first.groups[1].tail_padding == 32 and cost_first.owner_balance().costs == (32 + 4 * experts,) * 2
    assert layout.groups[1].bounds == (0, 2 * experts, 4 * experts) and layout.groups[1].tail_padding == 0
    assert layout.owner_balance().costs == (64 + 4 * experts, 4 * experts)
    assert layout.owner_balance().imbalance <= 1 + SLACK


def test_a_layout_recorded_with_the_cost_first_cut_still_loads():
    """A layout JSON (and so a checkpoint) written by a zeroshard that cut cost first opens
    with its recorded bounds, and its partitions reshard into today's layout bit for bit."""
    _, layout = slack_example()
    cost_first = with_bounds(layout, cost_first_bounds(layout.groups, [True, True], 2, [4, 4]))
    assert cost_first != layout
    assert Layout.from_json(cost_first.to_json()) == cost_first
    for rank in range(2):
        for group, partition in enumerate(apply_plan(cost_first, layout, rank)):
            assert torch.equal(partition, expected_partition(layout, rank, group, "fp32")), (rank, group)


def test_balance_counts_newton_schulz_cost_across_groups():
    """Two groups of four equal matrices on two ranks: each rank gets two of each; an
    expert owner group is cut between experts, and its shard ranks carry the dense loads."""
    dense = GroupSpec(tuple(ParamSpec(f"d{i}", (8, 4), "float32") for i in range(4)), owner=True)
    layout = build_layout([dense, GroupSpec(tuple(ParamSpec(f"e{i}", (4, 4), "float32") for i in range(4)), owner=True)], 2)
    assert layout.owner_balance().costs == (2 * 8 * 16 + 2 * 64, 2 * 8 * 16 + 2 * 64)
    # W = 4, EP = 2: q (cost 512) lies on global rank 0, which is shard rank 0 of EP rank 0's
    # experts: any expert there (128 each) would raise the largest load, so shard rank 1
    # (global ranks 2 and 3) takes all three of its EP rank's experts.
    mesh = ExpertMesh(4, 2)
    stack = mesh.expert_group([ParamSpec("moe.w", (3, 4, 8), "float32")], 6, owner=True)
    layout = build_layout([GroupSpec((ParamSpec("q", (8, 8), "float32"),), owner=True), stack], 4)
    assert layout.groups[1].bounds == (0, 0, 96)
    assert layout.owner_balance().costs == (512, 0, 384, 384)
    # Cut between experts, never inside one, where the load allows.
    layout = build_layout([GroupSpec((ParamSpec("q", (2, 2), "float32"),), owner=True), stack], 4)
    assert layout.groups[1].bounds == (0, 32, 96) and layout.owner_balance().costs == (8 + 128, 128, 256, 256)


def test_experts_not_ending_aligned_stay_together():
    """Experts of 3 float32 elements: a partition start must be a multiple of 4 elements, so
    rank boundaries fall only after every fourth expert."""
    group = ExpertMesh(2, 1).expert_group([ParamSpec("moe.w", (8, 1, 3), "float32")], 8, owner=True)
    laid = build_layout([group], 2).groups[0]
    assert laid.bounds == (0, 12, 24)
    assert matrix_units(laid, 4).ends == (12, 24)


def test_json_names_the_owner_groups_and_reads_any_cut_between_matrices():
    """Recorded bounds are read as recorded when they cut between whole matrices (another
    balancing, an older or newer zeroshard, may have chosen them): its checkpoints still
    open. Bounds inside a matrix, unaligned, decreasing or of another count are refused."""
    layout = build_layout([GroupSpec((ParamSpec("a", (4, 4), "float32"), ParamSpec("b", (4, 4), "float32")), owner=True)], 2)
    data = json.loads(layout.to_json())
    assert data["version"] == 4 and data["groups"][0]["owner"] is True and data["groups"][0]["bounds"] == [0, 16, 32]
    data["groups"][0]["bounds"] = [0, 32, 32]
    data["groups"][0]["partition_numel"] = 32
    other = Layout.from_dict(data)
    assert other.groups[0].bounds == (0, 32, 32) and other.groups[0].partition_ranges(1) == ()
    assert [f.name for f in other.groups[0].fragments(0)] == ["a", "b"]
    for bounds, problem in (
        ([0, 8, 32], "falls inside a matrix"),
        ([0, 32, 16], "do not rise from 0"),
        ([0, 16, 30], "do not rise from 0"),
        ([0, 32], "not a list of 3 integers"),
        ([0, 32.0, 32], "not a list of 3 integers"),
    ):
        data["groups"][0]["bounds"] = bounds
        with pytest.raises(ValueError, match=f"layout JSON is inconsistent: owner group 0: .*{problem}"):
            Layout.from_dict(data)
    data["groups"][0]["bounds"] = [0, 32, 32]
    data["groups"][0]["partition_numel"] = 16  # what the recorded bounds do not give
    with pytest.raises(ValueError, match="layout JSON is inconsistent: its offsets and sizes"):
        Layout.from_dict(data)
    even = build_layout([[ParamSpec("a", (4, 4), "float32")]], 2)
    assert json.loads(even.to_json())["version"] == 1 and "owner" not in even.to_json()


@pytest.mark.parametrize(
    "policy, message",
    [
        (LayoutPolicy.deepspeed(), "needs the native policy"),
        (LayoutPolicy.native(compact=True), "needs the native policy"),
    ],
)
def test_owner_groups_need_aligned_parameters(policy, message):
    with pytest.raises(ValueError, match=message):
        build_layout([GroupSpec((ParamSpec("a", (4, 4), "float32"),), owner=True)], 2, policy)


def test_bucket_rank_range_of_an_owner_group_points_to_bucket_slice():
    laid = build_layout([GroupSpec((ParamSpec("a", (4, 4), "float32"),), owner=True)], 2).groups[0]
    with pytest.raises(ValueError, match="use GroupLayout.bucket_slice"):
        laid.buckets[0].rank_range(0)
    assert laid.bucket_slice(0, 0) == (0, 16, 0) and laid.bucket_slice(0, 1) == (16, 16, 0)


@COMMON
@given(owner_models(st.sampled_from([1, 2, 3, 4, 6, 8])), st.sampled_from([1, 2, 3, 4, 6, 8]), OWNER_POLICIES, st.booleans())
def test_checkpoints_reshard_between_owner_and_even_layouts_bit_for_bit(model, new_world, policy, flip):
    """plan_reads from every old rank's partitions fills every new rank's exactly, between
    owner layouts at two world sizes and from an owner layout to an even one (or back)."""
    world, groups = model
    dense = [g for g in groups if not g.expert_map]
    if not dense:
        return
    old = build_layout(dense, world, policy)
    as_even = [GroupSpec(g.params, owner=False) if flip else g for g in dense]
    new = build_layout(as_even, new_world, policy)
    for layout_from, layout_to in ((old, new), (new, old)):
        for rank in range(layout_to.world_size):
            for group, partition in enumerate(apply_plan(layout_from, layout_to, rank)):
                assert torch.equal(partition, expected_partition(layout_to, rank, group, "fp32")), (rank, group)
    assert math.isfinite(old.owner_balance().imbalance)
