"""Spawn targets for tests/test_launch.py (module level, so spawned ranks can import them)."""

from __future__ import annotations

import sys
import threading

import torch


def expected_tensors(rank: int, count: int) -> dict[str, torch.Tensor]:
    """``count`` tensors of this rank, of several sizes, dtypes and layouts, from a seed."""
    generator = torch.Generator().manual_seed(1000 + rank)
    tensors = {}
    for index in range(count):
        numel = 1 + (index * 37) % 500
        values = torch.randn(numel, generator=generator)
        kind = index % 4
        if kind == 1:
            values = values.to(torch.bfloat16)
        elif kind == 2:
            values = torch.randn(numel + 8, generator=generator)[3 : 3 + numel]  # a view into a larger storage
        elif kind == 3:
            values = torch.randint(-(2**40), 2**40, (numel,), generator=generator)
        tensors[f"rank{rank}/tensor{index}"] = values
    return tensors


def return_many_tensors(rank: int, world_size: int, count: int) -> dict[str, torch.Tensor]:
    return expected_tensors(rank, count)


def return_unpicklable(rank: int, world_size: int) -> object:
    return threading.Lock() if rank == 1 else 0


def demo_phase_then_destroy(rank: int, world_size: int, out_dir: str) -> dict:
    """The demo's training phase (a torch optimizer, a save), then destroy_process_group:
    afterwards nothing may keep the process group alive, or gloo tears it down during
    interpreter shutdown, where it can abort."""
    import gc
    import types
    import weakref

    import torch.distributed as dist

    from zeroshard.demos.dense import DemoConfig, train_phase

    world = weakref.ref(dist.group.WORLD)
    train_phase(rank, world_size, DemoConfig(steps=2, progress=False), out_dir, 0, 1, False)
    dist.destroy_process_group()
    gc.collect()
    holders = sorted(
        f"{module_name}.{name}"
        for module_name, module in list(sys.modules.items())
        if module_name.startswith("torch.distributed")
        for name, value in list(vars(module).items())
        if isinstance(value, types.FunctionType)
        and any(isinstance(default, dist.ProcessGroup) for default in (value.__defaults__ or ()))
    )
    return {"group_freed": world() is None, "functions_holding_a_group": holders}


def imported_at_start(rank: int, world_size: int, names: tuple[str, ...]) -> dict[str, bool]:
    """Which of ``names`` the rank had imported before it ran anything of its own."""
    import sys

    return {name: name in sys.modules for name in names}
