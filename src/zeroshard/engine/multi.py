"""Several torch optimizers stepped as one (Muon for the matrices, AdamW for the rest).

A ZeroOptimizer whose param groups name more than one optimizer class (the ``"optimizer"``
key of a group) builds one torch optimizer per class and wraps them in a
:class:`MultiOptimizer`, which is what ``engine.optimizer`` then is: its ``param_groups``
are the inner optimizers' group dicts in the user's order (an lr scheduler that changes
one changes the inner optimizer's), ``state`` reads and writes through to the optimizer
that owns each parameter, ``state_dict`` is torch's form over all of them, and
``load_state_dict`` hands each optimizer its own part.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import torch


def class_name(optimizer_class: type) -> str:
    """``module.QualName``, as shards and checkpoints record optimizer classes."""
    return f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"


class _States(MutableMapping):
    """The inner optimizers' ``state``, keyed by parameter, each entry in its owner's."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], owner: dict[int, int]) -> None:
        self._optimizers = optimizers
        self._owner = owner  # id(param) -> index of the optimizer holding it

    def _state_of(self, param: Any) -> Any:
        return self._optimizers[self._owner[id(param)]].state

    def __getitem__(self, param: Any) -> Any:
        return self._state_of(param)[param]

    def __setitem__(self, param: Any, value: Any) -> None:
        self._state_of(param)[param] = value

    def __delitem__(self, param: Any) -> None:
        del self._state_of(param)[param]

    def __contains__(self, param: object) -> bool:
        return id(param) in self._owner and param in self._state_of(param)

    def get(self, param: Any, default: Any = None) -> Any:
        return self[param] if param in self else default

    def __iter__(self) -> Iterator[Any]:
        for optimizer in self._optimizers:
            yield from optimizer.state

    def __len__(self) -> int:
        return sum(len(optimizer.state) for optimizer in self._optimizers)

    def clear(self) -> None:
        for optimizer in self._optimizers:
            optimizer.state.clear()


class MultiOptimizer(torch.optim.Optimizer):
    """Torch optimizers over disjoint param groups, as one optimizer.

    Args:
        optimizers: the inner optimizers.
        order: for each param group of the whole, in order, (optimizer index, group index
            within that optimizer); every group of every optimizer once.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer], order: list[tuple[int, int]]) -> None:
        self.optimizers = optimizers
        self._order = order
        self._states = _States(optimizers, {})
        groups = [optimizers[o].param_groups[g] for o, g in order]
        super().__init__(groups, {})  # no defaults: torch would write them into every group
        self.defaults = optimizers[0].defaults
        self._sync_groups()
        self._fixed = True

    def _sync_groups(self) -> None:
        """param_groups and state from the inner optimizers (after they replaced theirs)."""
        self.param_groups = [self.optimizers[o].param_groups[g] for o, g in self._order]
        owner = {id(p): o for o, g in self._order for p in self.optimizers[o].param_groups[g]["params"]}
        self._states = _States(self.optimizers, owner)

    @property
    def state(self) -> MutableMapping:  # type: ignore[override]
        """Every inner optimizer's state, by parameter."""
        return self._states

    @state.setter
    def state(self, state: Any) -> None:
        """Replace the state: each entry goes to the optimizer of its parameter (torch's
        ``__init__`` assigns an empty one)."""
        self._states.clear()
        for param, entry in dict(state).items():
            self._states[param] = entry

    @property
    def classes(self) -> list[str]:
        """The optimizer class of each param group, in order."""
        return [class_name(type(self.optimizers[o])) for o, _ in self._order]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused once built: each param group belongs to one inner optimizer.

        Raises:
            NotImplementedError: always, once built.
        """
        if getattr(self, "_fixed", False):
            raise NotImplementedError("a MultiOptimizer's param groups are fixed when it is built")
        super().add_param_group(param_group)  # torch's __init__ re-adding the inner groups

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """Step every inner optimizer (no closure)."""
        if closure is not None:
            raise ValueError("MultiOptimizer.step takes no closure")
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every inner optimizer's zero_grad."""
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Torch's form over all groups, each part loaded by its own optimizer.

        Raises:
            ValueError: another number of param groups (or torch's own refusals).
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self._order):
            raise ValueError(f"the state_dict has {len(groups)} param groups, this optimizer {len(self._order)}")
        parts: list[dict[str, Any]] = [{"state": {}, "param_groups": []} for _ in self.optimizers]
        counters = [0] * len(self.optimizers)
        for (o, _), group in zip(self._order, groups):
            renumbered = list(range(counters[o], counters[o] + len(group["params"])))
            counters[o] += len(group["params"])
            for old, new in zip(group["params"], renumbered):
                if old in state_dict["state"]:
                    parts[o]["state"][new] = state_dict["state"][old]
            parts[o]["param_groups"].append({**group, "params": renumbered})
        for optimizer, part in zip(self.optimizers, parts):
            optimizer.load_state_dict(part)
        self._sync_groups()


def build_optimizer(
    groups: list[dict[str, Any]], classes: list[type], default_class: type, defaults: dict[str, Any]
) -> torch.optim.Optimizer:
    """One torch optimizer per class over the param groups it trains (``classes[i]`` trains
    ``groups[i]``; ``defaults`` go to ``default_class``), in the order the groups first name
    the classes; several are stepped as one :class:`MultiOptimizer`."""
    distinct = list(dict.fromkeys(classes))
    optimizers = [
        cls([group for group, own in zip(groups, classes) if own is cls], **(defaults if cls is default_class else {}))
        for cls in distinct
    ]
    if len(optimizers) == 1:
        return optimizers[0]
    counters = [0] * len(distinct)
    order = []
    for cls in classes:
        which = distinct.index(cls)
        order.append((which, counters[which]))
        counters[which] += 1
    return MultiOptimizer(optimizers, order)
