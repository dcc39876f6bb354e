"""transformers v5 MoE models with expert parallelism (issue 20): an unmodified Qwen3-MoE made
expert-parallel in one call, trained at (W, EP) on spawned gloo ranks, equals the same model in
one process on the union of the ranks' batches; its checkpoints reshard across (W, EP) by global
expert id and export in the model's own names and layout, which ``from_pretrained`` loads.

Tolerances (max abs difference over 3 AdamW steps at lr 1e-2, fp32), as tests/test_moe_engine.py
derives them: losses 1e-5 (float32 sums of a few thousand terms reduced in another order; seen
~5e-7), masters 1e-4 (the same, amplified by Adam's division for elements with tiny gradients;
seen ~5e-6). Checkpoint state is compared bit for bit. Two spawns (W = 4, then W = 2).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

import torch  # noqa: E402
from hf_moe_workers import (  # noqa: E402
    ADAM_STATES,
    CONFIG,
    MORE_STEPS,
    STEPS,
    HFCase,
    qwen3_moe,
    reference_run,
    resume,
    run_world,
)

from zeroshard.launch import spawn  # noqa: E402

LOSS, MASTERS = 1e-5, 1e-4
CASES_4 = [HFCase(2, 1), HFCase(2, 2, save=True), HFCase(4, 1), HFCase(4, 2), HFCase(2, 2, "bfloat16")]
CASES_2 = [HFCase(2, 1), HFCase(2, 2)]
SAVED = 1  # CASES_4[1] saves at (4, 2)
CALLS_PER_STEP = CONFIG["num_hidden_layers"] * 2  # gate_up_proj and down_proj of every layer


@pytest.fixture(scope="module")
def reference():
    return reference_run(STEPS)


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_moe")


@pytest.fixture(scope="module")
def pretrained_sources(checkpoint_root):
    """The full model (seed 0) as transformers writes it (per expert) and as one stacked file."""
    from safetensors.torch import save_file

    model = qwen3_moe()
    model.save_pretrained(checkpoint_root / "per_expert")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(checkpoint_root / "stacked.safetensors"))
    return {"per_expert": str(checkpoint_root / "per_expert"), "stacked": str(checkpoint_root / "stacked.safetensors")}


@pytest.fixture(scope="module")
def world4(checkpoint_root):
    return spawn(run_world, 4, (CASES_4, str(checkpoint_root), [HFCase(4, 2)], None), backend="gloo", timeout_s=500)


@pytest.fixture(scope="module")
def world2(world4, checkpoint_root, pretrained_sources):
    args = (CASES_2, str(checkpoint_root), [HFCase(1, 2)], pretrained_sources)
    return spawn(run_world, 2, args, backend="gloo", timeout_s=500)


def _check_against_reference(results, cases, world_size, reference):
    ref_losses, ref_params = reference
    for index, case in enumerate(cases):
        where = f"W={world_size} {case.label}"
        outcomes = [per_rank["cases"][index] for per_rank in results]
        low = case.dtype == "bfloat16"
        for rank, outcome in enumerate(outcomes):
            assert len(outcome.losses) == STEPS
            if low:  # bf16: every grouped_mm call and its gradient meet CUDA's rules
                assert outcome.calls == STEPS * CALLS_PER_STEP, (where, rank)
                assert outcome.calls_on_flat_views == outcome.calls and outcome.gradients_checked == outcome.calls
                assert outcome.problems == [], (where, rank, outcome.problems[:3])
                continue
            loss_diff = max(abs(a - b) for a, b in zip(outcome.losses, ref_losses))
            dense_diff = max((outcome.params[n] - ref_params[n]).abs().max().item() for n in outcome.params)
            assert loss_diff <= LOSS and dense_diff <= MASTERS, (where, rank, loss_diff, dense_diff)
        if low:
            continue
        experts = {}  # every global expert once, from the ranks holding it (equal on each)
        for outcome in outcomes:
            for name, by_id in outcome.experts.items():
                for g, master in by_id.items():
                    experts.setdefault(name, {}).setdefault(g, master)
                    assert torch.equal(experts[name][g], master), (where, name, g)
        assert set(experts) == {n for n in ref_params if n.endswith(("gate_up_proj", "down_proj"))}
        for name, by_id in experts.items():
            assert sorted(by_id) == list(range(CONFIG["num_experts"])), (where, name)
            worst = max((master - ref_params[name][g]).abs().max().item() for g, master in by_id.items())
            assert worst <= MASTERS, (where, name, worst)


def test_expert_parallel_qwen3_moe_at_w4_equals_one_process(world4, reference):
    _check_against_reference(world4, CASES_4, 4, reference)
    assert {r["refusal"] for r in world4} == {"a param group is flagged 'expert' but no expert_process_group was given"}


def test_expert_parallel_qwen3_moe_at_w2_equals_one_process(world2, reference):
    _check_against_reference(world2, CASES_2, 2, reference)


def test_pretrained_weights_load_into_each_rank_its_own_experts(world2):
    for per_rank in world2:
        assert per_rank["pretrained"] == {"per_expert": 0.0, "stacked": 0.0}


def _saved(world4):
    """The (4, 2) run's state at the save, by global expert id, and its losses after."""
    masters, states = {}, {}
    for per_rank in world4:
        saved = per_rank["cases"][SAVED]
        for name, by_id in saved.experts.items():
            masters.setdefault(name, {}).update(by_id)
        for key, by_id in saved.states.items():
            states.setdefault(key, {}).update(by_id)
    first = world4[0]["cases"][SAVED]
    return first.params, masters, states, first.continued


def _check_resumed(outcome, world4, where):
    dense, masters, states, continued = _saved(world4)
    for name, master in outcome.params.items():
        assert torch.equal(master, dense[name]), (where, name)
    for name, by_id in outcome.experts.items():
        for g, master in by_id.items():
            assert torch.equal(master, masters[name][g]), (where, name, g)
    for key, by_id in outcome.states.items():
        for g, value in by_id.items():
            assert torch.equal(value, states[key][g]), (where, key, g)
    assert {key.rsplit("/", 1)[1] for key in outcome.states} == set(ADAM_STATES)
    assert len(outcome.losses) == MORE_STEPS
    assert max(abs(a - b) for a, b in zip(outcome.losses, continued)) <= LOSS, (where, outcome.losses, continued)


def test_a_checkpoint_saved_at_4_2_resumes_at_4_4_and_2_1(world4, world2):
    for rank, per_rank in enumerate(world4):
        _check_resumed(per_rank["resumed"][0], world4, f"(4, 4) rank {rank}")
    for rank, per_rank in enumerate(world2):
        _check_resumed(per_rank["resumed"][0], world4, f"(2, 1) rank {rank}")


def test_a_checkpoint_saved_at_4_2_resumes_in_one_process_and_exports_for_from_pretrained(world4, checkpoint_root):
    from transformers import Qwen3MoeForCausalLM

    from zeroshard.checkpoint.export.fp32 import to_fp32

    outcome = resume(HFCase(1, 2), 0, 1, str(checkpoint_root / "saved"))  # (1, 1): no process group at all
    _check_resumed(outcome, world4, "(1, 1)")
    out = to_fp32(checkpoint_root / "saved", checkpoint_root / "fp32", progress=False)
    qwen3_moe().config.save_pretrained(out)
    model, info = Qwen3MoeForCausalLM.from_pretrained(out, output_loading_info=True)
    assert all(not info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    dense, masters, _, _ = _saved(world4)
    params = dict(model.named_parameters())
    for name, master in dense.items():
        assert torch.equal(params[name], master), name
    for name, by_id in masters.items():
        assert params[name].shape == (CONFIG["num_experts"], *by_id[0].shape)
        for g, master in by_id.items():
            assert torch.equal(params[name][g], master), (name, g)
