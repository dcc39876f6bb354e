"""Per-parameter access to sharded state: the fp32 master, the gradient, optimizer state.

"Full" accessors are collective (every rank calls them with the same name): they
reassemble the parameter from the ranks that own its pieces, one broadcast per piece, so
a call moves the parameter's size, not a full-size buffer. Full setters take the same
value on every rank; each rank keeps its own piece, and the fp32 setter also updates the
model's parameter in place. "Local" accessors touch only this rank's piece of the
parameter (at most one contiguous run, since a parameter never spans buckets); local
setters leave the model's parameters to the next step or to ``sync_params_from_masters``.

A full accessor first checks its arguments on every rank and agrees on the outcome (one
small all-reduce, ``Collectives.checked``): a bad name, a missing optimizer state or a
value of the wrong size raises the same error on every rank, and ranks that asked for
different parameters all raise, instead of one rank raising while the others block.

For an expert parameter "full" means this rank's stacked experts: the pieces come from the
ranks of its expert-data-parallel group (and ``piece.rank`` is a rank within that group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .state_io import partition_state

if TYPE_CHECKING:
    from .parts import EngineParts as _Engine  # the parts the class mixing it in provides
else:
    _Engine = object


@dataclass
class LocalShard:
    """This rank's run of a parameter: elements [param_start, param_start + len(values))."""

    param_start: int
    values: torch.Tensor  # 1-D, fp32


class FragmentAccess(_Engine):
    """Mixed into ZeroOptimizer; relies on its layout, masters, optimizer, reducer and comm
    (:class:`~.parts.EngineParts`)."""

    # ---- full (collective) --------------------------------------------------------------
    # Each checks its arguments on every rank and agrees on the outcome before it moves any
    # data, so a bad call raises the same error on every rank and leaves no rank blocked.

    def get_full_fp32_param(self, name: str) -> torch.Tensor:
        """Collective: every rank calls it with the same ``name``. The parameter's fp32 master,
        whole, in its own shape, on every rank (a new tensor on the engine's device).

        Raises:
            KeyError, ValueError, TypeError: on every rank alike, for a bad call on any rank
                (unknown name); nothing moves then.
            CollectiveCallError: the other ranks did not call it.
        """
        self.comm.checked(f"get_full_fp32_param({name!r})", lambda: self.layout.param(name))
        return self._gather(name, self._master_of)

    def set_full_fp32_param(self, name: str, value: torch.Tensor) -> None:
        """Collective: every rank calls it with the same ``name`` and ``value``. Sets the
        parameter's fp32 master (each rank keeps its own piece) and the model's parameter, in
        its dtype, in place.

        Raises:
            KeyError, ValueError, TypeError: on every rank alike, for a bad call on any rank
                (unknown name, a value that is not a tensor of the parameter's size); nothing moves then.
            CollectiveCallError: the other ranks did not call it.
        """
        self._check_full_value(f"set_full_fp32_param({name!r})", name, value)
        self._scatter(name, value, self._master_of)
        group, slot = self.layout.param(name)
        with torch.no_grad():
            self.buffers[group.index].param_view(slot.index).copy_(value.reshape(slot.spec.shape))

    def get_full_grad(self, name: str) -> torch.Tensor:
        """Collective: every rank calls it with the same ``name``. The gradient the next
        step would use before clipping: reduced over the ranks, unscaled, fp32, whole.

        Raises:
            KeyError, ValueError, TypeError: on every rank alike, for a bad call on any rank
                (unknown name); nothing moves then.
            CollectiveCallError: the other ranks did not call it.
        """
        self.comm.checked(f"get_full_grad({name!r})", lambda: self.layout.param(name))
        self.reducer.reduce()
        return self._gather(name, self._grad_of) / self.scaler.scale

    def set_full_grad(self, name: str, value: torch.Tensor) -> None:
        """Collective: every rank calls it with the same ``name`` and ``value``. Replaces the
        reduced gradient the next step uses (unscaled; the loss scale is applied here).

        Raises:
            KeyError, ValueError, TypeError: on every rank alike, for a bad call on any rank
                (unknown name, a value of the wrong size); nothing moves then.
            CollectiveCallError: the other ranks did not call it.
        """
        self._check_full_value(f"set_full_grad({name!r})", name, value)
        self.reducer.reduce()
        self._scatter(name, value * self.scaler.scale, self._grad_of)

    def get_full_optimizer_state(self, name: str, key: str) -> torch.Tensor:
        """Collective: every rank calls it with the same ``name`` and ``key``. Optimizer
        state ``key`` (``"exp_avg"``, ``"exp_avg_sq"``, ...) of the parameter, whole, fp32.

        Raises:
            KeyError, ValueError, TypeError: on every rank alike, for a bad call on any rank
                (unknown name, a state the optimizer does not have (yet)); nothing moves then.
            CollectiveCallError: the other ranks did not call it.
        """
        self.comm.checked(f"get_full_optimizer_state({name!r}, {key!r})", lambda: self._state_source(name, key))
        return self._gather(name, lambda group_index: self._state_of(group_index, key))

    def set_full_optimizer_state(self, name: str, key: str, value: torch.Tensor) -> None:
        """Collective: every rank calls it with the same arguments. Sets optimizer state
        ``key`` of the parameter; each rank keeps its own piece.

        Raises:
            KeyError, ValueError, TypeError: on every rank alike, for a bad call on any rank
                (unknown name, a missing state, a value of the wrong size); nothing moves then.
            CollectiveCallError: the other ranks did not call it.
        """
        call = f"set_full_optimizer_state({name!r}, {key!r})"
        self._check_full_value(call, name, value, lambda: self._state_source(name, key))
        self._scatter(name, value, lambda group_index: self._state_of(group_index, key))

    def _check_full_value(self, call: str, name: str, value: torch.Tensor, source_check=None) -> None:
        """Every rank: the parameter exists, its source does, ``value`` is a tensor of its size."""

        def check() -> None:
            _, slot = self.layout.param(name)
            if source_check is not None:
                source_check()
            if not torch.is_tensor(value):
                raise TypeError(f"parameter {name!r}: the value must be a tensor, got {type(value).__name__}")
            if value.numel() != slot.numel:
                shapes = f"has shape {slot.spec.shape}, got a value of shape {tuple(value.shape)}"
                raise ValueError(f"parameter {name!r} {shapes}")

        self.comm.checked(call, check)

    def _state_source(self, name: str, key: str) -> None:
        """Raises, on every rank alike, unless optimizer state ``key`` of ``name``'s group is readable."""
        group, _ = self.layout.param(name)
        self._state_of(group.index, key)

    # ---- local ----------------------------------------------------------------------------

    def get_local_fp32_param(self, name: str) -> LocalShard | None:
        """Not collective. This rank's piece of the parameter's fp32 master (a copy), or None
        when this rank holds none of it.

        Raises:
            KeyError: no parameter of that name.
        """
        return self._local_get(name, self._master_of)

    def set_local_fp32_param(self, name: str, values: torch.Tensor) -> None:
        """Not collective. Set this rank's piece of the fp32 master (``values``: as many
        elements as :meth:`get_local_fp32_param` gives); the model's parameter follows at the
        next step or :meth:`sync_params_from_masters`.

        Raises:
            KeyError: no parameter of that name. ValueError: ``values`` has another size.
        """
        self._local_set(name, values, self._master_of)

    def get_local_grad(self, name: str) -> LocalShard | None:
        """This rank's piece of the reduced, unscaled gradient, or None. Collective when
        gradients are still being reduced (it finishes the reduction): call it on every rank.

        Raises:
            KeyError: no parameter of that name.
        """
        self.reducer.reduce()
        shard = self._local_get(name, self._grad_of)
        if shard is not None:
            shard.values.div_(self.scaler.scale)
        return shard

    def set_local_grad(self, name: str, values: torch.Tensor) -> None:
        """Set this rank's piece of the reduced gradient (unscaled). Collective when gradients
        are still being reduced (it finishes the reduction): call it on every rank.

        Raises:
            KeyError: no parameter of that name. ValueError: ``values`` has another size.
        """
        self.reducer.reduce()
        self._local_set(name, values * self.scaler.scale, self._grad_of)

    def get_local_optimizer_state(self, name: str, key: str) -> LocalShard | None:
        """Not collective. This rank's piece of optimizer state ``key`` of the parameter, or None.

        Raises:
            KeyError: no parameter of that name, or no such state (yet).
        """
        return self._local_get(name, lambda group_index: self._state_of(group_index, key))

    def set_local_optimizer_state(self, name: str, key: str, values: torch.Tensor) -> None:
        """Not collective. Set this rank's piece of optimizer state ``key`` of the parameter.

        Raises:
            KeyError: no parameter or state of that name. ValueError: ``values`` has another size.
        """
        self._local_set(name, values, lambda group_index: self._state_of(group_index, key))

    # ---- sources --------------------------------------------------------------------------

    def _master_of(self, group_index: int) -> torch.Tensor:
        return self.masters[group_index].data

    def _grad_of(self, group_index: int) -> torch.Tensor:
        return self.reducer.partition_grads[group_index]

    def _state_of(self, group_index: int, key: str) -> torch.Tensor:
        states, scalars = partition_state(self, group_index)
        tensor = states.get(key)
        if tensor is None and key in scalars:
            shape = tuple(scalars[key].shape)
            raise KeyError(f"optimizer state {key!r} is not partition-shaped (shape {shape}); read it from engine.optimizer.state")
        if tensor is None:
            raise KeyError(f"optimizer has no state {key!r} (yet) for group {group_index}; it has {sorted({**states, **scalars})}")
        return tensor

    # ---- mechanics ------------------------------------------------------------------------

    def _gather(self, name: str, source) -> torch.Tensor:
        group, slot = self.layout.param(name)
        full = torch.empty(slot.numel, dtype=torch.float32, device=self.device)
        comm = self.group_comms[group.index]
        for piece in group.pieces(slot.index):
            target = full[piece.param_start : piece.param_start + piece.length]
            if piece.rank == comm.rank:
                local = source(group.index)[piece.partition_start : piece.partition_start + piece.length]
                target.copy_(local)
            comm.broadcast_(target, src=piece.rank)
        return full.view(slot.spec.shape)

    def _scatter(self, name: str, value: torch.Tensor, source) -> None:
        """This rank keeps its piece of ``value`` (checked by ``_check_full_value``)."""
        group, piece = self._own_piece(name)
        if piece is not None:
            flat = value.detach().reshape(-1)[piece.param_start : piece.param_start + piece.length]
            source(group.index)[piece.partition_start : piece.partition_start + piece.length].copy_(flat)

    def _own_piece(self, name: str):
        """This rank's run of the parameter (at most one), or None."""
        group, slot = self.layout.param(name)
        rank = self.rank_in(group)
        return group, next((p for p in group.pieces(slot.index) if p.rank == rank), None)

    def _local_get(self, name: str, source) -> LocalShard | None:
        group, piece = self._own_piece(name)
        if piece is None:
            return None
        values = source(group.index)[piece.partition_start : piece.partition_start + piece.length]
        return LocalShard(piece.param_start, values.clone())

    def _local_set(self, name: str, values: torch.Tensor, source) -> None:
        group, piece = self._own_piece(name)
        length = 0 if piece is None else piece.length
        if values.numel() != length:
            raise ValueError(f"parameter {name!r}: rank {self.rank} holds {length} of its elements, got {values.numel()}")
        if piece is not None:
            source(group.index)[piece.partition_start : piece.partition_start + length].copy_(values.reshape(-1))
