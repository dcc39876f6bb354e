"""Expert parallelism across spawned gloo ranks equals the single-process layer holding every
expert: same outputs and input gradients for each rank's tokens, router gradients from its own
tokens, and expert gradients summed over the tokens of the whole EP group."""

from __future__ import annotations

import pytest
from moe_workers import HIDDEN, run_cases

from zeroshard.launch import spawn
from zeroshard.layout import ExpertMesh

# Max abs difference over the reference's max magnitude. fp32: the same arithmetic up to
# summation order: an expert gradient sums at most the 4 ranks' 5 + 7 r tokens (68), a matmul
# output HIDDEN terms, so another order is within 2 n u with n <= 68 + HIDDEN (seen: 4e-7).
# bf16: outputs and input gradients match exactly here, but expert gradients are rounded to
# bf16 once over the EP group's rows and once per rank in the reference, then summed: up to
# EP + 1 roundings of 2^-8 apart, EP <= 4 (seen: 5e-3).
MAX_TOKENS = sum(5 + 7 * rank for rank in range(4))
TOLERANCE = {"float32": 2 * (MAX_TOKENS + HIDDEN) * 2.0**-24, "bfloat16": (4 + 1) * 2.0**-8}


def check(results: list[list[dict]], world_size: int, cases) -> None:
    for index, (ep_size, dtype, empty_rank) in enumerate(cases):
        mesh = ExpertMesh(world_size, ep_size)
        for rank, outcome in enumerate(per_rank[index] for per_rank in results):
            where = f"W={world_size} EP={ep_size} {dtype} rank {rank}"
            assert outcome["ep_ranks"] == list(mesh.ep_group(rank)), where
            assert outcome["expert_dp_ranks"] == list(mesh.expert_dp_group(rank)), where
            assert outcome["local_experts"] == [
                e for e in range(4) if e // (4 // ep_size) == mesh.ep_rank(rank)
            ], where
            assert outcome["tokens"] == (0 if rank == empty_rank else 5 + 7 * rank), where
            for key in ("output", "input_grad", "gate_grad", "expert_grads"):
                assert outcome[key] <= TOLERANCE[dtype], f"{where}: {key} differs by {outcome[key]}"
        assert max(outcome[index]["output_scale"] for outcome in results) > 0.5  # differences are small against it


@pytest.mark.parametrize(
    "world_size, cases",
    [
        (2, [(2, "float32", None), (2, "bfloat16", None), (2, "float32", 1), (1, "float32", None)]),
        (4, [(2, "float32", None), (4, "float32", 0), (2, "bfloat16", 3)]),
    ],
)
def test_expert_parallel_layer_equals_single_process_layer(world_size, cases):
    outcomes = spawn(run_cases, world_size, (cases,), backend="gloo", timeout_s=240)
    for error, _ in outcomes:  # raised on every rank alike, so no rank waits in new_group
        assert error == f"expert parallelism {world_size + 1} does not divide the world size {world_size}"
    check([results for _, results in outcomes], world_size, cases)
