"""Expert parallelism: how a layer's tokens reach its experts and come back.

One dispatcher per path (:class:`~ep_moe.ep.base.Dispatcher`), chosen once by
:func:`build_dispatcher` from ``MoEConfig.dispatch`` and the EP group:

- :class:`~ep_moe.ep.local.LocalDispatcher`: EP=1, nothing travels;
- :class:`~ep_moe.ep.all_to_all.AllToAllDispatcher`: ``"all_to_all"`` (the default);
- :class:`~ep_moe.ep.all_gather.AllGatherDispatcher`: ``"all_gather"``;
- :class:`~ep_moe.ep.copy_engine.AllGatherCopyEngineDispatcher`: ``"all_gather_copy_engine"``.

Every EP>1 path runs its experts through :func:`ep_moe.ep.pipeline.expert_pipeline`.
"""

from __future__ import annotations

from typing import Optional

from torch.distributed import ProcessGroup

from ep_moe.ep.all_gather import AllGatherDispatcher
from ep_moe.ep.all_to_all import AllToAllDispatcher
from ep_moe.ep.base import Dispatcher
from ep_moe.ep.copy_engine import AllGatherCopyEngineDispatcher
from ep_moe.ep.local import LocalDispatcher

_DISPATCHERS: dict[str, type[Dispatcher]] = {
    "all_to_all": AllToAllDispatcher,
    "all_gather": AllGatherDispatcher,
    "all_gather_copy_engine": AllGatherCopyEngineDispatcher,
}


def build_dispatcher(config, group: Optional[ProcessGroup], rank: int, size: int, num_local: int) -> Dispatcher:
    """The dispatcher of a layer with ``config`` on ``group`` (``size`` ranks, this one
    ``rank``, ``num_local`` experts each): :class:`LocalDispatcher` at EP=1, else the one
    ``config.dispatch`` names."""
    cls = LocalDispatcher if size == 1 else _DISPATCHERS[config.dispatch]
    return cls(config, group, rank, size, num_local)


__all__ = ["Dispatcher", "build_dispatcher"]
