"""Worked cases and bad input for the layout."""

from __future__ import annotations

import json
import math

import pytest

from zeroshard.layout import Layout, LayoutPolicy, ParamSpec, build_layout
from zeroshard.models import OddSizedModel, param_specs


def test_large_dp_regression_from_universal_checkpoint_review():
    """DeepSpeed policy, compact, bf16, 266240 elements at D=768: padding spans three ranks."""
    numel, world = 266240, 768
    # DeepSpeed pads a group to a multiple of (4 bytes / 2 bytes per bf16) * D elements.
    multiple = (4 // 2) * world  # 1536
    padded = math.ceil(numel / multiple) * multiple  # 174 * 1536
    expected_partition = padded // world
    expected_padding = padded - numel
    assert (expected_partition, expected_padding) == (348, 1024)  # the numbers in the review
    full_ranks, real_on_boundary = divmod(numel, expected_partition)  # 765 full ranks, 20 elements on rank 765

    layout = build_layout([[ParamSpec("flat", (numel,), "bfloat16")]], world, LayoutPolicy.deepspeed())
    group = layout.groups[0]
    assert group.partition_numel == expected_partition
    assert group.tail_padding == expected_padding
    assert layout.padding().padding_elements == expected_padding
    padding = group.padding_per_rank()
    expected = [0] * full_ranks + [expected_partition - real_on_boundary] + [expected_partition] * (world - full_ranks - 1)
    assert list(padding) == expected
    assert {rank for rank, pad in enumerate(padding) if pad} == {765, 766, 767}
    # Ranks made of padding alone have no fragments; their whole partition is one padding run.
    assert group.fragments(767) == ()
    assert group.padding_ranges(767) == ((0, expected_partition),)
    assert group.fragments(765)[0].length == real_on_boundary


def test_rank_with_only_padding_in_a_small_group():
    """A 9-element bf16 no-decay group at D=16 (native): most ranks hold padding only."""
    layout = build_layout([[ParamSpec("ln.weight", (9,), "bfloat16")]], 16)
    group = layout.groups[0]
    # 9 elements, padded to 16 (16 bytes), then to 16 ranks x 8 elements.
    assert group.numel == 16 * 8 and group.partition_numel == 8
    assert group.fragments(0)[0].length == 8
    assert group.fragments(1)[0].length == 1
    assert all(group.fragments(rank) == () for rank in range(2, 16))


def test_one_param_spanning_many_ranks():
    layout = build_layout([[ParamSpec("w", (1000,), "float32")]], 64)
    pieces = layout.groups[0].pieces(0)
    assert [p.rank for p in pieces] == list(range(len(pieces)))
    assert sum(p.length for p in pieces) == 1000


def test_empty_and_scalar_params():
    layout = build_layout([[("empty", (0, 4), "bf16"), ("scalar", (), "bf16"), ("after", (3,), "bf16")]], 2)
    group = layout.groups[0]
    assert group.pieces(0) == ()
    assert [s.offset for s in group.params] == [0, 0, 8]
    assert sum(p.length for p in group.pieces(1)) == 1


def test_buckets_are_partitioned_on_their_own():
    specs = [ParamSpec(f"p{i}", (100,), "bfloat16") for i in range(5)]
    layout = build_layout([specs], 4, LayoutPolicy.native(bucket_numel=250))
    group = layout.groups[0]
    assert [b.num_params for b in group.buckets] == [2, 2, 1]
    # Each bucket's slice of rank 1 sits at the bucket's place in rank 1's partition.
    assert [r[0] for r in group.partition_ranges(1)] == [b.start + b.partition_numel for b in group.buckets]
    assert group.partition_numel == sum(b.partition_numel for b in group.buckets)


def test_compact_layout_of_odd_fixture_is_misaligned_and_native_is_not():
    specs = param_specs(OddSizedModel(), dtype="bfloat16")
    compact = build_layout([specs], 2, LayoutPolicy.native(compact=True))
    aligned = build_layout([specs], 2)
    assert any(slot.offset * 2 % 16 for slot in compact.groups[0].params)
    assert all(slot.offset * 2 % 16 == 0 for slot in aligned.groups[0].params)


def test_deepspeed_parameter_alignment_pads_all_but_last():
    specs = [ParamSpec("a", (3,), "bfloat16"), ParamSpec("b", (5,), "bfloat16")]
    group = build_layout([specs], 2, LayoutPolicy.deepspeed(parameter_alignment=True)).groups[0]
    assert [(s.offset, s.padding) for s in group.params] == [(0, 5), (8, 0)]
    assert group.logical_numel == 13 and group.numel == 16  # tail to a multiple of 2 x 2


@pytest.mark.parametrize(
    "groups, world, policy, message",
    [
        ([[("w", (3,), "int7")]], 2, None, "'w'.*unknown dtype"),
        ([[("w", (3, -1), "bf16")]], 2, None, "'w'.*negative dimension"),
        ([[("w", (3, 2.5), "bf16")]], 2, None, "'w'.*non-integer"),
        ([[("w", (3,), "bf16")]], 0, None, "world size"),
        ([[("w", (3,), "bf16")]], 2.0, None, "world size"),
        ([[("w", (3,), "fp32")]], 2, LayoutPolicy.native(alignment_bytes=6), "'w'.*not a multiple of the 4-byte"),
        ([[("w", (3,), "bf16")], [("w", (4,), "bf16")]], 2, None, "'w' appears more than once"),
        ([[("w", (3,), "bf16"), ("v", (3,), "fp32")]], 2, None, "'v' is float32 but group 0 is bfloat16"),
        ([[]], 2, None, "group 0 has no parameters"),
    ],
)
def test_bad_input_names_the_problem(groups, world, policy, message):
    with pytest.raises(ValueError, match=message):
        build_layout(groups, world, policy)


def test_bad_policy_values():
    with pytest.raises(ValueError, match="alignment_bytes"):
        LayoutPolicy.native(alignment_bytes=0)
    with pytest.raises(ValueError, match="bucket_numel"):
        LayoutPolicy.native(bucket_numel=-5)
    with pytest.raises(ValueError, match="kind"):
        LayoutPolicy("megatron")


def test_json_rejects_other_versions_and_tampered_offsets():
    layout = build_layout([[("a", (3,), "bf16"), ("b", (5,), "bf16")]], 2)
    data = layout.to_dict()
    with pytest.raises(ValueError, match="version 99"):
        Layout.from_dict({**data, "version": 99})
    tampered = json.loads(layout.to_json())
    tampered["groups"][0]["params"][1]["offset"] = 3
    with pytest.raises(ValueError, match="inconsistent"):
        Layout.from_dict(tampered)
    with pytest.raises(ValueError, match="malformed"):
        Layout.from_dict({**data, "groups": [{"dtype": "bf16", "params": [{"name": "a"}]}]})


def test_deepspeed_worked_example_from_its_source():
    """bf16, parameter_alignment, numels 35,7,21,3,3,1: pads after each start at multiples of 8."""
    specs = [ParamSpec(f"p{i}", (n,), "bfloat16") for i, n in enumerate([35, 7, 21, 3, 3, 1])]
    group = build_layout([specs], 2, LayoutPolicy.deepspeed(parameter_alignment=True)).groups[0]
    offsets = [s.offset for s in group.params]
    paddings = [s.padding for s in group.params]
    # Each start is the previous end rounded up to 8 elements; nothing after the last.
    expected_offsets = [0]
    for n in [35, 7, 21, 3, 3]:
        expected_offsets.append(-(-(expected_offsets[-1] + n) // 8) * 8)
    assert offsets == expected_offsets
    assert paddings[-1] == 0 and group.logical_numel == offsets[-1] + 1
    assert group.numel == -(-group.logical_numel // 4) * 4  # tail to a multiple of 2 x D elements


def test_deepspeed_empty_params_after_the_last_take_no_padding():
    specs = [ParamSpec("a", (3,), "bfloat16"), ParamSpec("b", (5,), "bfloat16"), ParamSpec("empty", (0,), "bfloat16")]
    group = build_layout([specs], 2, LayoutPolicy.deepspeed(parameter_alignment=True)).groups[0]
    assert [(s.offset, s.padding) for s in group.params] == [(0, 5), (8, 0), (13, 0)]
