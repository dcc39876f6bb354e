"""Checkpoints of MoEGPT trained with expert parallelism, on spawned gloo ranks: saved at one
(W, EP), loaded at another, through the engine's save_checkpoint / load_checkpoint.

* after the load, every fp32 master and Adam state, gathered by global expert id, equals the
  source run's at the save bit for bit (counted differing elements must be 0);
* the loaded run, trained on the same global batches, continues the source run's losses
  within test_moe_engine's relative tolerances (fp32 2 n u, bf16 2 x 2^-8: summation order
  differs with W);
* each rank file holds its experts' elements, each expert element in exactly one file;
* the universal export loads back at another (W, EP); the fp32 export loads with strict=True
  into MoEGPT at EP = 1 and holds the source's masters;
* module-only and weights-only loads, and the refusals of a dense run, of another expert
  count and of a dense checkpoint, on every rank, changing nothing; an engine whose expert
  process group is not the mesh's column (so its rank files would name the wrong experts)
  is refused at construction;
* the (2, 2) run saves, and the (4, 2) run resumes, through an asynchronous Checkpointer.

Four spawns in all (W = 2, 4, 2, in order: later runs load what earlier ones saved), every
check of a world size grouped into its spawn.
"""

from __future__ import annotations

import math

import pytest
import torch
from moe_checkpoint_workers import Run
from moe_engine_workers import BATCH, MODEL, SEQ
from safetensors import safe_open
from safetensors.torch import load_file

from zeroshard.checkpoint import open_checkpoint
from zeroshard.launch import spawn
from zeroshard.layout import global_shape, rank_runs

FP32_LOSS, BF16_LOSS = 2 * 4 * BATCH * SEQ * 2.0**-24, 2 * 2.0**-8  # as test_moe_engine's, at W <= 4
SOURCE_A = Run(ep_size=2)  # (4, 2), stage 2, fp32
SOURCE_B = Run(ep_size=2, stage=1, dtype="bfloat16", checkpointer=True)  # (2, 2)
RESUMED_AT_4 = [("A", Run(ep_size=4, stage=1)), ("B", Run(ep_size=2, dtype="bfloat16", checkpointer=True))]
RESUMED_AT_2 = [("A", Run(ep_size=1)), ("A", Run(ep_size=1, single=True)), ("universal", Run(ep_size=2))]


def _grouped(world_size: int, calls: list) -> list[list]:
    from moe_checkpoint_workers import grouped

    return spawn(grouped, world_size, (calls,), backend="gloo", timeout_s=400)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every spawn, in order; the outcomes by name, per rank."""
    from zeroshard.checkpoint.export.fp32 import to_fp32
    from zeroshard.checkpoint.universal import to_universal

    root = tmp_path_factory.mktemp("moeckpt")
    dirs = {name: str(root / name) for name in ("A", "B", "refA", "refB", "scratch", "universal", "fp32")}
    _grouped(2, [("source_run", (SOURCE_B, dirs["B"], dirs["refB"]))])
    at_4 = _grouped(
        4,
        [("source_run", (SOURCE_A, dirs["A"], dirs["refA"]))]
        + [("resumed_run", (run, dirs[name], dirs[f"ref{name}"])) for name, run in RESUMED_AT_4]
        + [("refused_loads", (dirs["A"], dirs["scratch"]))],
    )
    to_universal(dirs["A"], dirs["universal"], progress=False)
    to_fp32(dirs["A"], dirs["fp32"], progress=False)
    at_2 = _grouped(
        2,
        [("resumed_run", (run, dirs[name], dirs["refA"])) for name, run in RESUMED_AT_2]
        + [("partial_loads", (Run(ep_size=2), dirs["A"], dirs["refA"]))],
    )
    return {"dirs": dirs, "at_4": at_4, "at_2": at_2}


def _resumed(runs):
    for world_size, cases, first in ((4, RESUMED_AT_4, 1), (2, RESUMED_AT_2, 0)):
        per_rank = runs[f"at_{world_size}"]
        for index, (name, run) in enumerate(cases):
            yield world_size, name, run, [outcome[first + index] for outcome in per_rank]


def test_loaded_state_equals_the_saved_run_bit_for_bit(runs):
    checked = 0
    for world_size, name, run, outcomes in _resumed(runs):
        for rank, outcome in enumerate(outcomes):
            where = f"{name} -> W={world_size} {run.label} rank {rank}"
            assert outcome["keys"], where
            assert {key: n for key, n in outcome["differing"].items() if n} == {}, where
            local = MODEL.num_experts // (1 if run.single else run.ep_size)
            first = 0 if run.single else (rank % run.ep_size) * local
            assert outcome["experts"] == list(range(first, first + local)), where
            checked += 1
    assert checked == 4 * 2 + 2 * 3


def test_loaded_runs_continue_the_uninterrupted_losses(runs):
    for world_size, name, run, outcomes in _resumed(runs):
        bound = BF16_LOSS if name == "B" else FP32_LOSS
        for rank, outcome in enumerate(outcomes):
            assert outcome["loss_diff"] <= bound, (
                f"{name} -> W={world_size} {run.label} rank {rank}: {outcome['loss_diff']}"
            )


def test_each_expert_element_is_in_exactly_one_rank_file(runs):
    """The (4, 2) checkpoint's rank files against the source's state by global expert id."""
    directory = open_checkpoint(runs["dirs"]["A"]).directory
    reference = load_file(f"{runs['dirs']['refA']}/state.safetensors")
    layout = open_checkpoint(directory).manifest.layout
    group = next(g for g in layout.groups if g.is_expert_group)
    counts = {slot.name: torch.zeros(math.prod(global_shape(group, slot)), dtype=torch.int64) for slot in group.params}
    for rank in range(4):
        with safe_open(directory / f"rank-{rank:05d}-of-00004.safetensors", framework="pt") as handle:
            written = {key: handle.get_tensor(f"group{group.index}.{key}") for key in ("fp32", "state.exp_avg")}
        for run in rank_runs(group, rank):
            for key, kind in (("fp32", "fp32"), ("state.exp_avg", "exp_avg")):
                expected = reference[f"{kind}/{run.name}"].reshape(-1)[run.global_start : run.global_start + run.length]
                assert torch.equal(written[key][run.partition_start : run.partition_start + run.length], expected), run
            counts[run.name][run.global_start : run.global_start + run.length] += 1
    assert all(bool((c == 1).all()) for c in counts.values())


def test_fp32_export_loads_strictly_into_the_model_at_ep_1(runs):
    from zeroshard.moe import MoEGPT

    model = MoEGPT(MODEL)
    state = load_file(f"{runs['dirs']['fp32']}/model.safetensors")
    assert "blocks.0.moe.experts.3.w2.weight" in state and "blocks.0.moe.experts.w2" not in state
    model.load_state_dict(state, strict=True)
    reference = load_file(f"{runs['dirs']['refA']}/state.safetensors")
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), reference[f"fp32/{name}"]), name


def test_module_only_and_weights_only_loads(runs):
    for rank, outcome in enumerate(per_rank[-1] for per_rank in runs["at_2"]):
        for label in ("module_only", "weights_only"):
            loaded = outcome[label]
            assert {n: c for n, c in loaded["weights"].items() if c} == {}, (rank, label)
            assert {n: c for n, c in loaded["masters"].items() if c} == {}, (rank, label)
        assert {k: c for k, c in outcome["module_only"]["kept"].items() if c} == {}, rank
        assert outcome["module_only"]["states"] == [3, 3] and outcome["weights_only"]["states"] == [0, 0], rank


def test_other_experts_or_dense_runs_are_refused_on_every_rank(runs):
    outcomes = [per_rank[-1] for per_rank in runs["at_4"]]
    expected = {
        "dense_run": "3 expert weights on one side, dense on the other: blocks.0.moe.experts.w1 (checkpoint expert, run dense)",
        "more_experts": "blocks.0.moe.experts.w1 (checkpoint [4, 16, 8], run [8, 16, 8])",
        "dense_checkpoint": "3 expert weights on one side, dense on the other: blocks.0.moe.experts.w1 (checkpoint dense, run expert)",
    }
    for rank, outcome in enumerate(outcomes):
        for label, text in expected.items():
            error = outcome["errors"][label]
            assert text in error and "not loaded (nothing changed)" in error, (rank, label, error)
            assert "\n" not in error and error == outcomes[0]["errors"][label], (rank, label)
            assert outcome["changed"][label] == 0, (rank, label)
        wrong_groups = (
            "the expert process group is not the expert mesh's column (rank 1: it is rank 1 of its expert-DP group"
        )
        assert outcome["errors"]["wrong_groups"].startswith(wrong_groups), outcome["errors"]["wrong_groups"]
