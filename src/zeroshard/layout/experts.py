"""Expert parallelism on W ranks: which ranks share the experts, which hold the same ones.

The ranks form a grid of W / EP rows of EP ranks, ``rank = row * EP + column``:

* a rank's expert-parallel (EP) group is its row, EP consecutive ranks that between them
  hold every expert once and send each other tokens by all-to-all (consecutive, so the
  all-to-all stays inside a node, as in DeepSpeed and Megatron-core);
* its expert-data-parallel group is its column, the W / EP ranks ``column, column + EP, ...``
  that hold the same experts: expert state is sharded and expert gradients are reduced
  over it. A rank's place in its column is ``rank // EP``.

By default expert ``e`` of E lives on EP rank ``e // (E / EP)`` (:func:`contiguous_expert_map`);
any placement that gives every EP rank E / EP experts may be given instead
(:func:`~.stacks.check_expert_map`).
Pure integer arithmetic, like the rest of the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .specs import EXPERT_SHARD_GROUP, GroupSpec, ParamSpec
from .stacks import ExpertStack, check_expert_map


def contiguous_expert_map(num_experts: int, ep_size: int) -> tuple[tuple[int, ...], ...]:
    """The global expert ids each EP rank holds: ``E / EP`` consecutive ids per rank.

    Raises:
        ValueError: the counts are not positive integers, or ``ep_size`` does not divide ``num_experts``.
    """
    if not _positive_int(num_experts) or not _positive_int(ep_size) or num_experts % ep_size:
        raise ValueError(f"{num_experts!r} experts cannot be split evenly over {ep_size!r} expert-parallel ranks")
    local = num_experts // ep_size
    return tuple(tuple(range(ep_rank * local, (ep_rank + 1) * local)) for ep_rank in range(ep_size))


@dataclass(frozen=True)
class ExpertMesh:
    """W ranks as W / EP expert-parallel groups of EP ranks (see the module docstring).

    Raises:
        ValueError: at construction, when ``ep_size`` does not divide ``world_size``; in the
            per-rank queries, for a rank outside the world.
    """

    world_size: int
    ep_size: int

    def __post_init__(self) -> None:
        if not _positive_int(self.world_size) or not _positive_int(self.ep_size) or self.world_size % self.ep_size:
            raise ValueError(f"expert parallelism {self.ep_size!r} does not divide the world size {self.world_size!r}")

    @property
    def expert_dp_size(self) -> int:
        """Ranks holding the same experts: the size of an expert-data-parallel group."""
        return self.world_size // self.ep_size

    def ep_rank(self, rank: int) -> int:
        """The rank's place in its expert-parallel group; it holds that EP rank's experts."""
        self._check_rank(rank)
        return rank % self.ep_size

    def expert_dp_rank(self, rank: int) -> int:
        """The rank's place in its expert-data-parallel group (the rank an expert group's
        per-rank layout queries take)."""
        self._check_rank(rank)
        return rank // self.ep_size

    def ep_group(self, rank: int) -> tuple[int, ...]:
        """The ranks that exchange tokens with ``rank``, in EP-rank order."""
        return self.ep_groups()[self.expert_dp_rank(rank)]

    def expert_dp_group(self, rank: int) -> tuple[int, ...]:
        """The ranks that hold the same experts as ``rank``, in expert-DP-rank order."""
        return self.expert_dp_groups()[self.ep_rank(rank)]

    def ep_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every expert-parallel group, the one of ranks 0..EP-1 first."""
        return tuple(tuple(range(row * self.ep_size, (row + 1) * self.ep_size)) for row in range(self.expert_dp_size))

    def expert_dp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every expert-data-parallel group, the one of EP rank 0 first."""
        return tuple(tuple(range(column, self.world_size, self.ep_size)) for column in range(self.ep_size))

    def expert_group(
        self,
        params: Sequence[ParamSpec],
        num_experts: int,
        shard_group: str = EXPERT_SHARD_GROUP,
        *,
        expert_map: Sequence[Sequence[int]] | None = None,
        stacks: Sequence[ExpertStack] = (),
        owner: bool = False,
    ) -> GroupSpec:
        """A layout group of stacked expert weights (first dimension E / EP), partitioned
        over the expert-data-parallel group. ``expert_map``: the placement (default the
        contiguous one), checked to spread ``num_experts`` over this mesh's EP ranks;
        ``stacks``: one description per parameter (default ``LEGACY_STACK``); ``owner``:
        every expert matrix whole in one rank's partition (:mod:`~.owners`).

        Raises:
            ValueError: the placement is malformed or does not fit the mesh and ``num_experts``.
        """
        if expert_map is None:
            placement = contiguous_expert_map(num_experts, self.ep_size)
        else:
            placement = check_expert_map(expert_map)
            held = sum(len(experts) for experts in placement)
            if len(placement) != self.ep_size or held != num_experts:
                raise ValueError(
                    f"the expert map places {held} experts on {len(placement)} expert-parallel ranks; "
                    f"this mesh has {num_experts} experts on {self.ep_size}"
                )
        return GroupSpec(tuple(params), shard_group, self.expert_dp_size, placement, tuple(stacks), owner)

    def _check_rank(self, rank: int) -> None:
        if not (isinstance(rank, int) and 0 <= rank < self.world_size):
            raise ValueError(f"rank {rank!r} is outside world size {self.world_size}")


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
