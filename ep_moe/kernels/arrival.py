"""Rows that land while the GEMM reading them already runs, and token sums that leave while
the GEMM producing them still runs.

A copy-engine all-gather (:class:`ep_moe.ep.copy_engine.CopyEngineGather`) fills its output
source by source, in a fixed landing order (the rank's own rows first, then the next
ranks'), and raises a flag in device memory after each source. A grouped GEMM that reads
those rows need not wait for the whole transfer: its tiles of the first source run at once,
and each later tile waits on the device, in the kernel, only until its own source has
landed (``_grouped_rows_kernel`` with ``ARRIVAL``). For that the rows of each expert
are sorted by source in landing order (:func:`ep_moe.ep.all_gather.gathered_routing`), and the
kernel walks the tiles source by source.

A pending transfer is registered for the tensor it fills, for the span in which the
GEMMs that read it are queued (:func:`rows_arriving`); :func:`~ep_moe.kernels.grouped_gemm.launch_rows`
looks its operand up here. Any other reader must come after a stream wait for the whole
transfer (the exchange's ``PendingExchange.wait``). Everything the waiting kernel depends
on (the copies, the flag writes) must be issued before the kernel: streams may share a
hardware queue, and a kernel spinning for work queued behind it would never end.

The other way round (:class:`Departure`, :func:`rows_departing`): the down projection of the
all-gather dispatch produces partial sums for every token of the group, which a reduce-scatter
sends back. Computed source by source (the peers' tokens first, the rank's own last), each
source's sums can leave for their rank while the GEMM computes the next source's
(:func:`~ep_moe.kernels.ops.grouped_gemm_slot_sum` with a departure registered; the exchange,
:class:`ep_moe.ep.copy_engine.CopyEngineGather`, hands each source's sums to the copy engines).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch


@dataclass(frozen=True)
class Landing:
    """How one transfer's rows land: ``flag`` (int32 [1], device memory) reaches ``base + w``
    once the ``w``-th of ``num_sources`` sources in landing order has landed (w >= 1;
    source 0 is there before any reader is queued). Values are 32-bit and compared modulo
    2**32, as the driver's stream waits do: ``base`` may grow past 2**32."""

    flag: torch.Tensor
    base: int
    num_sources: int


@dataclass(frozen=True)
class RowArrival:
    """A landing transfer and the routing of the GEMM reading it: ``source_ends`` [E,
    num_sources] int32, of each expert's rows (sorted by source in landing order) how many
    come from sources 0..w; the last column is the expert's row count."""

    landing: Landing
    source_ends: torch.Tensor

    @property
    def num_sources(self) -> int:
        return self.landing.num_sources


_ARRIVING: dict[int, list] = {}  # address of the rows -> [RowArrival, read by a launch]


@contextlib.contextmanager
def rows_arriving(rows: torch.Tensor, arrival: Optional[RowArrival], must_be_read: bool = False) -> Iterator[None]:
    """Inside the block, grouped GEMMs whose row operand is ``rows`` (its storage, by
    address) wait tile by tile for the rows' sources (``arrival``; None: nothing to do).
    The first reader of ``rows`` in the block must be such a GEMM. ``must_be_read``: raise
    if none read them (a sign that something else, a cast or a copy, read them first)."""
    if arrival is None or rows.numel() == 0:  # nothing lands (and every empty tensor has address 0)
        yield
        return
    key = rows.data_ptr()
    entry = _ARRIVING[key] = [arrival, False]
    try:
        yield
    finally:
        del _ARRIVING[key]
    if must_be_read and not entry[1]:
        raise RuntimeError("rows still landing were not read by a grouped GEMM waiting for them; the GEMM "
                           "must be the first reader of the exchanged rows (no cast or copy before it)")


def arrival_of(rows: torch.Tensor) -> Optional[RowArrival]:
    """The pending arrival registered for ``rows``, if any (marks it read)."""
    entry = _ARRIVING.get(rows.data_ptr()) if _ARRIVING and rows.numel() else None
    if entry is None:
        return None
    entry[1] = True
    return entry[0]


@dataclass(eq=False)
class Departure:
    """Where the token sums of a down projection go, source by source: ``out`` [P*T, H] (the
    sums of source rank q's tokens at rows q*T..), computed in ``order`` (landing positions:
    position w holds rank ``(first_source + w) % P``); :meth:`send` is called right after
    position w's sums are queued on the current stream and hands them to ``on_sent``.
    ``used`` tells whether a GEMM produced them (else the exchange sends a finished output
    as a whole)."""

    out: torch.Tensor
    order: tuple[int, ...]
    first_source: int
    on_sent: Callable[[int], None]
    used: bool = False
    positions_sent: list[int] = field(default_factory=list)

    @property
    def num_sources(self) -> int:
        return len(self.order)

    @property
    def complete(self) -> bool:
        """Whether every position's sums have been sent."""
        return len(self.positions_sent) == self.num_sources

    def tokens(self, position: int) -> slice:
        """The token rows of landing position ``position`` in ``out``."""
        per_source = self.out.shape[0] // self.num_sources
        source = (self.first_source + position) % self.num_sources
        return slice(source * per_source, (source + 1) * per_source)

    def send(self, position: int) -> None:
        """Position ``position``'s sums are queued: hand them on."""
        self.positions_sent.append(position)
        self.on_sent(position)


_DEPARTING = threading.local()  # .pending: this thread's registered departures


@contextlib.contextmanager
def rows_departing(departure: Optional[Departure]) -> Iterator[None]:
    """Inside the block, the first slot-summing down projection
    (:func:`~ep_moe.kernels.ops.grouped_gemm_slot_sum`) produces its sums as ``departure``
    says (None: nothing to do)."""
    if departure is None:
        yield
        return
    pending = _DEPARTING.__dict__.setdefault("pending", [])
    pending.append(departure)
    try:
        yield
    finally:
        pending.remove(departure)


def take_departure() -> Optional[Departure]:
    """The departure registered and not yet used, if any (marks it used)."""
    for departure in getattr(_DEPARTING, "pending", ()):
        if not departure.used:
            departure.used = True
            return departure
    return None
