"""Rows that land while the GEMM reading them already runs.

A copy-engine all-gather (:class:`ep_moe.copy_engine.CopyEngineGather`) fills its output
source by source, in a fixed landing order (the rank's own rows first, then the next
ranks'), and raises a flag in device memory after each source. A grouped GEMM that reads
those rows need not wait for the whole transfer: its tiles of the first source run at once,
and each later tile waits on the device, in the kernel, only until its own source has
landed (``_grouped_rows_kernel`` with ``NUM_SOURCES > 1``). For that the rows of each expert
are sorted by source in landing order (:func:`ep_moe.gathered.gathered_routing`), and the
kernel walks the tiles source by source.

A pending transfer is registered for the tensor it fills, for the span in which the
GEMMs that read it are queued (:func:`rows_arriving`); :func:`~ep_moe.kernels.grouped_gemm.launch_rows`
looks its operand up here. Any other reader must come after a stream wait for the whole
transfer (the exchange's ``PendingExchange.wait``). Everything the waiting kernel depends
on (the copies, the flag writes) must be issued before the kernel: streams may share a
hardware queue, and a kernel spinning for work queued behind it would never end.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

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
    if arrival is None:
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
    entry = _ARRIVING.get(rows.data_ptr()) if _ARRIVING else None
    if entry is None:
        return None
    entry[1] = True
    return entry[0]
