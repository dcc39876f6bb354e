"""The torch.distributed groups of expert parallelism, from ExpertMesh's rank arithmetic.

Every rank creates every group, in the same order (EP groups, then expert-data-parallel
groups), as ``new_group`` requires, and keeps the two it belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..layout import ExpertMesh


@dataclass
class ExpertGroups:
    """This rank's expert-parallel and expert-data-parallel process groups."""

    mesh: ExpertMesh
    rank: int  # in the default group
    ep: dist.ProcessGroup  # the EP ranks this one exchanges tokens with
    expert_dp: dist.ProcessGroup  # the ranks holding the same experts

    @property
    def ep_rank(self) -> int:
        """This rank's place in its EP group: whose experts it holds."""
        return self.mesh.ep_rank(self.rank)

    @property
    def expert_dp_rank(self) -> int:
        """This rank's place in its expert-data-parallel group."""
        return self.mesh.expert_dp_rank(self.rank)


def new_expert_groups(ep_size: int, *, backend: str | None = None) -> ExpertGroups:
    """Create the EP x DP groups on the default process group.

    Collective over the default group: every rank calls it with the same ``ep_size`` (each
    rank creates every group, as ``new_group`` requires) and keeps the two it belongs to.

    Raises:
        ValueError: ``ep_size`` does not divide the world size, checked on every rank alike
            before any group is created (so it raises everywhere instead of leaving some
            ranks waiting); or (torch's) the default process group is not initialised.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = ExpertMesh(world_size, ep_size)
    ep, _ = dist.new_subgroups_by_enumeration([list(ranks) for ranks in mesh.ep_groups()], backend=backend)
    expert_dp, _ = dist.new_subgroups_by_enumeration([list(ranks) for ranks in mesh.expert_dp_groups()], backend=backend)
    return ExpertGroups(mesh, rank, ep, expert_dp)
