"""The zeroshard engine resumes a DeepSpeed ZeRO-1/2 run at another world size.

The DeepSpeed runs (deepspeed_fixtures) train 3 steps, save, and go on for CONTINUE_STEPS more,
recording their losses and learning rates. Here a ZeroOptimizer at another D loads the saved
checkpoint with ``load_checkpoint`` and trains those steps itself, with what DeepSpeed had:

* the fixture's model, cast the way DeepSpeed's bf16 engine casts it (parameters only, frozen
  ones included; buffers stay fp32);
* its param groups, the very same ones, 0-element ``empty`` parameter included (DeepSpeed
  leaves it out of its flat buffers and saves it with the frozen ones);
* torch's AdamW (DeepSpeed's ``torch_adam``), lr / betas / weight decay from the checkpoint,
  gradient clipping at CLIP, DeepSpeed's WarmupCosineLR schedule continued from the saved
  ``last_batch_iteration``;
* the same global batch per step, split into equal row ranges per rank.

Right after the load the fp32 masters and Adam states equal DeepSpeed's accessors bit for bit.
The losses then differ by rounding only: the first step's by the summation order of another
batch split, later ones also because DeepSpeed reduces the bf16 gradients in bf16 and zeroshard
in fp32. The tolerances below are stated with what was measured.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')", allow_module_level=True)

import torch.distributed as dist
from deepspeed_fixtures import (
    BASE_LR,
    BETAS,
    CLIP,
    CONTINUE_STEPS,
    GLOBAL_BATCH,
    NO_DECAY_LR,
    SEQ_LEN,
    STEPS,
    Fixture,
    build_model,
    deepspeed_universal_folder,
    global_batch,
    param_groups,
    rank_rows,
    warmup_cosine_lr,
)
from safetensors.torch import load_file

from zeroshard.checkpoint.engine_io import checkpoint_kind, load_checkpoint
from zeroshard.engine import ZeroOptimizer
from zeroshard.launch import spawn

# |zeroshard - DeepSpeed| / DeepSpeed of the global mean loss. The first continued step sees
# the same weights and sums the same fp32 per-token losses in another split: a sum of
# n = GLOBAL_BATCH * SEQ_LEN = 120 terms in another order, within 2 n u = 1.4e-5 (measured 2.6e-8).
# Later steps follow weights that went through DeepSpeed's bf16 gradient reduction or
# zeroshard's fp32 one; the Adam updates then differ by far less than a bf16 ulp of the
# weights, so the two runs' bf16 weights differ by at most one rounding each (2^-8 relative),
# and the loss by at most that (measured: 1.7e-7, once 1.6e-4 when a weight rounded the other way).
FIRST_LOSS_RELATIVE_TOLERANCE = 2 * GLOBAL_BATCH * SEQ_LEN * 2.0**-24
LOSS_RELATIVE_TOLERANCE = 2.0**-8
STATE_KEYS = ("exp_avg", "exp_avg_sq")
SPAWN_TIMEOUT_S = 240


# ---- the zeroshard side (runs on every rank; spawn targets are module-level) -------------------------


def model_as_deepspeed_runs_it(fixture: Fixture) -> torch.nn.Module:
    """The fixture's model with its parameters in bf16 and its buffers as they are."""
    model = build_model(fixture.config.tiny_no_decay)
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    return model


def make_engine(model: torch.nn.Module, groups: list[dict], stage: int) -> ZeroOptimizer:
    return ZeroOptimizer(model, torch.optim.AdamW, groups, stage=stage, max_grad_norm=CLIP, lr=BASE_LR, betas=BETAS)


def as_bytes(tensor: torch.Tensor) -> tuple[tuple[int, ...], bytes]:
    """Plain bytes for the result queue (tensors would travel as shared memory that dies
    with the rank)."""
    return tuple(tensor.shape), tensor.detach().cpu().contiguous().numpy().tobytes()


def from_bytes(shape_and_data: tuple[tuple[int, ...], bytes]) -> torch.Tensor:
    shape, data = shape_and_data
    return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)


def global_mean(loss: torch.Tensor, world_size: int) -> float:
    total = loss.detach().double().reshape(1)
    if world_size > 1:
        dist.all_reduce(total)
    return float(total) / world_size


def resume(rank: int, world_size: int, fixture: Fixture, stage: int) -> dict:
    """Load ``fixture``'s checkpoint at this world size, read back the full state, train on."""
    model = model_as_deepspeed_runs_it(fixture)
    engine = make_engine(model, param_groups(model), stage)
    extra = load_checkpoint(engine, fixture.save_dir)
    loaded = {}
    for group in engine.layout.groups:  # collective: every rank asks for every name
        for name in [slot.name for slot in group.params if slot.numel > 0]:  # DeepSpeed has no state for `empty`
            loaded[f"fp32/{name}"] = as_bytes(engine.get_full_fp32_param(name))
            for key in STATE_KEYS:
                loaded[f"{key}/{name}"] = as_bytes(engine.get_full_optimizer_state(name, key))
    iteration = extra["lr_scheduler"]["last_batch_iteration"]
    losses, lrs = [], []
    for step in range(STEPS, STEPS + CONTINUE_STEPS):
        lrs.append([group["lr"] for group in engine.param_groups])
        tokens, targets = rank_rows(global_batch(step), rank, world_size)
        loss = model(tokens, targets)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        iteration += 1  # DeepSpeed steps its scheduler after each optimizer step
        for group, base_lr in zip(engine.param_groups, (BASE_LR, NO_DECAY_LR)):
            group["lr"] = warmup_cosine_lr(base_lr, iteration)
        losses.append(global_mean(loss, world_size))
    return {
        "loaded": loaded,
        "losses": losses,
        "lrs": lrs,
        "global_steps": extra["global_steps"],
        "empty_in_layout": "empty" in engine.layout.param_names,
    }


def resume_each(rank: int, world_size: int, cases: list[tuple[Fixture, int]]) -> list[dict]:
    """Spawn target: :func:`resume` for each (fixture, stage), one after another."""
    return [resume(rank, world_size, fixture, stage) for fixture, stage in cases]


# ---- cases ------------------------------------------------------------------------------------------

# (DeepSpeed run, zeroshard world size, zeroshard stage); one spawn per world size above 1.
CASES = [
    ("w2_s2", 3, 2),
    ("w8_s2_align_tiny", 3, 1),  # the 3-element group that pads 6 of 8 ranks, and another stage
    ("w4_s1", 2, 1),
    ("w4_s2_align", 2, 2),
    ("w2_s2", 1, 2),
    ("w2_s1_align", 1, 1),
]


@pytest.fixture(scope="module")
def resumed(deepspeed_runs) -> dict[tuple[str, int, int], dict]:
    results = {}
    for world_size in sorted({world for _, world, _ in CASES}):
        cases = [(name, stage) for name, world, stage in CASES if world == world_size]
        work = [(deepspeed_runs[name], stage) for name, stage in cases]
        if world_size == 1:
            outcomes = resume_each(0, 1, work)  # no process group: the engine runs as a world of one
        else:
            outcomes = spawn(resume_each, world_size, (work,), timeout_s=SPAWN_TIMEOUT_S)[0]
        results.update({(name, world_size, stage): outcome for (name, stage), outcome in zip(cases, outcomes)})
    return results


def case_id(case: tuple[str, int, int]) -> str:
    name, world, stage = case
    return f"{name}-to-D{world}-stage{stage}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_state_right_after_load_equals_deepspeeds_accessors(case, resumed, deepspeed_runs):
    references = load_file(str(deepspeed_runs[case[0]].accessors))
    loaded = resumed[tuple(case)]["loaded"]
    assert sorted(loaded) == sorted(references)
    for key, expected in references.items():
        actual = from_bytes(loaded[key])
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, key
        assert torch.equal(actual.view(torch.int32), expected.view(torch.int32)), key
    assert resumed[tuple(case)]["global_steps"] == STEPS
    assert resumed[tuple(case)]["empty_in_layout"], "the 0-element parameter is the engine's too"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_next_losses_match_deepspeed_continuing_the_run(case, resumed, deepspeed_runs):
    continued = json.loads(deepspeed_runs[case[0]].continued.read_text())
    outcome = resumed[tuple(case)]
    assert outcome["lrs"] == continued["lrs"], "the same learning rates, exactly"
    assert len(outcome["losses"]) == len(continued["losses"]) == CONTINUE_STEPS
    differences = [abs(ours - theirs) / theirs for ours, theirs in zip(outcome["losses"], continued["losses"])]
    print(f"\n{case_id(case)}: relative loss differences {', '.join(f'{d:.1e}' for d in differences)}")
    assert differences[0] < FIRST_LOSS_RELATIVE_TOLERANCE, (outcome["losses"], continued["losses"])
    assert max(differences) < LOSS_RELATIVE_TOLERANCE, (outcome["losses"], continued["losses"])


def test_load_checkpoint_recognises_a_deepspeed_checkpoint(deepspeed_runs):
    fixture = deepspeed_runs["w2_s2"]
    assert checkpoint_kind(fixture.save_dir) == checkpoint_kind(fixture.tag_dir) == "deepspeed"


@pytest.mark.parametrize("where", ["folder", "root"])
def test_load_checkpoint_refuses_deepspeeds_universal_format_by_name(deepspeed_runs, tmp_path, where):
    """ds_to_universal's output holds a model-states file too; it used to be opened as a
    ZeRO checkpoint and fail with "optimizer files missing"."""
    fixture = deepspeed_runs["w2_s2"]
    folder = deepspeed_universal_folder(fixture, tmp_path)
    path = folder if where == "folder" else folder.parent
    model = model_as_deepspeed_runs_it(fixture)
    engine = make_engine(model, param_groups(model), stage=2)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError) as error:
        load_checkpoint(engine, path)
    message = str(error.value)
    assert "\n" not in message and "nothing changed" in message
    assert f"{path}: a DeepSpeed universal checkpoint (ds_to_universal output), which zeroshard does not" in message
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
