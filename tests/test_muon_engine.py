"""ZeroOptimizer with torch.optim.Muon (matrices, expert matrices) and torch.optim.AdamW
(the rest) on gloo ranks against one process (issue 32, parts 2 and 3).

One spawn per world size runs every case of it (tests/muon_workers.py says what is compared
and why the bounds are what they are): the step is torch's Muon and AdamW bit for bit given
the engine's gradient and state; the gradient is the ranks' local gradients reduced, equal
bit for bit where the sum has one order (D <= 2, or the bf16 reduction) and within the fp32
bound of another summation order above; every matrix is orthogonalised exactly once per
step across the job; the model's parameters are the masters cast; padding stays zero.

End to end over several steps, where bf16 Newton-Schulz lets no useful bound survive a
last-bit difference, tests/test_muon_exact.py compares the engine at D = 3, 4 and 8 with a
one-process torch Muon + AdamW run bit for bit, on a probe loss whose gradients are exact in
any summation order."""

from __future__ import annotations

import pytest
from muon_workers import MuonCase, run_cases

from zeroshard.launch import spawn

CASES = {
    1: [
        MuonCase("stage1-fp32", stage=1, bucket_numel=None),
        MuonCase("stage2-bf16", dtype="bfloat16"),
    ],
    2: [
        MuonCase("stage1-fp32", stage=1, bucket_numel=None),
        MuonCase("stage2-fp32", bucket_numel=200),
        MuonCase("stage2-bf16-reduce-bf16", dtype="bfloat16", reduce_dtype="bfloat16"),
        MuonCase("stage1-bf16-reduce-bf16", stage=1, dtype="bfloat16", reduce_dtype="bfloat16", bucket_numel=None),
        MuonCase("stage2-fp16-scaled", dtype="float16", max_grad_norm=None, accumulation=1),
    ],
    3: [
        MuonCase("stage1-bf16", stage=1, dtype="bfloat16", bucket_numel=None),
        MuonCase("stage2-fp32", bucket_numel=150),
    ],
    4: [
        MuonCase("stage2-fp32", bucket_numel=250),
        MuonCase("stage1-fp32", stage=1, bucket_numel=None),
        MuonCase("moe-ep2-stage2-bf16", model="moe", ep=2, dtype="bfloat16", bucket_numel=300),
        MuonCase("moe-ep2-stage1-fp32", model="moe", ep=2, stage=1, bucket_numel=None),
    ],
    8: [MuonCase("tiny-stage2-fp32", model="tiny", bucket_numel=100, steps=2)],
}


@pytest.fixture(scope="module")
def reports():
    cache: dict[int, dict[str, list[dict]]] = {}

    def at(world_size: int) -> dict[str, list[dict]]:
        if world_size not in cache:
            per_rank = spawn(run_cases, world_size, (CASES[world_size],), timeout_s=600)
            cache[world_size] = {case.name: [ranks[i] for ranks in per_rank] for i, case in enumerate(CASES[world_size])}
        return cache[world_size]

    return at


@pytest.mark.parametrize(
    "world_size, name", [pytest.param(w, c.name, id=f"D{w}-{c.name}") for w, cases in CASES.items() for c in cases]
)
def test_muon_engine_matches_torch_muon_and_adamw(reports, world_size, name):
    ranks = reports(world_size)[name]
    for report in ranks:
        assert all(report["owner_groups"][i] for i in (0,)) and not report["owner_groups"][1]
        # The step: torch's own Muon and AdamW, bit for bit, on the engine's gradient and state.
        assert report["step_masters_diff"] == 0.0 and report["step_state_diff"] == 0.0, report
        assert report["moved"] > 1e-4
        # The gradient: the ranks' local gradients reduced.
        assert report["grad_excess"] <= 0.0, report
        case = next(c for c in [*CASES[world_size]] if c.name == name)
        if world_size <= 2 or case.reduce_dtype != "float32":
            assert report["grad_max_diff"] == 0.0, report
        # Every matrix of the job orthogonalised once per step (counted on every rank).
        assert report["ns_calls"] == [report["expected_ns_calls"]] * len(report["ns_calls"]), report
        assert report["views_diff"] == 0.0 and report["padding_nonzero"] == 0.0, report
