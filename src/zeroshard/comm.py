"""Collectives over a torch.distributed process group, with a byte count per kind.

``Collectives`` is the only place the engine talks to torch.distributed. Without an
initialised process group it acts as a world of one, so the engine also runs in a plain
single process. The byte counts record each call's payload (the reduce-scatter input, the
all-gather output, the all-reduced tensor) so benchmarks can check what a step moves.

The partitioning collectives take ``sizes``, each rank's share of the input (reduce-scatter)
or output (all-gather) in rank order, for partitions of different sizes (an owner group's
buckets, ``zeroshard.layout.owners``); None means equal shares.

``agree`` and ``checked`` make a collective method fail on every rank or on none: each rank
runs its checks, then one small all-reduce tells every rank whether any rank failed or was
called with other arguments, and if so every rank raises the same error.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor collectives; older releases only have the first names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


T = TypeVar("T")

# Errors re-raised by type on every rank; any other is raised as a RuntimeError.
_AGREED_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (ValueError, KeyError, TypeError, IndexError, LookupError, FileNotFoundError, OSError)
}


class CollectiveCallError(RuntimeError):
    """A collective method's agreement did not complete: the other ranks did not call it
    (they exited, crashed, or were elsewhere past the process group's timeout)."""


def _not_joined(call: str, error: BaseException) -> str:
    lines = str(error).strip().splitlines() or [type(error).__name__]
    reason = lines[0] if len(lines[0]) <= 200 else lines[0][:197] + "..."
    return (
        f"{call} is collective: every rank must call it, with the same arguments, but the other ranks did not "
        f"join it ({reason})"
    )


def _error_text(error: BaseException) -> str:
    if isinstance(error, KeyError) and len(error.args) == 1:
        return str(error.args[0])  # str(KeyError) would quote the message
    return str(error)


class _Done:
    """Handle of a collective that completed synchronously (world of one)."""

    def wait(self) -> bool:
        return True


class _AllDone:
    """Handle of several collectives: waits for each."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        self._works = []
        return True


class _Widening:
    """Handle of ``reduce_scatter_widened``: on wait, output <- the float32 sum of ``parts``
    (every rank's part in rank order, or one already summed), in that order."""

    def __init__(self, work: Any, parts: list[torch.Tensor], output: torch.Tensor, scratch: torch.Tensor) -> None:
        self._work, self._parts, self._output, self._scratch = work, parts, output, scratch

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The temporaries it holds until waited on (for memory accounting)."""
        return [] if self._parts is None else [self._scratch]

    def wait(self) -> bool:
        if self._parts is None:
            return True
        self._work.wait()
        first, *rest = self._parts
        self._output.copy_(first)
        for part in rest:
            self._output.add_(part)
        self._work = self._parts = self._scratch = None
        return True


@dataclass
class Collectives:
    """The collectives a ZeRO rank needs, over one process group.

    Every method that moves data is collective over ``group`` (the default group when None):
    every rank of it calls it, in the same order, with tensors of the same size. In a world
    of one (no initialised process group) they copy locally and return at once.

    Raises:
        ValueError: at construction, a ``group`` is given but torch.distributed is not initialised.
    """

    group: Any = None
    bytes_moved: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.group is not None and not self.distributed:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1

    @property
    def backend(self) -> str:
        """The group's backend ("gloo", "nccl", ...), or "local" without torch.distributed."""
        return dist.get_backend(self.group) if self.distributed else "local"

    def reduce_scatter_sum(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, sizes: list[int] | None = None
    ):
        """Collective over ``group``: output (one partition) <- the sum over ranks of this
        rank's partition of input (``sizes``: the partitions' lengths, in rank order; None:
        equal). Returns a handle to ``wait()`` on (done at once unless ``async_op``)."""
        self.bytes_moved["reduce_scatter"] += input.numel() * input.element_size()
        if self.world_size == 1:
            output.copy_(input)
            return _Done()
        if sizes is not None:  # gloo and NCCL both take unequal parts in the list form
            parts = list(input.split(list(sizes)))
            return dist.reduce_scatter(output, parts, group=self.group, async_op=async_op) or _Done()
        return _reduce_scatter(output, input, group=self.group, async_op=async_op) or _Done()

    def reduce_scatter_widened(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        scratch: torch.Tensor | None = None,
        sizes: list[int] | None = None,
    ):
        """Collective over ``group``: output (float32, one partition) <- the sum over ranks of
        this rank's partition of input. Returns a handle; ``output`` is complete once it is
        waited on.

        The payload moves in ``input``'s lower precision (bf16, fp16). On gloo, whose
        reduce-scatter is an all-reduce (2(D-1)/D of the buffer sent per rank), it is an
        all-to-all ((D-1)/D) and the D received partitions are summed here in float32, in
        rank order, once the handle is waited on (two ranks send each other only the
        other's half; a rank's own part is read where it is). Other backends reduce-scatter
        in input's dtype (summing in it) and the result is widened on wait. ``scratch``, if
        given, is the receive buffer: ``widening_scratch_numel(input.numel(), sizes)`` elements
        of input's dtype, free once the handle is waited on; else one is allocated. ``sizes``:
        the partitions' lengths, in rank order (None: equal).
        """
        self.bytes_moved["reduce_scatter"] += input.numel() * input.element_size()
        if self.world_size == 1:
            output.copy_(input)
            return _Done()
        if scratch is None:
            scratch = torch.empty(self.widening_scratch_numel(input.numel(), sizes), dtype=input.dtype, device=input.device)
        if sizes is not None:
            work, parts = self._reduce_uneven_parts(scratch, input, list(sizes))
        elif self.backend == "gloo" and self.world_size == 2:
            halves = input.view(2, -1)
            work = self._swap_with_peer(scratch, halves[1 - self.rank], async_op=True)
            parts = [halves[0], scratch] if self.rank == 0 else [scratch, halves[1]]
        elif self.backend == "gloo":
            work = dist.all_to_all_single(scratch, input, group=self.group, async_op=True)
            parts = list(scratch.view(self.world_size, -1))
        else:
            work = _reduce_scatter(scratch, input, group=self.group, async_op=True)
            parts = [scratch]
        handle = _Widening(work, parts, output, scratch)
        if not async_op:
            handle.wait()
            return _Done()
        return handle

    def _reduce_uneven_parts(self, scratch: torch.Tensor, input: torch.Tensor, sizes: list[int]):
        """Start moving every rank's part of this rank's partition (of ``sizes``) into
        ``scratch``: on gloo all of them (an all-to-all), else their sum (a reduce-scatter
        in input's dtype). Returns the work and the parts to sum on wait."""
        mine = sizes[self.rank]
        if self.backend == "gloo":
            received = scratch[: self.world_size * mine]
            work = dist.all_to_all_single(
                received, input, output_split_sizes=[mine] * self.world_size, input_split_sizes=sizes, group=self.group, async_op=True
            )
            return work, list(received.view(self.world_size, mine))
        work = dist.reduce_scatter(scratch[:mine], list(input.split(sizes)), group=self.group, async_op=True)
        return work, [scratch[:mine]]

    def widening_scratch_numel(self, input_numel: int, sizes: list[int] | None = None) -> int:
        """Elements of the receive buffer ``reduce_scatter_widened`` needs for an input of
        ``input_numel``: all of it on gloo (every rank's part), one partition for two gloo
        ranks (the peer's part) and on other backends (the sum). With ``sizes``: every
        rank's part of this rank's partition on gloo, the partition elsewhere."""
        if self.world_size == 1:
            return 0
        if sizes is not None:
            mine = sizes[self.rank]
            return mine * self.world_size if self.backend == "gloo" else mine
        if self.backend == "gloo" and self.world_size > 2:
            return input_numel
        return input_numel // self.world_size

    def all_gather_into(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, sizes: list[int] | None = None
    ):
        """Collective over ``group``: output <- the concatenation of every rank's input (input
        may be this rank's slice of output; ``sizes``: every rank's input length, in rank
        order; None: equal). Returns a handle to ``wait()`` on.

        gloo's all-gather receives into a new flat tensor and copies it out: at 90 MB over
        four ranks, its first-touch page faults and the copy cost twice the time and three
        times the CPU of moving the same bytes in place (benchmarks/README.md, stop 42). So
        on gloo two ranks swap their inputs with one all-to-all that sends nothing to
        itself, and more ranks each broadcast their input into its place in output (the
        same bytes received per rank). Unequal inputs on other backends take the list form
        of all-gather, which sizes each rank's part."""
        self.bytes_moved["all_gather"] += output.numel() * output.element_size()
        if sizes is None and self.backend == "gloo" and self.world_size > 2:
            sizes = [output.numel() // self.world_size] * self.world_size
        if sizes is not None:
            return self._all_gather_parts(output, input, list(sizes), async_op)
        own = output.view(self.world_size, -1)[self.rank]
        swap = self.world_size == 2 and self.backend == "gloo"
        if (self.world_size == 1 or swap) and input.data_ptr() != own.data_ptr():
            own.copy_(input)
        if self.world_size == 1:
            return _Done()
        if swap:
            return self._swap_with_peer(output.view(2, -1)[1 - self.rank], own, async_op) or _Done()
        return _all_gather(output, input, group=self.group, async_op=async_op) or _Done()

    def _all_gather_parts(self, output: torch.Tensor, input: torch.Tensor, sizes: list[int], async_op: bool):
        """:meth:`all_gather_into` with each rank's part of ``output`` sized by ``sizes``: on
        gloo, one broadcast per rank with a nonempty part, straight into that part."""
        parts = list(output.split(sizes))
        own = parts[self.rank]
        if input.data_ptr() != own.data_ptr() or input.numel() != own.numel():
            own.copy_(input)
        if self.world_size == 1:
            return _Done()
        if self.backend != "gloo":
            return dist.all_gather(parts, own, group=self.group, async_op=async_op) or _Done()
        works = [
            dist.broadcast(part, src=self._global_rank(rank), group=self.group, async_op=True)
            for rank, part in enumerate(parts)
            if part.numel()
        ]
        handle = _AllDone(works)
        if not async_op:
            handle.wait()
            return _Done()
        return handle

    def _swap_with_peer(self, received: torch.Tensor, sent: torch.Tensor, async_op: bool):
        """Of two ranks: send ``sent`` to the peer and receive what it sends into ``received``
        (an all-to-all that sends nothing to itself). Returns the work, or None if sync."""
        splits = [0, 0]
        splits[1 - self.rank] = sent.numel()
        return dist.all_to_all_single(
            received, sent, output_split_sizes=splits, input_split_sizes=splits, group=self.group, async_op=async_op
        )

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Collective over ``group``: ``tensor`` <- its reduction over the ranks by ``op``
        ("sum", "max", "min", ...: a ``torch.distributed.ReduceOp`` name), in place; returns it.

        Raises:
            AttributeError: ``op`` names no ReduceOp.
        """
        self.bytes_moved["all_reduce"] += tensor.numel() * tensor.element_size()
        if self.world_size > 1:
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()), group=self.group)
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Collective over ``group``: every rank's ``tensor`` <- rank ``src``'s (a rank of this
        group, not a global rank), in place; returns it."""
        self.start_broadcast(tensor, src).wait()
        return tensor

    def start_broadcast(self, tensor: torch.Tensor, src: int):
        """:meth:`broadcast_`, started: returns a handle to ``wait()`` on before using
        ``tensor``. Broadcasts started one after another run back to back, so a few of them
        cost about one round trip, not one each."""
        self.bytes_moved["broadcast"] += tensor.numel() * tensor.element_size()
        if self.world_size == 1:
            return _Done()
        return dist.broadcast(tensor, src=self._global_rank(src), group=self.group, async_op=True)

    def all_gather_object(self, value: Any) -> list[Any]:
        """Collective over ``group``: every rank's ``value`` (picklable), in rank order."""
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def barrier(self) -> None:
        """Collective over ``group``: returns once every rank of it has called it."""
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def checked(self, call: str, check: Callable[[], T]) -> T:
        """Collective: run ``check`` (the call's validation) on every rank and agree on it.

        Returns what ``check`` returned, or raises the same error on every rank when it
        raised on any rank (see ``agree``). ``call`` names the call and its arguments.
        """
        try:
            value, error = check(), None
        except Exception as err:  # noqa: BLE001 - agreed on, then raised on every rank
            value, error = None, err
        self.agree(call, error)
        return value  # type: ignore[return-value]

    def agree(self, call: str, error: Exception | None = None) -> None:
        """Collective: raise on every rank if ``error`` is set on any rank, or if the ranks
        describe their ``call`` differently (say, other parameter names).

        Every rank raises the same exception type (the failing rank's, if it is a common
        built-in error; else RuntimeError) with the same message, naming the first failing
        rank. Costs one all-reduce of three integers; a failure costs one all-gather more.
        Only collective methods outside the training step call it.

        Raises:
            CollectiveCallError: the all-reduce failed: the other ranks did not call ``call``
                (a rank called a collective method alone), in one line naming ``call``.
        """
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        fingerprint = zlib.crc32(call.encode())
        flags = torch.tensor([int(error is not None), fingerprint, -fingerprint], dtype=torch.int64)
        flags = flags.to(self._flag_device())
        try:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as err:  # gloo / NCCL: a peer closed its connection, or the group timed out
            raise CollectiveCallError(_not_joined(call, err)) from None
        failed, highest, lowest = (int(v) for v in flags.cpu())
        if not failed and highest == -lowest:
            return
        mine = None if error is None else (type(error).__name__, _error_text(error))
        reports = self.all_gather_object((call, mine))
        for rank, (their_call, report) in enumerate(reports):
            if report is not None:
                kind, text = report
                raise _AGREED_ERRORS.get(kind, RuntimeError)(f"{their_call} failed on rank {rank}: {text}") from error
        calls = "; ".join(f"rank {rank}: {their_call}" for rank, (their_call, _) in enumerate(reports))
        raise ValueError(f"the ranks made different collective calls ({calls})")

    def _flag_device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)
