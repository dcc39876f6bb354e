"""Layout cost against parameters and world size.

Builds the layout of models of 1k, 10k and 100k parameters at world sizes 8 and 4096 and
lists one rank's fragments. The cost must grow with parameters plus ranks, not their
product: compare the 4096 column with the 8 column (a ratio near 1 means the world size
adds nothing per parameter).

    .venv/bin/python benchmarks/layout_scaling.py
"""

from __future__ import annotations

import random
import time

from zeroshard.layout import ParamSpec, build_layout


def model(num_params: int) -> list[list[ParamSpec]]:
    rng = random.Random(num_params)
    shapes = [(rng.choice([1, 7, 64, 127, 1024]), rng.choice([1, 3, 16, 33])) for _ in range(num_params)]
    return [[ParamSpec(f"p{i}", shape, "bfloat16") for i, shape in enumerate(shapes)]]


def best_of(repeats: int, function) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    print(f"{'params':>8} {'D':>6} {'build ms':>10} {'one rank ms':>12} {'all-rank padding ms':>20}")
    for num_params in (1_000, 10_000, 100_000):
        groups = model(num_params)
        times = {}
        for world_size in (8, 4096):
            build = best_of(3, lambda: build_layout(groups, world_size))
            layout = build_layout(groups, world_size)
            rank = world_size // 3
            one_rank = best_of(3, lambda: (layout.groups[0].fragments(rank), layout.groups[0].padding_ranges(rank)))
            per_rank = best_of(3, layout.groups[0].padding_per_rank)
            times[world_size] = build
            print(f"{num_params:>8} {world_size:>6} {1e3 * build:>10.1f} {1e3 * one_rank:>12.3f} {1e3 * per_rank:>20.1f}")
        print(f"{'':>8} build time ratio D=4096 / D=8: {times[4096] / times[8]:.2f}")


if __name__ == "__main__":
    main()
