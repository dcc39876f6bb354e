"""TorchOptimizerAPI: what makes a ZeroOptimizer a ``torch.optim.Optimizer`` to its callers.

Its one job is torch's surface over the wrapped optimizer: ``param_groups``, ``state`` and
``defaults`` read and assigned through to it (an lr scheduler that changes the engine's lr
changes the lr the wrapped optimizer uses); ``state_dict`` / ``load_state_dict`` of this
rank's shard with torch's state-dict hooks, the shard itself in torch's form being
:mod:`.shard_state`'s; and param groups fixed once the engine is built. ZeroOptimizer mixes
it in before ``torch.optim.Optimizer``, whose own methods it overrides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .shard_state import load_shard, shard_mismatch, shard_state_dict

if TYPE_CHECKING:
    from .parts import EngineParts as _Engine  # the parts the class mixing it in provides
else:
    _Engine = object


class TorchOptimizerAPI(_Engine):
    """Mixed into ZeroOptimizer (before ``torch.optim.Optimizer``); relies on its wrapped
    optimizer, masters, matrices, reducer and comm (:class:`~.parts.EngineParts`) and on
    torch's hook registries."""

    _groups_fixed: bool  # set by ZeroOptimizer: False while torch's __init__ adds the groups

    # The wrapped optimizer's, read and assigned through (its load_state_dict replaces them).

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups (lr schedulers change these)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> dict:
        """The wrapped optimizer's state: this rank's partitions only."""
        return self.optimizer.state

    @state.setter
    def state(self, state: dict) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's defaults (lr, betas, ...)."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: the wrapped optimizer's state_dict plus a ``"zero"`` entry.

        ``"state"`` and ``"param_groups"`` are torch's form over this rank's partitions;
        ``"zero"`` holds the fp32 master partitions, the step count, the loss scaler and
        what the shard belongs to (layout digest, world size, rank, optimizer class). As
        with torch optimizers the tensors are the live ones: copy the dict to keep a
        snapshot. State-dict pre and post hooks fire as in ``torch.optim.Optimizer``.
        It loads back only into the same rank of an engine with the same layout; to save
        once and load at another world size or layout use ``zeroshard.checkpoint``.
        Not collective.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = shard_state_dict(self)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Collective: every rank of ``process_group`` calls it with its own shard. Load what
        ``state_dict()`` gave on this rank of an identical engine.

        Every rank checks its own dict (after the load-state-dict pre hooks) and the ranks
        agree before anything changes. Afterwards the masters, optimizer state, step count
        and loss scale are the saved ones, the accumulated gradients are cleared and the
        model's parameters are the masters in their dtype (an all-gather per bucket).

        Raises:
            ValueError: on every rank, naming each failing rank, when any rank's dict is from
                another rank, layout, world size or optimizer, is malformed, or a pre hook
                raised; nothing changes then.
        """
        try:
            for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
                result = pre_hook(self, state_dict)
                if result is not None:
                    state_dict = result
        except Exception as error:  # a hook failing on one rank must not leave the others blocked
            problem = f"a load_state_dict pre hook raised {type(error).__name__}: {error}"
        else:
            problem = shard_mismatch(self, state_dict)
        self._raise_if_any_rank_failed(problem)
        load_shard(self, state_dict)
        self.matrices.clear()
        self.matrices.adopt(self.optimizer.state)
        self.matrices.agree(self.comm, self.master_device)
        self.reducer.zero_grad()
        self.sync_params_from_masters()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the param groups are fixed when the engine is built.

        Raises:
            NotImplementedError: always, once the engine is built.
        """
        if self._groups_fixed:
            raise NotImplementedError("a ZeroOptimizer's param groups are fixed when it is built")
        super().add_param_group(param_group)  # torch's __init__ re-adding the wrapped optimizer's groups

    def _raise_if_any_rank_failed(self, problem: str | None) -> None:
        """Collective: raise the same ValueError on every rank if any rank has a problem."""
        problems = self.comm.all_gather_object(problem)
        failed = [f"rank {rank}: {text}" for rank, text in enumerate(problems) if text is not None]
        if failed:
            raise ValueError(
                f"load_state_dict refused ({'; '.join(failed)}); a ZeroOptimizer state_dict loads only into the "
                "same rank of an identical engine: use zeroshard.checkpoint to change world size or layout"
            )
