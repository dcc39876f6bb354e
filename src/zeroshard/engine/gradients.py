"""Gradient reduction for stages 1 and 2.

Both stages take each parameter's gradient in a post-accumulate-grad hook, put it into a
flat buffer laid out like the parameters, and drop ``param.grad``. What differs is when
the reduce-scatter runs and what stays allocated:

* stage 1 adds it in fp32 to a full-size gradient buffer per group, kept across steps, and
  reduce-scatters that at the step (or when a reduced gradient is first asked for);
* stage 2 fills one bucket at a time and reduce-scatters each as soon as all its
  parameters have their gradient, while backward goes on; the bucket's buffers go back to
  a bounded pool (``bucket_pool``) once its partition has been added to the rank's fp32
  gradient partition, and the next bucket or the next backward takes them from there. A
  bucket buffer is not zero-filled: each parameter's gradient is written into it (a second
  one in the same backward is added), and at launch the padding and any parameter that got
  no gradient are zeroed.

Either way the result is ``partition_grads[g]``: this rank's partition of the sum over ranks
of the accumulated (loss-scaled) gradients divided by the world size.

Each group is reduced over its own shard group (``group_comms``): dense groups over all W
ranks, expert groups over the W / EP ranks holding the same experts. The divisor is W for
both: an expert's local gradient already sums the tokens of its whole EP group (the
all-to-all's backward brings them back), so the sum over its expert-DP group covers every
rank's tokens once, and dividing by W gives the gradient of the global mean loss.

The reduction dtype is chosen per group (``reduce_dtypes``). In float32 the summed fp32
gradient is divided by the world size afterwards, as always. In a lower precision (bf16,
fp16) each rank divides first, in fp32, then rounds once to that dtype: the values on the
wire are then no larger than the largest local gradient, so an fp16 reduction cannot
overflow where the gradients themselves did not (bf16 has fp32's range; dividing by D costs
it nothing but in the subnormals). Stage 1 rounds its fp32 local sum over micro-batches;
stage 2, which reduces every micro-batch, stages each bucket directly in that dtype (half
the bytes of an fp32 bucket) and adds the reduced partitions up in fp32. The sum over ranks
is widened to fp32 (``Collectives.reduce_scatter_widened``) before it is added in.

After ``zero_grad`` the partition is not zero-filled: its buckets are marked stale, and
a bucket's first reduction writes its sum straight into the partition (the reduce-scatter's
or the widening's output is the partition slice itself), saving a temporary and an addition
pass per bucket. Reading ``partition_grads`` from outside zero-fills what is still
stale first, so every reader and writer sees the gradient so far.

An owner group's buckets (``zeroshard.layout.owners``) are cut into slices of different
lengths, rank by rank, each holding whole matrices: each bucket is still one reduce-scatter,
whose parts are those lengths (``sizes``), so each matrix's gradient reaches its owner alone.

Buckets are reduced in a fixed order on every rank, so the collectives match even when
hooks fire in another order: the order backward usually completes them, latest-registered
parameters first. At most ``MAX_IN_FLIGHT`` bucket reductions are outstanding; launching
another first folds the oldest into the partition and returns its buffers to the pool, so
stage 2 never holds more than a few buckets of full-size gradient: what outlives a backward
is the gradient partition and the pool, whose size the layout, the bucket size and the
reduce dtypes fix (``MAX_IN_FLIGHT + 1`` of the largest bucket's reduction buffers at most).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd import Variable

from ..buffers import FlatParamBuffer
from ..comm import Collectives
from .bucket_pool import BufferPool

MAX_IN_FLIGHT = 2


@dataclass
class _BucketReduction:
    input: torch.Tensor  # the bucket's gradient, full size, in the reduce dtype
    output: torch.Tensor  # this rank's partition of it: a temporary, or the partition slice itself
    handle: object
    in_place: bool  # output is the partition slice, which held nothing: no addition to make
    pooled: list[torch.Tensor]  # buffers to give back to the pool once folded in


@dataclass
class GradientReducer:
    """Owns gradient memory and reduction for every flat buffer of an engine.

    It registers a post-accumulate-grad hook on every parameter at construction; at stage 2
    those hooks launch reduce-scatters during backward (collective over each group's shard
    group), at stage 1 :meth:`reduce` does.
    """

    buffers: list[FlatParamBuffer]
    comm: Collectives  # all W ranks: its world size divides every group's gradient
    stage: int
    param_positions: dict[str, int]  # each parameter's place in module registration order
    reduce_dtypes: list[torch.dtype] | None = None  # per group; None: float32 everywhere
    group_comms: list[Collectives] | None = None  # per group, its shard group; None: ``comm`` for all
    _grads: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        device = self.buffers[0].data.device
        if self.reduce_dtypes is None:
            self.reduce_dtypes = [torch.float32] * len(self.buffers)
        if self.group_comms is None:
            self.group_comms = [self.comm] * len(self.buffers)
        self._divisor = self.comm.world_size  # W, for expert groups too (see the module doc)
        self._widened = [dtype != torch.float32 for dtype in self.reduce_dtypes]
        self._slices = {key: self._slice_of(*key) for key in self._all_buckets()}  # (partition start, length)
        self._sizes = {key: self._sizes_of(*key) for key in self._all_buckets()}  # None: equal parts
        self._grads = [torch.zeros(b.group.partition_numel, dtype=torch.float32, device=device) for b in self.buffers]
        self._stale: set[tuple[int, int]] = set()  # buckets whose partition slice is stale, to be taken as zero
        # Stage 1: persistent full-size accumulators. Stage 2: bucket buffers made on demand.
        self._full: list[torch.Tensor | None] = [
            torch.zeros(b.group.numel, dtype=torch.float32, device=device) if self.stage == 1 else None for b in self.buffers
        ]
        self._pool = BufferPool(device, self._pool_budget() if self.stage == 2 else 0)
        self._staging: dict[tuple[int, int], torch.Tensor] = {}
        self._pending: dict[tuple[int, int], set[int]] = {}  # params of a staged bucket yet to report
        self._gaps = {key: self._gaps_of(*key) for key in self._all_buckets()}
        self._order = self._reduction_order()
        self._next_launch = 0
        self._in_flight: list[tuple[tuple[int, int], _BucketReduction]] = []
        self._callback_queued = False
        self._dirty = False  # stage 1: full buffers hold unreduced gradients
        self._hooks = []
        for group_index, buffer in enumerate(self.buffers):
            for slot, param in zip(buffer.group.params, buffer.params):
                self._hooks.append(param.register_post_accumulate_grad_hook(self._make_hook(group_index, slot.index)))

    @property
    def partition_grads(self) -> list[torch.Tensor]:
        """This rank's fp32 gradient partition per group; slices no reduction wrote since
        ``zero_grad`` are zero-filled first, so callers may read and write it freely."""
        for group_index, bucket_index in self._stale:
            self._partition_slice(group_index, bucket_index).zero_()
        self._stale.clear()
        return self._grads

    def _partition_slice(self, group_index: int, bucket_index: int) -> torch.Tensor:
        start, length = self._slices[(group_index, bucket_index)]
        return self._grads[group_index][start : start + length]

    def bucket_sizes(self, group_index: int, bucket_index: int) -> list[int] | None:
        """Every rank's slice length of an owner group's bucket, in rank order; None for an
        even group's (equal slices)."""
        return self._sizes[(group_index, bucket_index)]

    def _slice_of(self, group_index: int, bucket_index: int) -> tuple[int, int]:
        """(partition offset, length) of this rank's slice of the bucket."""
        rank = self.group_comms[group_index].rank
        begin, end, start = self.buffers[group_index].group.bucket_slice(bucket_index, rank)
        return start, end - begin

    def _sizes_of(self, group_index: int, bucket_index: int) -> list[int] | None:
        """Every rank's slice length of an owner group's bucket; None for an even group's."""
        group = self.buffers[group_index].group
        if not group.owner:
            return None
        slices = (group.bucket_slice(bucket_index, rank) for rank in range(group.world_size))
        return [end - begin for begin, end, _ in slices]

    def _reduction_order(self) -> list[tuple[int, int]]:
        """Buckets by the latest-registered parameter they hold, latest first: backward
        finishes the last layers first. Derived from the model alone, so every rank agrees."""

        def last_position(key: tuple[int, int]) -> tuple[int, int, int]:
            group = self.buffers[key[0]].group
            bucket = group.buckets[key[1]]
            members = group.params[bucket.first_param : bucket.first_param + bucket.num_params]
            return (max(self.param_positions[slot.name] for slot in members), key[0], key[1])

        return sorted(self._all_buckets(), key=last_position, reverse=True)

    def _all_buckets(self) -> list[tuple[int, int]]:
        return [(g, b) for g, buffer in enumerate(self.buffers) for b in range(len(buffer.group.buckets))]

    def _pool_budget(self) -> int:
        """Bytes the bucket pool may keep: the buffers of ``MAX_IN_FLIGHT`` reductions in
        flight and one bucket filling, each as large as the largest bucket's."""
        largest = 0
        for group_index, buffer in enumerate(self.buffers):
            itemsize = self.reduce_dtypes[group_index].itemsize
            comm = self.group_comms[group_index]
            for bucket in buffer.group.buckets:
                key = (group_index, bucket.index)
                scratch = comm.widening_scratch_numel(bucket.numel, self._sizes[key]) if self._widened[group_index] else 0
                largest = max(largest, itemsize * (bucket.numel + scratch) + 4 * self._slices[key][1])
        return (MAX_IN_FLIGHT + 1) * largest

    def _gaps_of(self, group_index: int, bucket_index: int) -> list[tuple[int, int]]:
        """The bucket's ranges outside every parameter (padding), relative to its start."""
        group = self.buffers[group_index].group
        bucket = group.buckets[bucket_index]
        gaps, position = [], bucket.start
        for slot in group.params[bucket.first_param : bucket.first_param + bucket.num_params]:
            if slot.offset > position:
                gaps.append((position - bucket.start, slot.offset - bucket.start))
            position = max(position, slot.end)
        if bucket.end > position:
            gaps.append((position - bucket.start, bucket.end - bucket.start))
        return gaps

    # ---- backward -------------------------------------------------------------------------

    def _make_hook(self, group_index: int, param_index: int):
        def hook(param: torch.Tensor) -> None:
            self._on_grad(group_index, param_index, param)

        return hook

    def _on_grad(self, group_index: int, param_index: int, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        buffer = self.buffers[group_index]
        slot = buffer.group.params[param_index]
        grad = param.grad.detach().reshape(-1)
        if self.stage == 1:
            self._full[group_index][slot.offset : slot.end].add_(grad)
            self._dirty = True
        else:
            key = (group_index, slot.bucket)
            staging = self._bucket_staging(key)
            start = slot.offset - buffer.group.buckets[slot.bucket].start
            target = staging[start : start + slot.numel]
            first = param_index in self._pending[key]  # else a second gradient for this bucket: add it
            if self._widened[group_index]:  # pre-divided and rounded once (see the module doc)
                torch.div(grad, self._divisor, out=target) if first else target.add_(grad / self._divisor)
            else:
                target.copy_(grad) if first else target.add_(grad)
            self._pending[key].discard(param_index)
            if not self._callback_queued:
                self._callback_queued = True
                Variable._execution_engine.queue_callback(self.finish_backward)
            self._launch_ready(force=False)
        param.grad = None

    def _bucket_staging(self, key: tuple[int, int]) -> torch.Tensor:
        """The bucket's staging buffer, uninitialised: each parameter's first gradient is
        written, not added, and what stays unwritten is zeroed at launch (``_zero_unwritten``)."""
        if key not in self._staging:
            group_index, bucket_index = key
            bucket = self.buffers[group_index].group.buckets[bucket_index]
            dtype = self.reduce_dtypes[group_index]
            self._staging[key] = self._pool.take(bucket.numel, dtype)
            self._pending[key] = set(range(bucket.first_param, bucket.first_param + bucket.num_params))
        return self._staging[key]

    def _zero_unwritten(self, key: tuple[int, int], staging: torch.Tensor, unreported: set[int]) -> None:
        """Zero the padding and the slots of parameters that got no gradient."""
        group = self.buffers[key[0]].group
        bucket_start = group.buckets[key[1]].start
        ranges = self._gaps[key] + [
            (group.params[i].offset - bucket_start, group.params[i].end - bucket_start) for i in unreported
        ]
        for begin, end in ranges:
            staging[begin:end].zero_()

    def _launch_ready(self, force: bool) -> None:
        """Reduce-scatter buckets in the fixed order, as far as they are complete (or all)."""
        while self._next_launch < len(self._order):
            key = self._order[self._next_launch]
            if not force and (key not in self._pending or self._pending[key]):
                return
            staging = self._bucket_staging(key)  # made here if no parameter of it got a gradient
            del self._staging[key]
            self._zero_unwritten(key, staging, self._pending.pop(key))
            self._retire_in_flight(keep=MAX_IN_FLIGHT - 1)
            self._in_flight.append((key, self._reduce_bucket(key, staging, pooled=True)))
            self._next_launch += 1

    def _retire_in_flight(self, keep: int) -> None:
        """Wait for the oldest reductions until ``keep`` remain; fold them in, give their
        buffers back to the pool."""
        while len(self._in_flight) > keep:
            key, reduction = self._in_flight.pop(0)
            reduction.handle.wait()
            self._accumulate(key, reduction)
            for buffer in reduction.pooled:
                self._pool.give(buffer)

    def _reduce_bucket(self, key: tuple[int, int], payload: torch.Tensor, pooled: bool) -> _BucketReduction:
        """Launch the reduce-scatter of one bucket's gradient, in fp32 or (already divided)
        in the reduce dtype. ``pooled`` (stage 2): the payload came from the pool, and the
        temporaries come from it too."""
        group_index = key[0]
        comm = self.group_comms[group_index]
        in_place = key in self._stale
        if in_place:  # the slice holds nothing yet: reduce straight into it
            self._stale.discard(key)
            output = self._partition_slice(*key)
        else:
            output = self._temporary(self._partition_slice(*key).numel(), torch.float32, pooled)
        borrowed = [payload] + ([] if in_place else [output])
        sizes = self._sizes[key]
        if self._widened[group_index]:
            scratch = self._temporary(comm.widening_scratch_numel(payload.numel(), sizes), payload.dtype, pooled)
            borrowed.append(scratch)
            handle = comm.reduce_scatter_widened(output, payload, async_op=True, scratch=scratch, sizes=sizes)
        else:
            handle = comm.reduce_scatter_sum(output, payload, async_op=True, sizes=sizes)
        return _BucketReduction(payload, output, handle, in_place, borrowed if pooled else [])

    def _temporary(self, numel: int, dtype: torch.dtype, pooled: bool) -> torch.Tensor:
        if pooled:
            return self._pool.take(numel, dtype)
        return torch.empty(numel, dtype=dtype, device=self._grads[0].device)

    def finish_backward(self) -> None:
        """Stage 2, end of a backward pass: reduce what is left and wait for everything.

        Collective over each group's shard group; autograd runs it at the end of every
        backward that produced a gradient, on every rank alike."""
        self._callback_queued = False
        self._launch_ready(force=True)
        self._retire_in_flight(keep=0)
        self._next_launch = 0

    def _accumulate(self, key: tuple[int, int], reduction: _BucketReduction) -> None:
        """Fold a finished reduction into the partition (the fp32 sum is divided here)."""
        reduced = reduction.output
        if not self._widened[key[0]]:
            reduced.div_(self._divisor)
        if not reduction.in_place:
            self._partition_slice(*key).add_(reduced)

    # ---- step side ------------------------------------------------------------------------

    def reduce(self) -> None:
        """Make ``partition_grads`` hold every gradient so far.

        Collective at stage 1 when gradients are pending (a reduce-scatter per bucket over its
        shard group): every rank calls it, and since the ranks run the same backward passes
        they agree on whether anything is pending. At stage 2 backward has reduced everything
        already: it does nothing."""
        if self.stage == 1:
            # Every rank runs the same backward passes, so this local flag agrees across ranks.
            if not self._dirty:
                return
            for group_index, buffer in enumerate(self.buffers):
                full = self._full[group_index]
                for bucket in buffer.group.buckets:
                    key = (group_index, bucket.index)
                    payload = self._stage1_payload(group_index, full[bucket.start : bucket.end])
                    self._retire_in_flight(keep=MAX_IN_FLIGHT - 1)
                    self._in_flight.append((key, self._reduce_bucket(key, payload, pooled=False)))
            self._retire_in_flight(keep=0)
            for full in self._full:
                full.zero_()
            self._dirty = False

    def _stage1_payload(self, group_index: int, local_sum: torch.Tensor) -> torch.Tensor:
        """The fp32 local sum itself, or it divided by the world size and rounded once."""
        if not self._widened[group_index]:
            return local_sum
        payload = torch.empty(local_sum.numel(), dtype=self.reduce_dtypes[group_index], device=local_sum.device)
        return torch.div(local_sum, self._divisor, out=payload)

    def zero_grad(self) -> None:
        """Not collective. Forget the gradients so far; the partition is zero-filled lazily
        (see the module doc)."""
        self._stale.update(self._all_buckets())
        if self.stage == 1 and self._dirty:  # clean full buffers are zero already (``reduce`` zeroes them)
            for full in self._full:
                full.zero_()
            self._dirty = False

    def held_tensors(self) -> list[torch.Tensor]:
        """Every gradient tensor the reducer holds right now (for memory checks)."""
        held = list(self._grads) + list(self._staging.values())
        for _, reduction in self._in_flight:
            temporary = [] if reduction.in_place else [reduction.output]
            held += [reduction.input, *temporary, *getattr(reduction.handle, "buffers", ())]
        return held + [t for t in self._full if t is not None] + self._pool.held()

    @property
    def pool_bytes(self) -> int:
        """Bytes the bucket pool keeps right now (part of ``held_tensors``)."""
        return self._pool.held_bytes

    def remove_hooks(self) -> None:
        """Unregister the parameters' gradient hooks: the reducer sees no more gradients."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
