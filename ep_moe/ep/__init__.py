"""Expert parallelism: how a layer's tokens reach its experts and come back.

One dispatcher per path (:class:`~ep_moe.ep.base.Dispatcher`), chosen once by
:func:`build_dispatcher` from ``MoEConfig.dispatch`` and the EP group:

- :class:`~ep_moe.ep.local.LocalDispatcher`: EP=1, nothing travels;
- :class:`~ep_moe.ep.all_to_all.AllToAllDispatcher`: ``"all_to_all"``;
- :class:`~ep_moe.ep.all_gather.AllGatherDispatcher`: ``"all_gather"``;
- :class:`~ep_moe.ep.copy_engine.AllGatherCopyEngineDispatcher`: ``"all_gather_copy_engine"``.

``"auto"`` (the default) picks the all-to-all or the all-gather (:func:`resolve_dispatch`).
Every EP>1 path runs its experts through :func:`ep_moe.ep.pipeline.expert_pipeline`.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch.distributed import ProcessGroup

from ep_moe.ep.all_gather import AllGatherDispatcher
from ep_moe.ep.all_to_all import AllToAllDispatcher
from ep_moe.ep.base import Dispatcher
from ep_moe.ep.copy_engine import AllGatherCopyEngineDispatcher
from ep_moe.ep.local import LocalDispatcher

AUTO_GATHER_MAX_WORST = 4
"""``dispatch="auto"`` picks the all-gather only where its activation buffers, sized for the
worst case, hold at most this many times the average routed rows of a rank."""

AUTO_GATHER_RANKS_PER_CHOICE = 2
"""...and only where ``ep_size <= AUTO_GATHER_RANKS_PER_CHOICE * top_k``: a token's experts can
then lie on half the ranks or more, so the all-gather sends at most about twice what the
all-to-all may, and it saves the all-to-all's host sync. Measured at EP=4, top-2 (4x H200):
the all-gather was faster for mixtral's layer (uniform and Zipf routing) and in a DeepSpeed
engine's training step."""

_DISPATCHERS: dict[str, type[Dispatcher]] = {
    "all_to_all": AllToAllDispatcher,
    "all_gather": AllGatherDispatcher,
    "all_gather_copy_engine": AllGatherCopyEngineDispatcher,
}


def resolve_dispatch(config, group: Optional[ProcessGroup], size: int) -> str:
    """The dispatch a layer with ``config`` runs on ``group`` (``size`` ranks): ``"local"``
    at EP=1 (nothing travels), ``config.dispatch`` unless it is ``"auto"``, and for
    ``"auto"`` the all-gather on an NCCL group where it moves about what the all-to-all
    would and its worst-case buffers stay small (``MoEConfig.dispatch`` says when), else
    the all-to-all. The same on every rank of the group."""
    if size == 1:
        return "local"
    if config.dispatch != "auto":
        return config.dispatch
    worst = size * min(config.top_k, config.num_experts // size) / config.top_k
    on_nccl = group is not None and "nccl" in str(dist.get_backend(group))
    small = size <= AUTO_GATHER_RANKS_PER_CHOICE * config.top_k and worst <= AUTO_GATHER_MAX_WORST
    return "all_gather" if on_nccl and small else "all_to_all"


def build_dispatcher(config, group: Optional[ProcessGroup], rank: int, size: int, num_local: int) -> Dispatcher:
    """The dispatcher of a layer with ``config`` on ``group`` (``size`` ranks, this one
    ``rank``, ``num_local`` experts each): the one :func:`resolve_dispatch` names."""
    dispatch = resolve_dispatch(config, group, size)
    cls = LocalDispatcher if dispatch == "local" else _DISPATCHERS[dispatch]
    return cls(config, group, rank, size, num_local)


__all__ = ["Dispatcher", "build_dispatcher", "resolve_dispatch"]
