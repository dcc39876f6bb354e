"""Property tests of the layout invariants over random models, policies and world sizes."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeroshard.layout import Layout, LayoutPolicy, ParamSpec, build_layout, itemsize

DTYPES = ["float32", "bfloat16", "float16"]
# Sizes that stress alignment: empty, 1-element, primes, and a few larger ones.
DIMS = st.sampled_from([0, 1, 2, 3, 5, 7, 8, 11, 13, 16, 31, 97, 127, 509, 1031])
SHAPES = st.lists(DIMS, min_size=0, max_size=3).map(tuple)
WORLD_SIZES = st.one_of(st.integers(1, 9), st.sampled_from([16, 64, 127, 768, 1024, 4096]))
POLICIES = st.one_of(
    st.builds(
        LayoutPolicy.native,
        alignment_bytes=st.sampled_from([16, 64, 128, 256]),
        compact=st.booleans(),
        bucket_numel=st.one_of(st.none(), st.integers(1, 4000)),
    ),
    st.builds(LayoutPolicy.deepspeed, parameter_alignment=st.booleans()),
)


@st.composite
def models(draw):
    groups = []
    count = 0
    for _ in range(draw(st.integers(1, 3))):
        dtype = draw(st.sampled_from(DTYPES))
        shapes = draw(st.lists(SHAPES, min_size=1, max_size=8))
        groups.append([ParamSpec(f"p{(count := count + 1)}", shape, dtype) for shape in shapes])
    return groups


COMMON = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def sample_ranks(world_size: int) -> list[int]:
    """All ranks for small worlds; the ends and a random sample for large ones."""
    if world_size <= 16:
        return list(range(world_size))
    return sorted({0, 1, world_size - 2, world_size - 1, *random.Random(world_size).sample(range(world_size), 8)})


@COMMON
@given(models(), WORLD_SIZES, POLICIES)
def test_every_element_owned_exactly_once(groups, world_size, policy):
    layout = build_layout(groups, world_size, policy)
    for group in layout.groups:
        owned = {slot.index: [] for slot in group.params}
        for rank in range(min(world_size, 64)):
            for fragment in group.fragments(rank):
                owned[fragment.param_index].append((fragment.param_start, fragment.length))
        if world_size <= 64:
            for slot in group.params:
                covered = sorted(owned[slot.index])
                cursor = 0
                for start, length in covered:
                    assert start == cursor and length > 0
                    cursor += length
                assert cursor == slot.numel


@COMMON
@given(models(), WORLD_SIZES, POLICIES)
def test_pieces_reassemble_every_param_and_match_fragments(groups, world_size, policy):
    layout = build_layout(groups, world_size, policy)
    for group in layout.groups:
        for slot in group.params:
            pieces = group.pieces(slot.index)
            assert sum(piece.length for piece in pieces) == slot.numel
            cursor = 0
            for piece in pieces:
                assert piece.param_start == cursor
                cursor += piece.length
                assert 0 <= piece.partition_start
                assert piece.partition_start + piece.length <= group.partition_numel
                # The owning rank lists the same run among its fragments.
                fragments = group.fragments(piece.rank)
                assert any(
                    f.param_index == slot.index
                    and f.param_start == piece.param_start
                    and f.partition_start == piece.partition_start
                    and f.length == piece.length
                    for f in fragments
                )


@COMMON
@given(models(), WORLD_SIZES, POLICIES)
def test_partitions_tile_the_buffer(groups, world_size, policy):
    layout = build_layout(groups, world_size, policy)
    for group in layout.groups:
        assert group.numel == group.partition_numel * world_size
        expected_start = 0
        for bucket in group.buckets:
            assert bucket.start == expected_start
            assert bucket.numel % world_size == 0
            for rank in (0, world_size - 1):
                begin, end = bucket.rank_range(rank)
                assert begin == bucket.start + rank * bucket.partition_numel
            assert bucket.rank_range(world_size - 1)[1] == bucket.end
            expected_start = bucket.end
        assert expected_start == group.numel


@COMMON
@given(models(), WORLD_SIZES, POLICIES)
def test_fragments_and_padding_tile_each_partition(groups, world_size, policy):
    layout = build_layout(groups, world_size, policy)
    for group in layout.groups:
        for rank in sample_ranks(world_size):
            runs = [(f.partition_start, f.partition_start + f.length) for f in group.fragments(rank)]
            runs += list(group.padding_ranges(rank))
            runs.sort()
            cursor = 0
            for start, end in runs:
                assert start == cursor and end > start
                cursor = end
            assert cursor == group.partition_numel
            padding = sum(end - start for start, end in group.padding_ranges(rank))
            assert padding == group.padding_per_rank()[rank]


@COMMON
@given(models(), WORLD_SIZES, POLICIES)
def test_alignment_of_params_and_partitions(groups, world_size, policy):
    layout = build_layout(groups, world_size, policy)
    for group in layout.groups:
        size = itemsize(group.dtype)
        if policy.kind == "native":
            if not policy.compact:
                assert all(slot.offset * size % policy.alignment_bytes == 0 for slot in group.params)
            for bucket in group.buckets:
                for rank in (0, world_size // 2, world_size - 1):
                    assert bucket.rank_range(rank)[0] * size % policy.alignment_bytes == 0
        elif policy.parameter_alignment:
            # DeepSpeed leaves empty parameters out of its buffer; where they sit is moot.
            assert all(slot.offset * size % 16 == 0 for slot in group.params if slot.numel)


@COMMON
@given(models(), st.integers(1, 64), st.sampled_from([1, 2, 3, 768, 4096]), POLICIES)
def test_logical_offsets_do_not_depend_on_world_size(groups, world_a, world_b, policy):
    layout_a = build_layout(groups, world_a, policy)
    layout_b = build_layout(groups, world_b, policy)
    for group_a, group_b in zip(layout_a.groups, layout_b.groups):
        assert [s.logical_offset for s in group_a.params] == [s.logical_offset for s in group_b.params]
        assert group_a.logical_numel == group_b.logical_numel
        assert [s.padding for s in group_a.params] == [s.padding for s in group_b.params]


@COMMON
@given(models(), WORLD_SIZES, POLICIES)
def test_logical_ranges_cover_the_logical_buffer_once(groups, world_size, policy):
    layout = build_layout(groups, world_size, policy)
    for group in layout.groups:
        if world_size > 64:
            continue
        runs = sorted((r.logical_start, r.length) for rank in range(world_size) for r in group.logical_ranges(rank))
        cursor = 0
        for start, length in runs:
            assert start == cursor
            cursor += length
        assert cursor == group.logical_numel
        # A fragment's logical position is its parameter's logical offset plus its start.
        for rank in range(world_size):
            ranges = group.logical_ranges(rank)
            for fragment in group.fragments(rank):
                owner = next(r for r in ranges if r.partition_start <= fragment.partition_start < r.partition_start + r.length)
                logical = owner.logical_start + fragment.partition_start - owner.partition_start
                assert logical == group.params[fragment.param_index].logical_offset + fragment.param_start


@COMMON
@given(models(), WORLD_SIZES, POLICIES)
def test_json_round_trip_is_identity(groups, world_size, policy):
    layout = build_layout(groups, world_size, policy)
    again = Layout.from_json(layout.to_json())
    assert again == layout
    assert again.to_json() == layout.to_json()


@COMMON
@given(models(), WORLD_SIZES, POLICIES, st.data())
def test_locate_logical_inverts_logical_ranges(groups, world_size, policy, data):
    layout = build_layout(groups, world_size, policy)
    for group in layout.groups:
        if group.logical_numel == 0:
            continue
        start = data.draw(st.integers(0, group.logical_numel - 1))
        length = data.draw(st.integers(0, group.logical_numel - start))
        pieces = group.locate_logical(start, length)
        assert sum(p.length for p in pieces) == length
        position = start
        for piece in pieces:
            assert piece.logical_start == position
            owner = [r for r in group.logical_ranges(piece.rank) if r.partition_start <= piece.partition_start < r.partition_start + r.length]
            assert len(owner) == 1
            assert owner[0].logical_start + piece.partition_start - owner[0].partition_start == piece.logical_start
            assert piece.partition_start + piece.length <= owner[0].partition_start + owner[0].length
            position += piece.length


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models(), st.one_of(st.integers(1, 9), st.sampled_from([16, 64, 127, 768])), POLICIES)
def test_padded_rank_counts_match_the_per_rank_padding(groups, world_size, policy):
    """The layout report counts ranks with padding without a loop over the ranks."""
    for group in build_layout(groups, world_size, policy).groups:
        per_rank = group.padding_per_rank()
        expected = (sum(1 for pad in per_rank if pad), sum(1 for pad in per_rank if pad and pad == group.partition_numel))
        assert group.padded_rank_counts() == expected
