"""Fixtures shared by several test modules."""

from __future__ import annotations

import time

import pytest


@pytest.fixture(scope="session")
def deepspeed_runs(tmp_path_factory):
    """Real DeepSpeed checkpoints, made once per session (tests/deepspeed_fixtures.py)."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e '.[deepspeed]')")
    from deepspeed_fixtures import generate

    started = time.perf_counter()
    runs = generate(tmp_path_factory.mktemp("deepspeed"))
    print(f"\nDeepSpeed fixtures: {len(runs)} runs ready in {time.perf_counter() - started:.1f} s")
    return runs
