"""Fixtures shared by several test modules."""

from __future__ import annotations

import time

import pytest

from zeroshard import launch

# What the tests' ranks import beyond torch and zeroshard: imported once, in the forkserver
# they fork from, instead of 2-4 s of CPU a rank here (tests/trainer_workers.py,
# hf_moe_workers.py, resume_workers.py, autoep_workers.py).
launch.preload("transformers.trainer", "lightning.pytorch", "transformers.models.qwen3_moe.modeling_qwen3_moe")


@pytest.fixture(scope="session")
def deepspeed_runs(tmp_path_factory):
    """Real DeepSpeed checkpoints, made once per session (tests/deepspeed_fixtures.py)."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e '.[deepspeed]')")
    from deepspeed_fixtures import generate

    started = time.perf_counter()
    runs = generate(tmp_path_factory.mktemp("deepspeed"))
    print(f"\nDeepSpeed fixtures: {len(runs)} runs ready in {time.perf_counter() - started:.1f} s")
    return runs


@pytest.fixture(scope="session")
def autoep_runs(tmp_path_factory):
    """Real DeepSpeed AutoEP checkpoints of a tiny transformers Qwen3-MoE, made once per session
    (tests/autoep_fixtures.py) with the transformers 5.9.0 that scripts/setup.sh puts aside."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e '.[deepspeed]')")
    from autoep_fixtures import TRANSFORMERS_DIR, generate, transformers_ready

    if not transformers_ready():
        pytest.skip(f"{TRANSFORMERS_DIR} holds no transformers 5.9.0 for AutoEP (bash scripts/setup.sh makes it)")
    started = time.perf_counter()
    runs = generate(tmp_path_factory.mktemp("autoep"))
    print(f"\nDeepSpeed AutoEP fixtures: {len(runs)} runs ready in {time.perf_counter() - started:.1f} s")
    return runs


@pytest.fixture(scope="session")
def deepspeed_muon_runs(tmp_path_factory):
    """Real DeepSpeed Muon (MuonWithAuxAdam) ZeRO-1/2 checkpoints, made once per session
    (tests/deepspeed_muon_fixtures.py)."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e '.[deepspeed]')")
    from deepspeed_muon_fixtures import generate

    started = time.perf_counter()
    runs = generate(tmp_path_factory.mktemp("deepspeed_muon"))
    print(f"\nDeepSpeed Muon fixtures: {len(runs)} runs ready in {time.perf_counter() - started:.1f} s")
    return runs
