"""What every expert-parallel path shares: the :class:`Dispatcher` steps the layer calls,
the :class:`Exchange` protocol the expert pipeline drives, pending collectives, and small
helpers of the exchanges (the collectives other floors share too are in
:mod:`ep_moe.distributed`).

A dispatcher is one path (``MoEConfig.dispatch``, chosen once in
:func:`ep_moe.ep.build_dispatcher`). :class:`ep_moe.MoELayer` calls its steps in order::

    dispatcher.start(num_tokens, device)                # before the router (a check travels under it)
    routed = dispatcher.dispatch(x_TH, router, keep_TK, backend)   # the tokens leave
    out = dispatcher.experts(routed, experts)           # the local experts (at EP>1, the rows back too)
    y_TH = dispatcher.combine(routed, out)              # one [T, H] row per token

The shared experts run between ``dispatch`` and ``experts``, while the rows travel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ep_moe.kernels.arrival import Landing
from ep_moe.kernels.grouped_gemm import eager_or_graph_break
from ep_moe.routing import RouterOutput

if TYPE_CHECKING:
    from ep_moe.experts import GroupedExperts


def refuse_double_backward() -> None:
    """At the start of the backward of the EP exchanges' autograd functions: raise where the
    backward builds a graph of itself (``create_graph=True``, grad mode on), which their
    backward would not differentiate again (a second backward would miss the expert
    weights' terms without a word). Every rank of the group runs the same backward, so each
    raises here, before any collective of it."""
    if torch.is_grad_enabled():
        raise RuntimeError("double backward (create_graph=True) through an ep_moe MoE layer is not supported at "
                           "EP>1 (the expert-parallel exchanges' backward is not differentiable again); run the "
                           "gradient penalty on a layer at EP=1 with MoEConfig(backend='torch')")


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


class PendingExchange:
    """An exchange in flight: :meth:`wait` returns its output once the current stream
    may use it (NCCL or copy engines: a stream wait, the host does not block; gloo:
    blocks). ``work``: the collective's handle; ``event``: recorded after its copies;
    ``landing``: how its rows land source by source, for GEMMs that read them while they
    land (:mod:`ep_moe.kernels.arrival`; then :meth:`landing_rows` gives the output before
    the wait)."""

    def __init__(self, out: torch.Tensor, work: Optional[dist.Work] = None,
                 event: Optional[torch.cuda.Event] = None, landing: Optional[Landing] = None) -> None:
        self._out, self._work, self._event = out, work, event
        self.landing = landing

    def landing_rows(self) -> torch.Tensor:
        """The output while it lands: only GEMMs that wait for its sources
        (:func:`ep_moe.kernels.arrival.rows_arriving`) may read it before :meth:`wait`."""
        if self.landing is None:
            raise RuntimeError("this exchange's rows do not land source by source; use wait()")
        return self._out

    @eager_or_graph_break  # a stream wait: eager under torch.compile
    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._event is not None:
            torch.cuda.current_stream(self._out.device).wait_event(self._event)
            self._event = None
        return self._out


class Exchange(Protocol):
    """The collectives of one layer call: the all-to-alls of
    :class:`ep_moe.ep.all_to_all.NcclExchange`, or the all-gather / reduce-scatter of
    :class:`ep_moe.ep.all_gather.GatherExchange` and :class:`ep_moe.ep.copy_engine.CopyEngineGather`.
    ``kind`` names the message (``"rows"``, ``"weights"``, ``"ids"``)."""

    uses_sms: bool
    """Whether the exchange's transfers run as kernels that need SMs (NCCL)."""

    def dispatch(self, x: torch.Tensor, kind: str) -> PendingExchange: ...
    def combine(self, x: torch.Tensor, kind: str) -> PendingExchange: ...
    # Optional: ``departing(like) -> context manager`` around the expert function (output like
    # ``like``), when the exchange sends the forward's output while the experts still produce it
    # (:class:`ep_moe.ep.copy_engine.CopyEngineGather`).


class Dispatcher:
    """One path from a layer's tokens to its experts and back (module docstring). Built
    once per layer (and again when its EP group changes) with the layer's config, its EP
    group, this rank's place in it, and the number of local experts."""

    def __init__(self, config, group: Optional[ProcessGroup], rank: int, size: int, num_local: int) -> None:
        self.config, self.group, self.rank, self.size, self.num_local = config, group, rank, size, num_local

    @property
    def fp8_rows(self) -> bool:
        """Whether the tokens travel in e4m3 (FP8 experts, :mod:`ep_moe.ep.fp8_wire`)."""
        return self.config.expert_precision == "fp8"

    def start(self, num_tokens: int, device: torch.device) -> None:
        """Before the router: nothing, unless the path checks something under it."""

    def dispatch(self, x_TH: torch.Tensor, router: RouterOutput, keep_TK: Optional[torch.Tensor],
                 backend: str) -> Any:
        """Route the tokens ``x_TH`` (in the compute dtype) and start sending them to their
        experts; returns what :meth:`experts` and :meth:`combine` take."""
        raise NotImplementedError

    def experts(self, routed: Any, experts: "GroupedExperts") -> torch.Tensor:
        """The local experts on what :meth:`dispatch` routed (at EP>1, the rows back too)."""
        raise NotImplementedError

    def combine(self, routed: Any, out: torch.Tensor) -> torch.Tensor:
        """Each token's rows from :meth:`experts` summed: [T, H]."""
        raise NotImplementedError

    def num_dropped(self, routed: Any) -> Optional[torch.Tensor]:
        """Slots the path itself dropped (not the capacity), a 0-dim int64 tensor, or None."""
        return None
