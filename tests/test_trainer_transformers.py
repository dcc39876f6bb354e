"""ZeroShardTrainer (zeroshard.integrations.transformers) as a user runs it: the example at 2
ranks against the bare zeroshard loop, every rank's state in its checkpoints, a resume at 1
rank; a transformers Qwen3-MoE at EP 2 resumed at EP 1. Its refusals: test_trainer_refusals.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[transformers]')")

import torch  # noqa: E402

import trainer_workers  # noqa: E402
from zeroshard.integrations.saves import FolderSaves  # noqa: E402
from zeroshard.launch import spawn  # noqa: E402

STEPS = 4  # checkpoints at steps 2 and 4


def _logged(checkpoint: Path, key: str = "loss") -> list[float]:
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    return [entry[key] for entry in history if key in entry]


def test_trainer_matches_the_bare_loop_saves_every_rank_and_resumes_at_one(tmp_path):
    out = tmp_path / "run"
    results = spawn(trainer_workers.transformers_run, 2, (str(out), STEPS), timeout_s=600)
    bare, logged = results[0]["bare"], results[0]["trainer"]
    # Bit for bit, at the same world size (2): the same engine arithmetic on the same rows.
    # Trainer's loss is sum / (tokens on all ranks) x 2 where the bare loop's is the rank's
    # mean, sum / (tokens on the rank): with 2 ranks of equal token counts the two differ by a
    # power of two, which rounding commutes with, in the loss and in every gradient.
    assert len(logged) == len(bare) == STEPS
    assert max(abs(a - b) for a, b in zip(logged, bare)) == 0.0, (logged, bare)
    assert all(norm > 0 for norm in results[0]["grad_norms"]), "the engine's norm is logged, not the model's .grad"

    # Every rank's optimizer state is in checkpoint-4: read back at world size 1, it is the
    # state the 2 ranks gathered after step 4, exactly (a load copies; it computes nothing).
    folder = out / "checkpoint-4"
    assert sorted(p.name for p in (folder / "zeroshard").glob("rank-*")) == [
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    ]
    assert not (folder / "optimizer.pt").exists()
    engine = trainer_workers.bare_engine(fused=True)  # world size 1, laid out as the Trainer's
    FolderSaves(engine).load(folder)
    assert trainer_workers.state_difference(engine, results[0]["state"]) == 0.0

    # Resume checkpoint-2 at 1 rank (2 micro-batches per step instead of 2 ranks): the first
    # resumed step runs the loaded weights on the same 8 rows, so its loss is bit for bit the
    # 2-rank run's (the two halves' losses are summed in one rounding either way).
    shutil.rmtree(folder)
    shutil.rmtree(out / "model")
    trainer_workers.torchrun(1, "examples/trainer_transformers.py", "--out", str(out), "--steps", str(STEPS))
    resumed = _logged(out / "checkpoint-4")
    assert resumed[:2] == logged[:2], "the 2-rank history comes back with trainer_state.json"
    assert resumed[2] - logged[2] == 0.0
    assert (out / "model" / "model.safetensors").is_file() and (out / "model" / "config.json").is_file()


def test_a_qwen3_moe_trains_at_ep_2_and_resumes_at_ep_1(tmp_path):
    out = tmp_path / "moe"
    losses = spawn(trainer_workers.moe_run, 2, (str(out), 3), timeout_s=600)[0]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses)
    shutil.rmtree(out / "checkpoint-3")

    # Resume the EP = 2 checkpoint at world size 1, EP = 1 (every expert on the one rank).
    trainer = trainer_workers.moe_trainer(str(out), 1, None, 3)
    trainer.train(resume_from_checkpoint=True)
    resumed = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    # The same loaded weights on the same 8 rows: the two runs differ only in how the expert
    # matmuls group their rows (all-to-all'd tokens of both ranks at EP = 2, one micro-batch at
    # EP = 1). Each fp32 dot product of length K <= 48 rounds within K u = 48 x 2^-24 ~ 2.9e-6
    # of its magnitude (Higham's gamma_K); through two layers and a softmax over 64 logits a
    # loss of about ln 64 ~ 4.2 moves by a few times that relative: 1e-4 leaves ample room.
    assert abs(resumed[2] - losses[2]) <= 1e-4, (resumed, losses)

    trainer.save_model(str(tmp_path / "export"))
    from transformers import Qwen3MoeForCausalLM

    loaded, info = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    experts = loaded.model.layers[0].mlp.experts.gate_up_proj
    assert experts.shape[0] == 4 and torch.equal(experts, trainer.engine.get_full_fp32_param("model.layers.0.mlp.experts.gate_up_proj"))
