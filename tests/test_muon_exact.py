"""ZeroOptimizer with torch.optim.Muon + torch.optim.AdamW at D = 3, 4 and 8 (a tiny model: half
the ranks own no matrix) against one process, end to end over 4 steps of 2 micro-batches,
BIT FOR BIT (issue 32, part 3).

The probe loss makes every gradient exact whatever the order of the sums
(tests/muon_exact_workers.py derives it), so the masters, Muon's ``momentum_buffer``, AdamW's
``exp_avg`` and ``exp_avg_sq`` and the model's parameters must equal the reference's after
every step, though torch's Newton-Schulz runs in bf16; the premise (the engine's reduced
gradient is the reference's) is asserted too. Clipping stays inactive (not exact: the norm
is compared within its bound); tests/test_muon_engine.py covers the rest, one step at a time.
One spawn per world size runs every case of it."""

from __future__ import annotations

import pytest
from muon_exact_workers import exact_case, run_exact_cases

from zeroshard.launch import spawn

CASES = {
    3: [
        exact_case("stage1-fp32", stage=1, bucket_numel=None),
        exact_case("stage2-fp32", bucket_numel=150),
        exact_case("stage2-bf16", dtype="bfloat16", bucket_numel=200),
        exact_case("stage1-bf16-reduce-bf16", stage=1, dtype="bfloat16", reduce_dtype="bfloat16", bucket_numel=None),
    ],
    4: [
        exact_case("stage2-fp32", bucket_numel=250),
        exact_case("stage1-bf16", stage=1, dtype="bfloat16", bucket_numel=None),
        exact_case("stage2-bf16-reduce-bf16", dtype="bfloat16", reduce_dtype="bfloat16", bucket_numel=300),
        exact_case("moe-ep2-stage2-bf16", model="moe", ep=2, dtype="bfloat16", bucket_numel=300),
        exact_case("moe-ep2-stage1-fp32", model="moe", ep=2, stage=1, bucket_numel=None),
    ],
    8: [exact_case("tiny-stage2-fp32", model="tiny", bucket_numel=100)],
}


@pytest.fixture(scope="module")
def reports():
    cache: dict[int, dict[str, list[dict]]] = {}

    def at(world_size: int) -> dict[str, list[dict]]:
        if world_size not in cache:
            per_rank = spawn(run_exact_cases, world_size, (CASES[world_size],), timeout_s=600)
            cases = CASES[world_size]
            cache[world_size] = {case.name: [ranks[i] for ranks in per_rank] for i, case in enumerate(cases)}
        return cache[world_size]

    return at


@pytest.mark.parametrize(
    "world_size, name", [pytest.param(w, c.name, id=f"D{w}-{c.name}") for w, cases in CASES.items() for c in cases]
)
def test_muon_engine_equals_one_process_run_bit_for_bit(reports, world_size, name):
    for report in reports(world_size)[name]:
        # The premise: the engine reduced exactly the reference's gradient, every step.
        assert report["grad_diff"] == 0.0, report
        # Four steps later: masters, every state and the model's parameters, bit for bit.
        assert report["masters_diff"] == 0.0 and report["params_diff"] == 0.0, report
        assert report["states_diff"] == {"momentum_buffer": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}, report
        assert report["first_diff_step"] == -1, report
        assert report["moved"] > 1e-3, report  # the run trained: the equality is not of untouched values
        assert report["norm_rel_diff"] <= report["norm_bound"], report
