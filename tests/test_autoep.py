"""DeepSpeed AutoEP ZeRO-1/2 checkpoints (made in this session by DeepSpeed itself,
tests/autoep_fixtures.py) read in the transformers model's names and layout.

* the reader, in DeepSpeed's own names, gives every fp32 master and Adam state of every rank
  file what DeepSpeed's ds_to_universal gives, bit for bit, per global expert;
* loaded at (W, EP) = (2, 1), (4, 4), (1, 1) into the model's layout (``gate_up_proj =
  cat(w1, w3)``, ``down_proj = w2``, ``gate.weight`` the router), each rank's fp32 masters,
  exp_avg and exp_avg_sq, put together by global expert id, equal ds_to_universal's (every
  element written once); the weights are the module's bf16 tensors and, for the experts, their
  masters cast, which equal DeepSpeed's own per-expert files;
* to-fp32 loads into transformers' Qwen3MoeForCausalLM with from_pretrained (no missing or
  unexpected keys) and equals those masters; to-universal loads back to the same state;
* a running engine loads it online through load_checkpoint (a spawn of 2 ranks);
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
from zeroshard.importers import open_deepspeed
from zeroshard.importers.deepspeed import DeepSpeedSource
from zeroshard.layout import ExpertMesh, LayoutPolicy, ParamSpec, build_layout, global_shape, rank_runs

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


def model_layout(source, world_size: int, ep_size: int):
    """The layout a zeroshard run of the model has at (W, EP): the dense parameters over all
    ranks, the expert stacks ``[E / EP, ...]`` over the expert-data-parallel ranks."""
    dense, stacks = source.layout.groups
    mesh = ExpertMesh(world_size, ep_size)
    experts = [ParamSpec(s.name, (EXPERTS // ep_size, *s.spec.shape[1:]), s.spec.dtype) for s in stacks.params]
    return build_layout(
        [[s.spec for s in dense.params], mesh.expert_group(experts, EXPERTS)], world_size, LayoutPolicy.native()
    )


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


@pytest.mark.parametrize("name", ["w2_ep2_s2", "w4_ep2_s2_align"])
def test_to_fp32_loads_with_from_pretrained(autoep_runs, references, name, tmp_path):
    transformers = pytest.importorskip("transformers")
    from zeroshard.checkpoint.export.fp32 import to_fp32

    out = to_fp32(autoep_runs[name].save_dir, tmp_path / "fp32", progress=False)
    transformers.Qwen3MoeConfig(**MODEL_CONFIG).save_pretrained(out)
    model, loading = transformers.Qwen3MoeForCausalLM.from_pretrained(out, output_loading_info=True)
    assert loading["missing_keys"] == set() and loading["unexpected_keys"] == set(), loading
    assert loading["mismatched_keys"] == set() and not loading["error_msgs"], loading
    state = model.state_dict()
    assert set(state) == set(references[name]["fp32"])
    bad = {n: differing(t.numpy(), references[name]["fp32"][n]) for n, t in state.items()}
    assert sum(bad.values()) == 0, {k: v for k, v in bad.items() if v}


def test_to_universal_loads_back_to_the_same_state(autoep_runs, references, tmp_path):
    from zeroshard.checkpoint.universal import to_universal

    run = autoep_runs["w4_ep2_s2_align"]
    out = to_universal(run.save_dir, tmp_path / "universal", progress=False)
    with open_source(out) as universal, open_source(run.save_dir) as source:
        layout = model_layout(source, 4, 4)
        from_universal, counts, _ = gathered(universal, layout)
    bad = {
        (k, n): differing(from_universal[k][n], references[run.config.name][k][n])
        for k in STATES
        for n in from_universal[k]
    }
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


def test_an_engine_loads_it_online(autoep_runs, references):
    """Two spawned ranks, the transformers model at EP = 1 with its stacks as an expert group:
    load_checkpoint leaves every master and Adam state as DeepSpeed saved it, the weights the
    bf16 module's and the masters cast, and the lr DeepSpeed's."""
    pytest.importorskip("transformers")
    from autoep_workers import engine_load

    from zeroshard.launch import spawn

    name = "w2_ep2_s2"
    results = spawn(engine_load, 2, (str(autoep_runs[name].save_dir),), backend="gloo", timeout_s=300)
    reference = references[name]
    for rank, found in enumerate(results):
        bad = {(k, n): differing(found[f"{k}/{n}"].numpy(), reference[k][n]) for k in STATES for n in reference[k]}
        assert sum(bad.values()) == 0, (rank, {k: v for k, v in bad.items() if v})
        casts = {
            n: differing(found[f"weight/{n}"].numpy(), reference["fp32"][n].bfloat16().float())
            for n in reference["fp32"]
        }
        assert sum(casts.values()) == 0, (rank, {k: v for k, v in casts.items() if v})
        assert found["lr"].tolist() == [1e-3, 1e-3] and int(found["global_steps"]) == STEPS
