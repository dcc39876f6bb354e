"""Native checkpoints of expert layouts, saved by thread ranks from synthetic states and
loaded at other (W, EP): values bit for bit against the testing pattern, which names every
element by its global expert id. The engine tests (test_moe_checkpoint_engine.py) do the same
with trained MoEGPT runs on spawned ranks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors import safe_open
from universal_helpers import save_synthetic

from zeroshard.checkpoint import load_sharded, open_checkpoint
from zeroshard.checkpoint.testing import ADAM_STATES, expected_partition, local_pattern, pattern
from zeroshard.checkpoint.verify import verify_checkpoint
from zeroshard.layout import ExpertMesh, LayoutPolicy, ParamSpec, build_layout, global_shape, rank_runs

EXPERTS = 4
DENSE = [("wte", (13, 8)), ("ln.weight", (8,)), ("router", (8, EXPERTS))]
STACKED = [("moe.experts.w1", (8, 6)), ("moe.experts.w2", (6, 8)), ("moe.experts.w3", (8, 6))]


def moe_layout(world_size: int, ep_size: int, num_experts: int = EXPERTS, dtype: str = "bfloat16", policy=None):
    mesh = ExpertMesh(world_size, ep_size)
    local = num_experts // ep_size
    dense = [ParamSpec.of(name, shape, dtype) for name, shape in DENSE]
    experts = [ParamSpec.of(name, (local, *shape), dtype) for name, shape in STACKED]
    return build_layout([dense, mesh.expert_group(experts, num_experts)], world_size, policy or LayoutPolicy.native())


def dense_layout(world_size: int, dtype: str = "bfloat16"):
    """The same parameters with the experts replicated (EP = 1, no expert group)."""
    dense = [ParamSpec.of(name, shape, dtype) for name, shape in DENSE]
    experts = [ParamSpec.of(name, (EXPERTS, *shape), dtype) for name, shape in STACKED]
    return build_layout([dense, experts], world_size)


def assert_state_matches(state, layout, rank):
    for g in range(len(layout.groups)):
        assert torch.equal(state.fp32_partitions[g], expected_partition(layout, rank, g, "fp32")), (rank, g)
        for name in ADAM_STATES:
            assert torch.equal(state.optimizer_states[g][name], expected_partition(layout, rank, g, name)), (rank, g)
        assert state.optimizer_scalars[g]["step"].item() == 7.0
    for slot in layout.groups[1].params:  # the rank's own experts, cast from their masters
        expected = local_pattern(layout, rank, slot.name, "fp32").to(torch.bfloat16)
        assert torch.equal(state.model_state[slot.name], expected), (rank, slot.name)


@pytest.fixture(scope="module")
def saved_4_2(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe42")
    return save_synthetic(root, moe_layout(4, 2))


def test_each_rank_file_holds_its_experts_by_global_id_and_no_expert_twice(saved_4_2):
    """Union over the rank files of every expert element written: each exactly once, with the
    value the pattern gives its global expert id."""
    layout = open_checkpoint(saved_4_2).manifest.layout
    group = layout.groups[1]
    seen = {slot.name: np.zeros(math.prod(global_shape(group, slot)), dtype=np.int64) for slot in group.params}
    for rank in range(4):
        with safe_open(saved_4_2 / f"rank-{rank:05d}-of-00004.safetensors", framework="pt") as handle:
            written = handle.get_tensor("group1.fp32")
        for run in rank_runs(group, rank):
            values = written[run.partition_start : run.partition_start + run.length]
            expected = pattern(run.name, "fp32", len(seen[run.name]))[run.global_start : run.global_start + run.length]
            assert torch.equal(values, expected), (rank, run)
            seen[run.name][run.global_start : run.global_start + run.length] += 1
    assert all((counts == 1).all() for counts in seen.values())


def test_manifest_records_shard_groups_and_the_expert_map(saved_4_2):
    manifest = open_checkpoint(saved_4_2).manifest
    layout_json = manifest.to_dict()["layout"]
    assert layout_json["version"] == 2
    experts = layout_json["groups"][1]
    assert (experts["shard_group"], experts["world_size"], experts["expert_map"]) == ("expert_dp", 2, [[0, 1], [2, 3]])
    assert not {name for name, _ in STACKED} & set(manifest.model_tensors)  # rank 0 holds only its own experts
    assert verify_checkpoint(open_checkpoint(saved_4_2)) == []


@pytest.mark.parametrize("world_size, ep_size", [(2, 1), (4, 4), (1, 1), (4, 2), (8, 4), (6, 2)])
def test_load_reshards_across_ep_and_dp_bit_for_bit(saved_4_2, world_size, ep_size):
    new = moe_layout(world_size, ep_size)
    ckpt = open_checkpoint(saved_4_2)
    for rank in range(world_size):
        assert_state_matches(load_sharded(ckpt, new, rank), new, rank)


def test_padding_only_ranks_save_and_load(tmp_path):
    """1024-byte alignment: at (4, 2) the second rank of each expert-DP group owns padding only."""
    policy = LayoutPolicy.native(1024, bucket_numel=200)
    old = moe_layout(4, 2, dtype="float32", policy=policy)
    assert [bool(rank_runs(old.groups[1], rank)) for rank in range(4)] == [True, True, False, False]
    directory = save_synthetic(tmp_path, old)
    new = moe_layout(2, 2, dtype="float32")
    for rank in range(2):
        state = load_sharded(directory, new, rank)
        for g in range(2):
            assert torch.equal(state.fp32_partitions[g], expected_partition(new, rank, g, "fp32"))


def test_module_only_and_no_optimizer_loads_of_experts(saved_4_2):
    new = moe_layout(2, 1)
    for rank in range(2):
        module_only = load_sharded(saved_4_2, new, rank, load_module_only=True)
        assert module_only.param_groups == [] and module_only.extra == {}
        weights_only = load_sharded(saved_4_2, new, rank, load_optimizer_states=False)
        assert weights_only.optimizer_states == [{}, {}]
        for g, group in enumerate(new.groups):  # masters: the bf16 weights, back in fp32
            expected = expected_partition(new, rank, g, "fp32").to(torch.bfloat16).float()
            assert torch.equal(weights_only.fp32_partitions[g], expected)
        for name, _ in STACKED:
            expected = local_pattern(new, rank, name, "fp32").to(torch.bfloat16)
            assert torch.equal(module_only.model_state[name], expected)


@pytest.mark.parametrize(
    "layout, message",
    [
        (
            lambda: moe_layout(4, 2, num_experts=8),
            r"3 with another shape: moe\.experts\.w1 \(checkpoint \[4, 8, 6\], run \[8, 8, 6\]\)",
        ),
        (
            lambda: dense_layout(2),
            r"3 expert weights on one side, dense on the other: moe\.experts\.w1 \(checkpoint expert, run dense\)",
        ),
    ],
    ids=["expert-count", "dense-run"],
)
def test_a_run_with_other_experts_is_refused_naming_the_parameter(saved_4_2, layout, message):
    with pytest.raises(ValueError, match=message) as error:
        load_sharded(saved_4_2, layout(), 0)
    assert "\n" not in str(error.value)


def test_a_dense_checkpoint_into_an_expert_run_is_refused(tmp_path):
    directory = save_synthetic(tmp_path, dense_layout(2))
    with pytest.raises(ValueError, match=r"moe\.experts\.w2 \(checkpoint dense, run expert\)"):
        load_sharded(directory, moe_layout(2, 2), 1)


def test_non_strict_load_skips_regrouped_experts_keeping_the_base(saved_4_2):
    from zeroshard.checkpoint.testing import synthesize_state

    new = dense_layout(2)
    base = synthesize_state(new, 1)
    base.fp32_partitions[1].fill_(-1.0)
    with pytest.warns(UserWarning, match="expert weights on one side, dense on the other"):
        state = load_sharded(saved_4_2, new, 1, strict=False, base=base)
    assert torch.equal(state.fp32_partitions[0], expected_partition(new, 1, 0, "fp32"))
    assert torch.equal(state.fp32_partitions[1], torch.full_like(base.fp32_partitions[1], -1.0))


# ---- universal and fp32 exports ------------------------------------------------------------


def tensors_of(directory) -> dict[str, bytes]:
    """name -> (dtype, shape, bytes) of every tensor in every safetensors file of ``directory``."""
    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="numpy") as handle:
            for key in handle.keys():  # noqa: SIM118 - a safe_open handle has no __iter__
                array = handle.get_tensor(key)
                found[key] = (str(array.dtype), array.shape, array.tobytes())
    return found


@pytest.fixture(scope="module")
def exports(tmp_path_factory, saved_4_2):
    """The universal and fp32 exports of one synthetic state saved at (4, 2) and at (2, 1)."""
    from zeroshard.checkpoint.export.fp32 import to_fp32
    from zeroshard.checkpoint.universal import to_universal

    root = tmp_path_factory.mktemp("moe-exports")
    saved_2_1 = save_synthetic(root / "native21", moe_layout(2, 1))
    made = {}
    for label, native in (("4_2", saved_4_2), ("2_1", saved_2_1)):
        made[f"universal_{label}"] = to_universal(native, root / f"universal{label}", progress=False)
        made[f"fp32_{label}"] = to_fp32(native, root / f"fp32{label}", progress=False)
    made["fp32_of_universal"] = to_fp32(made["universal_4_2"], root / "fp32u", progress=False)
    return made


def test_exports_name_each_expert_by_global_id_in_linear_orientation(exports):
    fp32 = tensors_of(exports["fp32_4_2"])
    for name, (d_in, d_out) in STACKED:
        prefix, weight = name.rsplit(".", 1)
        full = pattern(name, "fp32", EXPERTS * d_in * d_out).reshape(EXPERTS, d_in, d_out)
        for g in range(EXPERTS):
            dtype, shape, data = fp32[f"{prefix}.{g}.{weight}.weight"]
            assert (dtype, shape) == ("float32", (d_out, d_in))
            assert data == full[g].t().contiguous().numpy().tobytes(), (name, g)
        assert name not in fp32
    universal = tensors_of(exports["universal_4_2"])
    assert {f"param/moe.experts.{g}.w2.weight/{key}" for g in range(4) for key in ("fp32", *ADAM_STATES)} <= set(
        universal
    )


@pytest.mark.parametrize("kind", ["universal", "fp32"])
def test_exports_at_different_ep_and_dp_are_byte_identical_per_name(exports, kind):
    assert tensors_of(exports[f"{kind}_4_2"]) == tensors_of(exports[f"{kind}_2_1"])


def test_fp32_export_of_the_universal_export_is_the_same(exports):
    assert tensors_of(exports["fp32_of_universal"]) == tensors_of(exports["fp32_4_2"])


def test_universal_manifest_lists_the_experts_of_each_stacked_weight(exports):
    import json

    manifest = json.loads((exports["universal_4_2"] / "universal.json").read_text())
    assert manifest["version"] == 4  # legacy experts (2), stored stacks (3), digests (4)
    assert manifest["experts"]["moe.experts.w3"] == [f"moe.experts.{g}.w3.weight" for g in range(EXPERTS)]
    assert manifest["params"]["moe.experts.1.w2.weight"]["shape"] == [8, 6]


@pytest.mark.parametrize("world_size, ep_size", [(4, 4), (2, 2), (1, 1), (3, 1)])
def test_universal_loads_back_at_another_ep_and_dp_bit_for_bit(exports, world_size, ep_size):
    from zeroshard.checkpoint.universal import load_universal

    new = moe_layout(world_size, ep_size)
    for rank in range(world_size):
        assert_state_matches(load_universal(exports["universal_4_2"], new, rank), new, rank)


def test_universal_manifest_with_a_bad_expert_list_is_refused(exports, tmp_path):
    import json
    import shutil

    from zeroshard.checkpoint.universal import open_universal

    copy = shutil.copytree(exports["universal_4_2"], tmp_path / "u")
    manifest = json.loads((copy / "universal.json").read_text())
    manifest["experts"]["moe.experts.w1"][1] = "moe.experts.0.w1.weight"
    (copy / "universal.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="expert weight 'moe.experts.w1' lists an expert tensor listed before"):
        open_universal(copy)


def test_export_refuses_expert_weights_that_are_not_stacked_matrices(tmp_path):
    from zeroshard.checkpoint.export.fp32 import to_fp32

    mesh = ExpertMesh(2, 2)
    dense = [ParamSpec.of("wte", (5, 4), "float32")]
    layout = build_layout([dense, mesh.expert_group([ParamSpec.of("moe.experts.bias", (1, 4), "float32")], 2)], 2)
    directory = save_synthetic(tmp_path / "ckpt", layout)
    with pytest.raises(ValueError, match=r"expert weight 'moe.experts.bias' has shape \[1, 4\]"):
        to_fp32(directory, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_conversions_of_an_expert_checkpoint_need_no_torch(saved_4_2, tmp_path):
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any import of torch fails
        from zeroshard.cli.main import main
        assert main(["to-universal", {str(saved_4_2)!r}, {str(tmp_path / "u")!r}]) == 0
        assert main(["to-fp32", {str(tmp_path / "u")!r}, {str(tmp_path / "f")!r}]) == 0
        assert main(["inspect", "--verify", {str(saved_4_2)!r}]) == 0
        assert main(["inspect", "--verify", {str(tmp_path / "u")!r}]) == 0
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False
    )
    assert done.returncode == 0, done.stderr
    assert "moe.experts.3.w1.weight" in tensors_of(tmp_path / "f")
