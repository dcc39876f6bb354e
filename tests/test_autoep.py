"""DeepSpeed AutoEP ZeRO-1/2 checkpoints (made in this session by DeepSpeed itself,
tests/autoep_fixtures.py) read in the transformers model's names and layout.

* the reader, in DeepSpeed's own names, gives every fp32 master and Adam state of every rank
  file what DeepSpeed's ds_to_universal gives, bit for bit, per global expert;
* the view describes its stacks as the transformers model's experts modules declare them
  (``ExpertStack("out_in", "stacked", parts)``, zeroshard.moe.contract);
* loaded at (W, EP) = (2, 1), (4, 4), (1, 1) into the model's layout (``gate_up_proj =
  cat(w1, w3)``, ``down_proj = w2``, ``gate.weight`` the router), each rank's fp32 masters,
  exp_avg and exp_avg_sq, put together by global expert id, equal ds_to_universal's (every
  element written once); the weights are the module's bf16 tensors and, for the experts, their
  masters cast, which equal DeepSpeed's own per-expert files;
* to-fp32 loads into transformers' Qwen3MoeForCausalLM with from_pretrained (no missing or
  unexpected keys) and equals those masters; to-universal stores the stacks whole (universal
  v3), loads back to the same state, and its to-fp32 loads with from_pretrained too;
* a running engine over the transformers model made expert-parallel by
  ``zeroshard.moe.expert_parallel`` loads it online through load_checkpoint at (W, EP) = (2, 1)
  and (2, 2) (one spawn of 2 ranks), every master and Adam state by global expert id;
* inspect describes it; zero_to_fp32, DeepSpeed's own, fails on it (why this reader exists).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from autoep_fixtures import CONFIGS, MODEL_CONFIG, STEPS
from autoep_workers import STATES, ds_reference

from zeroshard.checkpoint import load_state, open_source
from zeroshard.checkpoint.source import read_param
from zeroshard.deepspeed.checkpoint import open_deepspeed
from zeroshard.deepspeed.checkpoint.source import DeepSpeedSource
from zeroshard.layout import ExpertMesh, ExpertStack, LayoutPolicy, ParamSpec, build_layout, global_shape, rank_runs

LAYERS = MODEL_CONFIG["num_hidden_layers"]
EXPERTS = MODEL_CONFIG["num_experts"]
NAMES = [config.name for config in CONFIGS]
TARGETS = [(2, 1), (4, 4), (1, 1)]


@pytest.fixture(scope="module")
def references(autoep_runs):
    return {
        name: {key: ds_reference(run.universal, key, LAYERS) for key in STATES} for name, run in autoep_runs.items()
    }


def differing(found: np.ndarray, expected: torch.Tensor) -> int:
    """Elements whose bits differ (NaN equals NaN, -0.0 differs from 0.0)."""
    want = expected.detach().contiguous().float().numpy().reshape(-1)
    return int(
        (np.ascontiguousarray(found, dtype=np.float32).reshape(-1).view(np.uint32) != want.view(np.uint32)).sum()
    )


def _contract(name: str) -> ExpertStack:
    """What transformers' Qwen3MoeExperts declares for its stack ``name`` (zeroshard.moe.contract)."""
    parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ()
    return ExpertStack("out_in", "stacked", parts)


def model_layout(source, world_size: int, ep_size: int):
    """The layout a zeroshard run of the model has at (W, EP): the dense parameters over all
    ranks, the expert stacks ``[E / EP, ...]`` over the expert-data-parallel ranks, described as
    the model's experts module declares them (``out_in``, exported whole)."""
    dense, stacks = source.layout.groups
    mesh = ExpertMesh(world_size, ep_size)
    experts = [ParamSpec(s.name, (EXPERTS // ep_size, *s.spec.shape[1:]), s.spec.dtype) for s in stacks.params]
    group = mesh.expert_group(experts, EXPERTS, stacks=[_contract(s.name) for s in stacks.params])
    return build_layout([[s.spec for s in dense.params], group], world_size, LayoutPolicy.native())


def gathered(source, layout) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, np.ndarray], list]:
    """Every rank's load_state put together by global element: key -> name -> flat tensor,
    how many ranks wrote each element, and the states."""
    shapes = {slot.name: global_shape(group, slot) for group in layout.groups for slot in group.params}
    out = {
        key: {name: np.full(math.prod(shape), np.nan, np.float32) for name, shape in shapes.items()} for key in STATES
    }
    counts = {name: np.zeros(math.prod(shape), np.int64) for name, shape in shapes.items()}
    states = [load_state(source, layout, rank) for rank in range(layout.world_size)]
    for rank, state in enumerate(states):
        for group in layout.groups:
            partitions = {"fp32": state.fp32_partitions[group.index], **state.optimizer_states[group.index]}
            for run in rank_runs(group, rank):
                span = slice(run.global_start, run.global_start + run.length)
                for key in STATES:
                    out[key][run.name][span] = partitions[key][
                        run.partition_start : run.partition_start + run.length
                    ].numpy()
                counts[run.name][span] += 1
    return out, counts, states


def test_zero_to_fp32_fails_on_autoep_checkpoints(autoep_runs):
    for run in autoep_runs.values():
        error = run.recorded()["zero_to_fp32_error"]
        assert (
            error is not None and "layer_0_expert_0_mp_rank_00_model_states.pt is not a model state checkpoint" in error
        )
        assert run.recorded()["transformers"] == "5.9.0"


@pytest.mark.parametrize("name", NAMES)
def test_deepspeed_names_read_as_ds_to_universal(autoep_runs, name):
    """The reader in DeepSpeed's own layout: w1/w2/w3 [E, ...] by global expert id."""
    run = autoep_runs[name]
    with DeepSpeedSource(run.tag_dir) as raw:
        assert raw.layout.world_size == run.config.world_size
        group = next(g for g in raw.layout.groups if g.is_expert_group)
        assert (
            group.world_size == run.config.world_size // run.config.ep_size
            and len(group.expert_map) == run.config.ep_size
        )
        bad = {}
        for key in STATES:
            for slot_group in raw.layout.groups:
                for slot in slot_group.params:
                    expected = torch.load(run.universal / "zero" / slot.name / f"{key}.pt", weights_only=True)["param"]
                    bad[(key, slot.name)] = differing(read_param(raw, slot.name, key), expected)
    assert sum(bad.values()) == 0, {k: v for k, v in bad.items() if v}


@pytest.mark.parametrize("world_size, ep_size", TARGETS, ids=[f"W{w}_EP{e}" for w, e in TARGETS])
@pytest.mark.parametrize("name", NAMES)
def test_load_at_any_world_and_ep_equals_ds_to_universal(autoep_runs, references, name, world_size, ep_size):
    run = autoep_runs[name]
    with open_source(run.save_dir) as source:
        layout = model_layout(source, world_size, ep_size)
        found, counts, states = gathered(source, layout)
        expert_bf16 = {stack: source.model_tensor(stack) for stack in (s.name for s in source.layout.groups[1].params)}
    reference = references[name]
    assert set(found["fp32"]) == set(reference["fp32"])
    bad = {(key, n): differing(found[key][n], reference[key][n]) for key in STATES for n in found[key]}
    assert sum(bad.values()) == 0, {k: v for k, v in bad.items() if v}
    assert all(bool((c == 1).all()) for c in counts.values())
    for rank, state in enumerate(states):
        assert [float(s["step"]) for s in state.optimizer_scalars] == [STEPS, STEPS]
        assert [g.hyperparameters["weight_decay"] for g in state.param_groups] == [0.1, 0.1]
        assert state.extra["autoep"]["autoep_size"] == run.config.ep_size
        # The weights: experts cast from their masters, which is what DeepSpeed's per-expert files hold.
        experts = layout.groups[1]
        ids = experts.expert_map[rank % ep_size]
        for slot in experts.params:
            files = torch.from_numpy(np.ascontiguousarray(expert_bf16[slot.name][list(ids)]).view(np.int16))
            assert torch.equal(state.model_state[slot.name].view(torch.int16), files), (rank, slot.name)


EXPORTS = [("w2_ep2_s2", None), ("w4_ep2_s2_align", None), ("w4_ep2_s2_align", "per_expert")]


@pytest.mark.parametrize("name, experts", EXPORTS, ids=[f"{n}-{e or 'default'}" for n, e in EXPORTS])
def test_to_fp32_loads_with_from_pretrained(autoep_runs, references, name, experts, tmp_path):
    """By default each stack whole ([E, out, in] under its own name); per expert, transformers'
    own names (mlp.experts.{g}.gate_proj.weight, ...), which from_pretrained stacks back."""
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    from zeroshard.checkpoint.export.fp32 import to_fp32

    out = to_fp32(autoep_runs[name].save_dir, tmp_path / "fp32", progress=False, experts=experts)
    with safe_open(str(out / "model.safetensors"), "pt") as written:
        keys = set(written.keys())
    per_expert = {f"model.layers.0.mlp.experts.3.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")}
    assert ("model.layers.0.mlp.experts.gate_up_proj" in keys) == (experts is None)
    assert per_expert <= keys if experts else not per_expert & keys
    transformers.Qwen3MoeConfig(**MODEL_CONFIG).save_pretrained(out)
    model, loading = transformers.Qwen3MoeForCausalLM.from_pretrained(out, output_loading_info=True)
    assert loading["missing_keys"] == set() and loading["unexpected_keys"] == set(), loading
    assert loading["mismatched_keys"] == set() and not loading["error_msgs"], loading
    state = model.state_dict()
    assert set(state) == set(references[name]["fp32"])
    bad = {n: differing(t.numpy(), references[name]["fp32"][n]) for n, t in state.items()}
    assert sum(bad.values()) == 0, {k: v for k, v in bad.items() if v}


def test_to_universal_stores_the_model_stacks_and_loads_back_to_the_same_state(autoep_runs, references, tmp_path):
    """Universal v3: each stack whole under the model's name, ``[E, out, in]``, with its
    description; it loads back to ds_to_universal's state, and its to-fp32 is the model's."""
    transformers = pytest.importorskip("transformers")
    from zeroshard.checkpoint.export.fp32 import to_fp32
    from zeroshard.checkpoint.universal import to_universal
    from zeroshard.checkpoint.universal.format import read_universal_manifest

    run = autoep_runs["w4_ep2_s2_align"]
    out = to_universal(run.save_dir, tmp_path / "universal", progress=False)
    manifest = read_universal_manifest(out)
    stacks = {n for n in references[run.config.name]["fp32"] if n.endswith(("gate_up_proj", "down_proj"))}
    assert manifest.format_version == 4 and manifest.expert_stacks and not manifest.experts
    assert manifest.expert_stacks == {n: _contract(n) for n in stacks}
    assert {n: manifest.params[n].shape for n in stacks} == {
        n: tuple(references[run.config.name]["fp32"][n].shape) for n in stacks
    }
    with open_source(out) as universal, open_source(run.save_dir) as source:
        layout = model_layout(source, 4, 4)
        from_universal, counts, _ = gathered(universal, layout)
    bad = {
        (k, n): differing(from_universal[k][n], references[run.config.name][k][n])
        for k in STATES
        for n in from_universal[k]
    }
    assert sum(bad.values()) == 0, {k: v for k, v in bad.items() if v}
    exported = to_fp32(out, tmp_path / "fp32", progress=False)
    transformers.Qwen3MoeConfig(**MODEL_CONFIG).save_pretrained(exported)
    model, loading = transformers.Qwen3MoeForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert all(not loading[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading
    state = model.state_dict()
    bad = {n: differing(t.numpy(), references[run.config.name]["fp32"][n]) for n, t in state.items()}
    assert sum(bad.values()) == 0, {k: v for k, v in bad.items() if v}


def test_open_source_names_the_model_and_keeps_deepspeed_layout_as_raw(autoep_runs):
    run = autoep_runs["w4_ep2_s2_align"]
    with open_deepspeed(run.tag_dir) as source:
        dense, experts = source.layout.groups
        assert source.layout.world_size == 1 and experts.expert_map == (tuple(range(EXPERTS)),)
        names = [slot.name for slot in experts.params]
        assert names == [
            f"model.layers.{i}.mlp.experts.{w}" for i in range(LAYERS) for w in ("gate_up_proj", "down_proj")
        ]
        i, h = MODEL_CONFIG["moe_intermediate_size"], MODEL_CONFIG["hidden_size"]
        assert [slot.spec.shape for slot in experts.params[:2]] == [(EXPERTS, 2 * i, h), (EXPERTS, h, i)]
        assert "model.layers.0.mlp.gate.weight" in {slot.name for slot in dense.params}
        assert not [
            entry for entry in source.info.model_entries if ".mlp." in entry.name
        ]  # AutoEP's router alias is gone
        assert source.raw.layout.world_size == 4 and source.raw.layout.shard_groups == {"dp": 4, "expert_dp": 2}


def test_the_stacks_are_described_as_the_model_declares_them(autoep_runs):
    """The view's stack descriptions are those zeroshard.moe's contract gives the transformers
    model's own experts modules (the run a load goes into)."""
    transformers = pytest.importorskip("transformers")
    from zeroshard.moe import expert_modules

    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**MODEL_CONFIG))
    declared = {f"{p}.{leaf}": stack for p, c in expert_modules(model).items() for leaf, stack in c.stacks.items()}
    with open_deepspeed(autoep_runs["w2_ep2_s2"].tag_dir) as source:
        experts = source.layout.groups[1]
        assert {slot.name: experts.stacks[slot.index] for slot in experts.params} == declared


def test_inspect_describes_the_autoep_run(autoep_runs, capsys):
    from zeroshard.cli import main

    run = autoep_runs["w4_ep2_s2_align"]
    assert main(["inspect", str(run.save_dir)]) == 0
    printed = capsys.readouterr().out
    assert "DeepSpeed ZeRO stage 2 checkpoint (DeepSpeed 0.19.8) with AutoEP (preset qwen3_moe, EP=2)" in printed
    assert (
        "world size: 4" in printed
        and "shard groups: dp (4 ranks), expert_dp (2 ranks); expert parallelism EP=2" in printed
    )
    assert "EP rank 1: experts 2, 3 on ranks 1, 3" in printed
    assert "model.layers.0.mlp.experts.gate_up_proj [4, 32, 24] = cat(w1, w3)" in printed
    assert "8 expert files layer_L_expert_E_mp_rank_00_model_states.pt: 38,992 bytes" in printed
    assert "model state: 0 buffers or frozen tensors, 0 tied alias(es)" in printed
    assert main(["inspect", "--verify", str(run.save_dir)]) == 0
    assert "every tensor reads" in capsys.readouterr().out


ONLINE_EP = [1, 2]  # at W = 2, in one spawn


def test_an_engine_loads_it_online_into_the_model_made_expert_parallel(autoep_runs, references):
    """Two spawned ranks, the transformers model made expert-parallel at EP = 1 and 2:
    load_checkpoint leaves every master and Adam state as DeepSpeed saved it (each global expert
    on the ranks that hold it), the weights the masters cast, and the lr DeepSpeed's."""
    pytest.importorskip("transformers")
    from autoep_workers import engine_load

    from zeroshard.launch import spawn

    name = "w2_ep2_s2"
    results = spawn(engine_load, 2, (str(autoep_runs[name].save_dir), ONLINE_EP), backend="gloo", timeout_s=300)
    reference = references[name]
    stacks = {n for n in reference["fp32"] if n.endswith(("gate_up_proj", "down_proj"))}
    for ep_size in ONLINE_EP:
        local = EXPERTS // ep_size
        for rank, found in enumerate(per_rank[ep_size] for per_rank in results):
            where = (ep_size, rank)
            first = (rank % ep_size) * local  # the contiguous placement: EP rank rank % EP
            expected: dict[str, torch.Tensor] = {}
            for key in (*STATES, "weight"):
                ref = reference["fp32" if key == "weight" else key]
                for n, tensor in ref.items():
                    tensor = tensor.bfloat16().float() if key == "weight" else tensor
                    if n in stacks:
                        expected.update((f"{key}/{n}/{g}", tensor[g]) for g in range(first, first + local))
                    else:
                        expected[f"{key}/{n}"] = tensor
            assert set(expected) == set(found) - {"lr", "global_steps"}, where
            bad = {k: differing(found[k].numpy(), v) for k, v in expected.items()}
            assert sum(bad.values()) == 0, (where, {k: v for k, v in bad.items() if v})
            assert found["lr"].tolist() == [1e-3, 1e-3] and int(found["global_steps"]) == STEPS, where
