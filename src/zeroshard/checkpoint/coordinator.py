"""Coordinator: the few collectives a save needs, behind a protocol tests can drive.

A save needs each rank's rank and the world size, a barrier, a broadcast from rank 0 and an
all-gather of small Python values. :class:`TorchDistributedCoordinator` does them over
torch.distributed; :func:`run_ranks` runs a function as several "ranks" on threads of one
process, each with a :class:`ThreadCoordinator`, so tests can save at large world sizes
without spawning processes.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Protocol, TypeVar, runtime_checkable

T = TypeVar("T")


@runtime_checkable
class Coordinator(Protocol):
    """Collectives among the ranks that save or load one checkpoint together."""

    @property
    def rank(self) -> int:
        """This rank's index in the group, 0 to ``world_size - 1``."""
        ...

    @property
    def world_size(self) -> int:
        """How many ranks the group holds."""
        ...

    def barrier(self) -> None:
        """Return once every rank of the group has called it. Collective."""
        ...

    def broadcast_object(self, value: Any, src: int = 0) -> Any:
        """``value`` as given on rank ``src``, returned on every rank. Collective."""
        ...

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, returned on every rank. Collective."""
        ...


class SingleProcessCoordinator:
    """World size 1: every collective is the identity."""

    rank = 0
    world_size = 1

    def barrier(self) -> None:
        """Return at once: the world-of-one version of a collective barrier."""

    def broadcast_object(self, value: Any, src: int = 0) -> Any:
        """``value`` itself: the world-of-one version of a collective broadcast."""
        return value

    def all_gather_object(self, value: Any) -> list[Any]:
        """``[value]``: the world-of-one version of a collective all-gather."""
        return [value]


class TorchDistributedCoordinator:
    """Collectives over a torch.distributed process group (the default group if None).

    With NCCL, object collectives go through the current CUDA device: call
    ``torch.cuda.set_device`` first, or pass a gloo ``group``.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """How many processes the group holds."""
        return self._world_size

    def barrier(self) -> None:
        """``torch.distributed.barrier`` over the group. Collective."""
        self._dist.barrier(group=self._group)

    def broadcast_object(self, value: Any, src: int = 0) -> Any:
        """``value`` as given on group rank ``src``, returned on every rank (pickled by
        ``torch.distributed.broadcast_object_list``). Collective."""
        holder = [value if self._rank == src else None]
        global_src = src if self._group is None else self._dist.get_global_rank(self._group, src)
        self._dist.broadcast_object_list(holder, src=global_src, group=self._group)
        return holder[0]

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in group rank order, returned on every rank. Collective."""
        gathered: list[Any] = [None] * self._world_size
        self._dist.all_gather_object(gathered, value, group=self._group)
        return gathered


def default_coordinator() -> Coordinator:
    """torch.distributed's default group when it is initialised with several ranks, else world size 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchDistributedCoordinator()
    return SingleProcessCoordinator()


class RankFailedError(RuntimeError):
    """Another thread-rank raised, so this collective can never complete."""


class _Rendezvous:
    """A barrier that lets through every rank that arrived before another rank failed."""

    def __init__(self, world_size: int, timeout: float) -> None:
        self._world_size = world_size
        self._timeout = timeout
        self._condition = threading.Condition()
        self._arrived = 0
        self._generation = 0
        self._failed = False

    def wait(self) -> None:
        with self._condition:
            generation = self._generation
            self._arrived += 1
            if self._arrived == self._world_size:
                self._arrived = 0
                self._generation += 1
                self._condition.notify_all()
                return
            done = self._condition.wait_for(lambda: self._generation != generation or self._failed, self._timeout)
            if self._generation != generation:
                return
            raise RankFailedError("another rank failed" if done else f"collective timed out after {self._timeout} s")

    def fail(self) -> None:
        with self._condition:
            self._failed = True
            self._condition.notify_all()


class _SharedSlots:
    def __init__(self, world_size: int, timeout: float) -> None:
        self.world_size = world_size
        self.barrier = _Rendezvous(world_size, timeout)
        self.lock = threading.Lock()
        self.calls: dict[int, list[Any]] = {}  # collective number -> one slot per rank

    def slots(self, call: int) -> list[Any]:
        with self.lock:
            # Everyone has read call - 2's slots before entering call - 1's barrier.
            self.calls.pop(call - 2, None)
            return self.calls.setdefault(call, [None] * self.world_size)


class ThreadCoordinator:
    """One "rank" of a group of threads in one process (see :func:`run_ranks`).

    Each collective gets fresh slots, so a rank leaves it as soon as the barrier opens and
    one that raises right after a collective does not break it for the others.
    """

    def __init__(self, rank: int, shared: _SharedSlots) -> None:
        self._rank = rank
        self._shared = shared
        self._calls = 0

    @property
    def rank(self) -> int:
        """This thread's rank, 0 to ``world_size - 1``."""
        return self._rank

    @property
    def world_size(self) -> int:
        """How many threads :func:`run_ranks` started."""
        return self._shared.world_size

    def barrier(self) -> None:
        """Return once every thread-rank has called it. Collective (among the threads).

        Raises:
            RankFailedError: another thread-rank raised, or the wait timed out.
        """
        self._exchange(None)

    def broadcast_object(self, value: Any, src: int = 0) -> Any:
        """``value`` as given on rank ``src``, returned on every thread-rank. Collective (among the threads).

        Raises:
            RankFailedError: another thread-rank raised, or the wait timed out.
        """
        return self._exchange(value if self._rank == src else None)[src]

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every thread-rank's ``value``, in rank order. Collective (among the threads).

        Raises:
            RankFailedError: another thread-rank raised, or the wait timed out.
        """
        return self._exchange(value)

    def _exchange(self, value: Any) -> list[Any]:
        self._calls += 1
        slots = self._shared.slots(self._calls)
        slots[self._rank] = value
        self._shared.barrier.wait()
        return list(slots)


def run_ranks(
    world_size: int, fn: Callable[[ThreadCoordinator], T], *, timeout: float = 120.0, return_exceptions: bool = False
) -> list[Any]:
    """Run ``fn`` as ranks 0..world_size-1 on threads; their results in rank order.

    A rank that raises makes the others raise RankFailedError at their next collective
    instead of waiting forever, as when a process dies. Without ``return_exceptions`` the
    first rank's own exception (not a RankFailedError) is raised.
    """
    shared = _SharedSlots(world_size, timeout)
    results: list[Any] = [None] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(ThreadCoordinator(rank, shared))
        except BaseException as err:  # noqa: BLE001 - handed back to the caller
            results[rank] = err
            shared.barrier.fail()

    threads = [threading.Thread(target=body, args=(rank,), name=f"rank-{rank}") for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if not return_exceptions:
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise next((e for e in errors if not isinstance(e, RankFailedError)), errors[0])
    return results
