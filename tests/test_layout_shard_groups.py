"""Shard groups in the layout: expert groups partitioned over W / EP ranks next to dense ones,
the expert map, the JSON versions, and the EP x DP rank arithmetic of ExpertMesh."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_layout_properties import COMMON, DIMS, DTYPES, POLICIES

from zeroshard.layout import (
    DENSE_SHARD_GROUP,
    EXPERT_SHARD_GROUP,
    ExpertMesh,
    GroupSpec,
    Layout,
    LayoutPolicy,
    ParamSpec,
    build_layout,
    contiguous_expert_map,
)

# Written by zeroshard before shard groups existed (version 1): it must read as dense groups.
VERSION_1_JSON = (
    '{"format": "zeroshard.layout", "version": 1, "world_size": 2, "policy": {"kind": "native", "alignment_bytes": 16, '
    '"compact": false, "parameter_alignment": false, "bucket_numel": null}, "groups": [{"dtype": "bfloat16", "numel": 32, '
    '"partition_numel": 16, "params": [{"name": "w", "shape": [3, 5], "offset": 0, "padding": 1, "logical_offset": 0, '
    '"bucket": 0}, {"name": "b", "shape": [5], "offset": 16, "padding": 3, "logical_offset": 16, "bucket": 0}], "buckets": '
    '[{"start": 0, "content_numel": 24, "tail_padding": 8, "partition_numel": 16}]}, {"dtype": "float32", "numel": 8, '
    '"partition_numel": 4, "params": [{"name": "n", "shape": [7], "offset": 0, "padding": 1, "logical_offset": 0, '
    '"bucket": 0}], "buckets": [{"start": 0, "content_numel": 8, "tail_padding": 0, "partition_numel": 4}]}]}'
)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def moe_models(draw):
    """(W, EP, groups): dense groups and expert groups of stacked [E / EP, ...] weights."""
    world = draw(st.one_of(st.integers(1, 12), st.sampled_from([16, 64, 768])))
    ep = draw(st.sampled_from([d for d in divisors(world) if d <= 16]))
    local = draw(st.integers(1, 3))
    mesh = ExpertMesh(world, ep)
    groups: list[list[ParamSpec] | GroupSpec] = []
    count = 0
    for _ in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        expert = draw(st.booleans())
        tails = draw(st.lists(st.lists(DIMS, min_size=0, max_size=2), min_size=1, max_size=4))
        specs = [ParamSpec(f"p{(count := count + 1)}", ((local,) if expert else ()) + tuple(tail), dtype) for tail in tails]
        groups.append(mesh.expert_group(specs, local * ep) if expert else specs)
    return world, ep, groups


def params_of(group: list[ParamSpec] | GroupSpec) -> list[ParamSpec]:
    return list(group.params) if isinstance(group, GroupSpec) else group


@COMMON
@given(moe_models(), POLICIES)
def test_each_group_is_the_dense_layout_of_its_shard_group(model, policy):
    """An expert group at (W, EP) is laid out exactly as a dense group over W / EP ranks, and
    dense groups are untouched by the expert groups beside them: every dense invariant holds."""
    world, ep, groups = model
    layout = build_layout(groups, world, policy)
    for group, spec in zip(layout.groups, groups):
        expert = isinstance(spec, GroupSpec)
        size = world // ep if expert else world
        assert group.world_size == size
        assert group.shard_group == (EXPERT_SHARD_GROUP if expert else DENSE_SHARD_GROUP)
        local = spec.params[0].shape[0] if expert else 0
        assert group.expert_map == (contiguous_expert_map(local * ep, ep) if expert else ())
        dense = build_layout([params_of(spec)], size, policy).groups[0]
        as_dense = dataclasses.replace(group, index=0, shard_group=DENSE_SHARD_GROUP, expert_map=(), stacks=())
        assert as_dense == dense
        assert group.numel == group.partition_numel * size


@COMMON
@given(moe_models(), POLICIES)
def test_mixed_groups_tile_and_take_ranks_of_their_shard_group(model, policy):
    world, ep, groups = model
    layout = build_layout(groups, world, policy)
    for group in layout.groups:
        if group.world_size > 64:
            continue
        covered = {slot.index: 0 for slot in group.params}
        for rank in range(group.world_size):
            for fragment in group.fragments(rank):
                covered[fragment.param_index] += fragment.length
        assert covered == {slot.index: slot.numel for slot in group.params}
        with pytest.raises(ValueError, match=f"outside world size {group.world_size}"):
            group.fragments(group.world_size)


@COMMON
@given(moe_models(), POLICIES)
def test_mixed_json_round_trip_and_version(model, policy):
    world, ep, groups = model
    layout = build_layout(groups, world, policy)
    data = layout.to_dict()
    assert data["version"] == (1 if layout.is_dense else 2)
    again = Layout.from_json(layout.to_json())
    assert again == layout
    assert again.to_json() == layout.to_json()
    assert [g.expert_map for g in again.groups] == [g.expert_map for g in layout.groups]
    assert layout.with_policy(LayoutPolicy.native(compact=True)).shard_groups == layout.shard_groups


def test_expert_map_is_data_and_names_global_experts():
    mesh = ExpertMesh(8, 4)
    experts = [ParamSpec.of("moe.w1", (2, 8, 16), "bf16"), ParamSpec.of("moe.w2", (2, 16, 8), "bf16")]
    layout = build_layout([[("embed", (10, 8), "bf16")], mesh.expert_group(experts, 8)], 8)
    dense, expert = layout.groups
    assert (dense.world_size, dense.shard_group, dense.expert_map) == (8, "dp", ())
    assert (expert.world_size, expert.shard_group) == (2, "expert_dp")
    assert expert.expert_map == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.shard_groups == {"dp": 8, "expert_dp": 2}
    # Global rank 6 is EP rank 2 (experts 4 and 5) and expert-DP rank 1 of its group.
    assert expert.expert_map[mesh.ep_rank(6)] == (4, 5)
    assert expert.fragments(mesh.expert_dp_rank(6)) == expert.fragments(1)
    assert json.loads(layout.to_json())["groups"][1]["expert_map"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert not layout.is_dense and layout.groups[1].is_expert_group


def test_version_1_json_reads_as_dense_and_dense_layouts_still_write_it():
    layout = Layout.from_json(VERSION_1_JSON)
    assert layout.is_dense and all(g.world_size == 2 and g.shard_group == "dp" for g in layout.groups)
    assert layout.to_json() == VERSION_1_JSON
    # Shard-group fields are not part of version 1.
    data = json.loads(VERSION_1_JSON)
    data["groups"][0]["shard_group"] = "dp"
    with pytest.raises(ValueError, match="inconsistent"):
        Layout.from_dict(data)


def test_version_2_json_is_checked():
    layout = build_layout([[("a", (3,), "bf16")], ExpertMesh(4, 2).expert_group([ParamSpec.of("e", (1, 5), "bf16")], 2)], 4)
    data = layout.to_dict()
    tampered = json.loads(json.dumps(data))
    tampered["groups"][1]["world_size"] = 4
    with pytest.raises(ValueError, match="2 expert-parallel ranks x 4 ranks"):
        Layout.from_dict(tampered)
    tampered = json.loads(json.dumps(data))
    tampered["groups"][1]["expert_map"] = [[0], [0]]
    with pytest.raises(ValueError, match="each of experts 0..1 exactly once"):
        Layout.from_dict(tampered)
    tampered = json.loads(json.dumps(data))
    del tampered["groups"][1]["shard_group"]
    with pytest.raises(ValueError, match="malformed"):
        Layout.from_dict(tampered)
    tampered = json.loads(json.dumps(data))
    tampered["groups"][1]["expert_map"] = 7
    with pytest.raises(ValueError, match="expert map must be a list of lists"):
        Layout.from_dict(tampered)


def test_with_world_size_refuses_expert_groups():
    layout = build_layout([ExpertMesh(4, 2).expert_group([ParamSpec.of("e", (1, 5), "bf16")], 2)], 4)
    with pytest.raises(ValueError, match="rebuild it with build_layout"):
        layout.with_world_size(2)


def _expert(shape=(2, 4), **fields):
    return GroupSpec((ParamSpec.of("e", shape, "bf16"),), **fields)


@pytest.mark.parametrize(
    "groups, world, message",
    [
        ([_expert(shard_group="dp", world_size=2)], 4, "'dp' is all 4 ranks"),
        ([_expert(shard_group="", world_size=2)], 4, "non-empty string"),
        ([_expert(shard_group="x", world_size=3)], 4, "'x' of 3 ranks does not divide the world size 4"),
        ([_expert(shard_group="x", world_size=0)], 4, "'x' of 0 ranks"),
        ([_expert(shard_group="x", expert_map=((0, 1), (2,)))], 4, "same number"),
        ([_expert(shard_group="x", expert_map=((0, 1), (1, 2)))], 4, "each of experts 0..3 exactly once"),
        ([_expert(shard_group="x", expert_map=((0, True), (2, 3)))], 4, "exactly once"),
        ([_expert(shard_group="x", world_size=4, expert_map=((0, 1), (2, 3)))], 4, "2 expert-parallel ranks x 4"),
        ([_expert(shape=(3, 4), shard_group="x", expert_map=((0, 1), (2, 3)))], 4, "'e'.*stack 2 local experts.*\\[3, 4\\]"),
        ([_expert(shape=(), shard_group="x", expert_map=((0, 1), (2, 3)))], 4, "'e'.*stack 2 local experts"),
        (
            [_expert(shard_group="x", world_size=2), GroupSpec((ParamSpec.of("f", (3,), "bf16"),), "x", 1)],
            4,
            "group 1: shard group 'x' has 1 ranks here but 2",
        ),
    ],
)
def test_bad_shard_groups_name_the_problem(groups, world, message):
    with pytest.raises(ValueError, match=message):
        build_layout(groups, world)


# ---- ExpertMesh: the EP x DP rank arithmetic -------------------------------------------------


@pytest.mark.parametrize("world", list(range(1, 65)) + [96, 768, 1024])
def test_expert_mesh_groups_for_every_divisor(world):
    for ep in divisors(world):
        mesh = ExpertMesh(world, ep)
        ep_groups, dp_groups = mesh.ep_groups(), mesh.expert_dp_groups()
        assert len(ep_groups) == world // ep and all(len(g) == ep for g in ep_groups)
        assert len(dp_groups) == ep and all(len(g) == world // ep for g in dp_groups)
        # Each family partitions the ranks; an EP group and an expert-DP group meet in one rank.
        assert sorted(r for g in ep_groups for r in g) == list(range(world))
        assert sorted(r for g in dp_groups for r in g) == list(range(world))
        for rank in (range(world) if world <= 64 else {0, 1, ep - 1, world - 1}):
            ep_group, dp_group = mesh.ep_group(rank), mesh.expert_dp_group(rank)
            assert ep_group[mesh.ep_rank(rank)] == rank and dp_group[mesh.expert_dp_rank(rank)] == rank
            assert set(ep_group) & set(dp_group) == {rank}
            assert all(mesh.ep_rank(other) == mesh.ep_rank(rank) for other in dp_group)
        for local in (1, 3):
            expert_map = contiguous_expert_map(local * ep, ep)
            for group in ep_groups[:4]:
                # An EP group holds every expert once; an expert-DP group holds the same ones.
                held = sorted(e for rank in group for e in expert_map[mesh.ep_rank(rank)])
                assert held == list(range(local * ep))


def test_expert_mesh_worked_example():
    mesh = ExpertMesh(8, 2)
    assert mesh.ep_groups() == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert mesh.expert_dp_groups() == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert (mesh.ep_rank(5), mesh.expert_dp_rank(5), mesh.expert_dp_size) == (1, 2, 4)
    assert contiguous_expert_map(8, 2) == ((0, 1, 2, 3), (4, 5, 6, 7))


@pytest.mark.parametrize("world, ep", [(4, 3), (4, 0), (0, 1), (4, True), (4.0, 2)])
def test_expert_mesh_bad_sizes(world, ep):
    with pytest.raises(ValueError, match="does not divide"):
        ExpertMesh(world, ep)


def test_expert_mesh_bad_rank_and_expert_counts():
    with pytest.raises(ValueError, match="rank 4 is outside world size 4"):
        ExpertMesh(4, 2).ep_rank(4)
    with pytest.raises(ValueError, match="5 experts cannot be split evenly over 2"):
        contiguous_expert_map(5, 2)
