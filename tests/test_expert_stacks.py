"""The expert contract (issue 20): stack descriptions and placements in the layout, and a user's
own stacks trained by a single-process engine and exported in their own names, orientation and
values (the silent transpose and the doubled ``.weight`` of earlier exports are the regressions)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from zeroshard.checkpoint.compat import compare_params
from zeroshard.checkpoint.engine_io import load_checkpoint, save_checkpoint
from zeroshard.checkpoint.export.fp32 import load_fp32_state_dict, to_fp32
from zeroshard.checkpoint.universal import load_universal, to_universal
from zeroshard.engine import ZeroOptimizer
from zeroshard.layout import (
    LEGACY_STACK,
    ExpertMesh,
    ExpertStack,
    Layout,
    ParamSpec,
    build_layout,
    check_expert_map,
    expert_slots,
)
from zeroshard.layout.stacks import per_expert_tensors
from zeroshard.moe import declare_experts, expert_modules, moe_param_groups

EXPERTS, D_IN, D_OUT = 4, 8, 6


# ---- the pure half --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"orientation": "rows"}, "orientation must be one of out_in, in_out, none"),
        ({"export": "split"}, "export must be one of stacked, per_expert"),
        ({"orientation": "out_in", "parts": ["a"]}, "parts must be a tuple"),
        ({"orientation": "out_in", "parts": ("a.b",)}, "plain names"),
        ({"orientation": "out_in", "parts": ("a", "a")}, "name a part twice"),
        ({"parts": ("a",)}, "must say its orientation"),
    ],
)
def test_expert_stack_refuses_what_it_cannot_mean(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExpertStack(**kwargs)


def test_expert_map_checks_and_slots():
    assert check_expert_map([[3, 0], [1, 2]]) == ((3, 0), (1, 2))
    assert expert_slots([[3, 0], [1, 2]]) == (1, 2, 3, 0)  # expert 3 is EP rank 0's first
    for bad, message in [
        ([[0, 1], [2]], "same number"),
        ([[0, 1], [1, 2]], "each of experts 0..3 exactly once"),
        ([[0, 5]], "exactly once"),
        ([], "at least one"),
        ([[True, 0]], "exactly once"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_expert_map(bad)


def test_per_expert_names_follow_the_stack():
    out_in = ExpertStack("out_in")
    assert [t.name for t in per_expert_tensors("moe.weight", out_in, 3, (6, 8))] == ["moe.3.weight"]
    assert [t.name for t in per_expert_tensors("blocks.0.moe.experts.w1", LEGACY_STACK, 3, (8, 6))] == [
        "blocks.0.moe.experts.3.w1.weight"
    ]
    gate_up = per_expert_tensors("m.experts.gate_up_proj", ExpertStack("out_in", parts=("gate_proj", "up_proj")), 2, (8, 5))
    assert [(t.name, t.row_start, t.row_end) for t in gate_up] == [
        ("m.experts.2.gate_proj.weight", 0, 4),
        ("m.experts.2.up_proj.weight", 4, 8),
    ]
    assert [t.name for t in per_expert_tensors("m.experts.gate_up_proj_bias", ExpertStack("none"), 1, (8,))] == [
        "m.experts.1.gate_up_proj_bias"
    ]
    with pytest.raises(ValueError, match="do not split evenly"):
        per_expert_tensors("m.x", ExpertStack("out_in", parts=("a", "b")), 0, (5, 3))


def test_layouts_with_described_stacks_are_version_3_and_round_trip():
    mesh = ExpertMesh(4, 2)
    specs = [ParamSpec.of("moe.gate_up", (2, 12, 8), "bf16"), ParamSpec.of("moe.bias", (2, 12), "bf16")]
    stacks = (ExpertStack("out_in", parts=("gate", "up")), ExpertStack("none"))
    layout = build_layout([[("embed", (10, 8), "bf16")], mesh.expert_group(specs, 4, expert_map=[[3, 0], [1, 2]], stacks=stacks)], 4)
    data = json.loads(layout.to_json())
    assert data["version"] == 3
    assert data["groups"][1]["expert_map"] == [[3, 0], [1, 2]]
    assert [p["stack"] for p in data["groups"][1]["params"]] == [s.to_dict() for s in stacks]
    again = Layout.from_json(layout.to_json())
    assert again == layout and again.groups[1].stacks == stacks
    # Legacy stacks keep version 2, byte for byte as before stacks were described.
    legacy = build_layout([mesh.expert_group([ParamSpec.of("w1", (2, 8, 6), "bf16")], 4)], 4)
    assert json.loads(legacy.to_json())["version"] == 2 and "stack" not in legacy.to_json()
    data["groups"][1]["params"][0]["stack"]["orientation"] = "sideways"
    with pytest.raises(ValueError, match="orientation must be one of"):
        Layout.from_dict(data)


def test_the_layout_refuses_stacks_that_do_not_fit():
    mesh = ExpertMesh(2, 2)
    with pytest.raises(ValueError, match=r"expert stack 'b' has shape \[1, 4\]: orientation 'out_in' needs a stack of matrices"):
        build_layout([mesh.expert_group([ParamSpec.of("b", (1, 4), "fp32")], 2, stacks=[ExpertStack("out_in")])], 2)
    with pytest.raises(ValueError, match="one ExpertStack per parameter"):
        build_layout([mesh.expert_group([ParamSpec.of("b", (1, 4), "fp32")], 2, stacks=[LEGACY_STACK] * 2)], 2)
    with pytest.raises(ValueError, match="places 4 experts on 2 expert-parallel ranks; this mesh has 2 experts on 2"):
        mesh.expert_group([ParamSpec.of("b", (1, 4), "fp32")], 2, expert_map=[[0, 1], [2, 3]])


def test_a_load_names_a_stack_whose_orientation_changed():
    mesh = ExpertMesh(1, 1)
    spec = [ParamSpec.of("moe.w", (2, 4, 4), "fp32")]
    old = build_layout([mesh.expert_group(spec, 2, stacks=[ExpertStack("in_out")])], 1)
    new = build_layout([mesh.expert_group(spec, 2, stacks=[ExpertStack("out_in")])], 1)
    undeclared = build_layout([mesh.expert_group(spec, 2, stacks=[ExpertStack("none")])], 1)
    assert compare_params(old, new).reoriented == ("moe.w (checkpoint in_out, run out_in)",)
    assert not compare_params(undeclared, new) and not compare_params(old, old)


# ---- a user's own stacks through a single-process engine -------------------------------------------


class StackedLinear(nn.Module):
    """A user's experts, ``[E, out, in]`` like nn.Linear weights (transformers' orientation),
    run expert by expert on the rows routed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, D_OUT, D_IN) * 0.1)

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ti,toi->to", x, self.weight[expert])


class UserModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D_IN, D_IN)
        self.moe = StackedLinear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(self.proj(x), torch.arange(x.shape[0]) % EXPERTS).square().mean()


def _train(model: nn.Module, groups) -> ZeroOptimizer:
    engine = ZeroOptimizer(model, torch.optim.AdamW, groups, stage=2, lr=1e-2)  # W = 1: no process group needed
    x = torch.randn(8, D_IN, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        engine.backward(model(x))
        engine.step()
        engine.zero_grad()
    return engine


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    """The user's model with its stack declared in one call, trained and saved."""
    root = tmp_path_factory.mktemp("user")
    torch.manual_seed(0)
    model = UserModel()
    declare_experts(model.moe, {"weight": "out_in"})
    engine = _train(model, moe_param_groups(model))
    return model, engine, save_checkpoint(engine, root / "ckpt")


def test_a_declared_stack_is_an_expert_group_with_its_description(user_run):
    model, engine, _ = user_run
    assert list(expert_modules(model)) == ["moe"]
    group = engine.layout.param("moe.weight")[0]
    assert group.is_expert_group and group.expert_map == ((0, 1, 2, 3),)
    assert group.stacks == (ExpertStack("out_in"),)


def test_the_fp32_export_of_a_users_stack_loads_strictly_into_its_model(user_run, tmp_path):
    model, engine, checkpoint = user_run
    out = to_fp32(checkpoint, tmp_path / "fp32", progress=False)
    exported = load_file(out / "model.safetensors")
    assert tuple(exported["moe.weight"].shape) == (EXPERTS, D_OUT, D_IN)  # its own name and orientation
    fresh = UserModel()
    fresh.load_state_dict(exported, strict=True)
    assert torch.equal(fresh.moe.weight, engine.get_full_fp32_param("moe.weight"))
    assert torch.equal(fresh.proj.weight, engine.get_full_fp32_param("proj.weight"))


def test_the_per_expert_option_names_each_expert_once(user_run, tmp_path):
    _, engine, checkpoint = user_run
    out = to_fp32(checkpoint, tmp_path / "fp32", progress=False, experts="per_expert")
    with safe_open(out / "model.safetensors", "pt") as handle:
        names = sorted(handle.keys())
        assert names == sorted(["proj.weight", "proj.bias", *[f"moe.{g}.weight" for g in range(EXPERTS)]])
        master = engine.get_full_fp32_param("moe.weight")
        for g in range(EXPERTS):  # [out, in] as stored: no transpose of an out_in stack
            assert torch.equal(handle.get_tensor(f"moe.{g}.weight"), master[g])


def test_an_undeclared_stack_exports_untransposed_under_its_name(tmp_path):
    torch.manual_seed(0)
    model = UserModel()
    params = dict(model.named_parameters())
    groups = [{"params": [params["proj.weight"], params["proj.bias"]]}, {"params": [params["moe.weight"]], "expert": True}]
    engine = _train(model, groups)
    assert engine.layout.param("moe.weight")[0].stacks == (ExpertStack("none", "stacked"),)
    state = load_fp32_state_dict(save_checkpoint(engine, tmp_path / "ckpt"))
    assert torch.equal(state["moe.weight"], engine.get_full_fp32_param("moe.weight"))
    UserModel().load_state_dict(state, strict=True)


def test_a_given_placement_is_recorded_and_validated(tmp_path):
    torch.manual_seed(0)
    model = UserModel()
    params = dict(model.named_parameters())
    expert = {"params": [params["moe.weight"]], "expert": True, "expert_stacks": {"moe.weight": ExpertStack("out_in")}}
    dense = {"params": [params["proj.weight"], params["proj.bias"]]}
    engine = _train(model, [dense, {**expert, "expert_map": [[2, 0, 3, 1]]}])
    assert engine.layout.param("moe.weight")[0].expert_map == ((2, 0, 3, 1),)
    # Local expert 0 is global expert 2: the export stacks by global id.
    state = load_fp32_state_dict(save_checkpoint(engine, tmp_path / "ckpt"))
    local = engine.get_full_fp32_param("moe.weight")
    assert torch.equal(state["moe.weight"], local[torch.tensor([1, 3, 0, 2])])
    for bad, message in [
        ({**expert, "expert_map": [[0, 1, 1, 2]]}, "param group 1: the expert map must hold each of experts 0..3"),
        ({**expert, "expert_map": [[0, 1], [2, 3]]}, "places 4 experts on 2 expert-parallel ranks; this mesh has 4 experts on 1"),
        ({**expert, "expert_stacks": {"proj.weight": ExpertStack()}}, "names parameters not in the group"),
        ({"params": [params["moe.weight"]], "expert_map": [[0, 1, 2, 3]]}, "describe expert groups only"),
    ]:
        with pytest.raises(ValueError, match=message):
            ZeroOptimizer(model, torch.optim.AdamW, [dense, bad])


def test_universal_checkpoints_keep_stacks_whole_and_load_back(user_run, tmp_path):
    model, engine, checkpoint = user_run
    universal = to_universal(checkpoint, tmp_path / "u", progress=False)
    manifest = json.loads((universal / "universal.json").read_text())
    assert manifest["version"] == 4 and "experts" not in manifest and "digests" in manifest
    assert manifest["expert_stacks"] == {"moe.weight": ExpertStack("out_in").to_dict()}
    assert manifest["params"]["moe.weight"]["shape"] == [EXPERTS, D_OUT, D_IN]
    state = load_universal(universal, engine.layout, 0)
    saved = engine.export_state()
    for group, (loaded, own) in enumerate(zip(state.fp32_partitions, saved.fp32_partitions)):
        assert torch.equal(loaded, own), group
        for key in saved.optimizer_states[group]:
            assert torch.equal(state.optimizer_states[group][key], saved.optimizer_states[group][key])
    assert np.array_equal(
        load_fp32_state_dict(universal)["moe.weight"].numpy(), load_fp32_state_dict(checkpoint)["moe.weight"].numpy()
    )
    # And the engine takes it back, same layout: equal masters.
    fresh = UserModel()
    declare_experts(fresh.moe, {"weight": "out_in"})
    other = ZeroOptimizer(fresh, torch.optim.AdamW, moe_param_groups(fresh), stage=2, lr=1e-2)
    load_checkpoint(other, universal)
    assert torch.equal(other.get_full_fp32_param("moe.weight"), engine.get_full_fp32_param("moe.weight"))


def test_reports_name_described_stacks_and_leave_legacy_ones_alone():
    from zeroshard.cli.expert_report import shard_group_lines

    mesh = ExpertMesh(2, 2)
    gate_up = ExpertStack("out_in", parts=("gate_proj", "up_proj"))
    specs = [ParamSpec.of(f"l{i}.gate_up_proj", (1, 8, 4), "fp32") for i in range(2)] + [ParamSpec.of("l0.bias", (1, 8), "fp32")]
    layout = build_layout([mesh.expert_group(specs, 2, stacks=[gate_up, gate_up, ExpertStack()])], 2)
    lines = shard_group_lines(layout)
    assert "  stacks out_in, exported stacked (per expert: gate_proj, up_proj): l0.gate_up_proj, ... (2 in all)" in lines
    assert "  stacks none, exported stacked: l0.bias" in lines
    legacy = build_layout([mesh.expert_group([ParamSpec.of("w1", (1, 8, 4), "fp32")], 2)], 2)
    assert not [line for line in shard_group_lines(legacy) if "stacks" in line]


@pytest.mark.parametrize("convert", ["to-fp32 stacked", "to-fp32 per-expert", "to-universal"])
def test_converters_check_each_expert_of_a_stack_read_whole_against_its_digest(user_run, tmp_path, convert):
    """A stack read whole (stacked exports, universal checkpoints) is checked expert by
    expert; an edited digest of one expert is refused naming it, and nothing is written."""
    import shutil

    from zeroshard.io.damage import CheckpointDamagedError

    _, _, checkpoint = user_run
    edited = Path(shutil.copytree(checkpoint, tmp_path / "edited"))
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["digests"]["params"]["moe.weight"]["fp32"][2] ^= 1
    (edited / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "out"
    with pytest.raises(CheckpointDamagedError, match=r"'moe\.weight' expert 2 fp32 reads as digest"):
        if convert == "to-universal":
            to_universal(edited, out, progress=False)
        else:
            to_fp32(edited, out, experts=convert.split()[1].replace("-", "_"), progress=False)
    assert not out.exists()
