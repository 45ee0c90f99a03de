"""All-to-all between the GPUs of one node on the copy engines, through symmetric memory.

Why: NCCL's all-to-all runs as kernels, which need SMs. While a persistent grouped GEMM
holds every SM those kernels hardly progress (``benchmarks/bench_a2a_overlap.py`` on 4x
H200: 10% of a qwen3-sized dispatch hidden behind the experts' forward, none behind the
dW GEMMs); GEMMs launched one program per tile let NCCL in (about 60% hidden behind dW),
at some cost to the GEMMs. A ``cudaMemcpy`` between GPU memories over NVLink runs on the
copy engines instead, with no SM (304 GB/s against NCCL's 281 for the bare copies in one
run; 150 GB/s with this module's staging copy), and 30 to 94% of it hid behind the
experts' work.

How: every rank of the EP group holds one :class:`SymmetricWorkspace`, a buffer in
symmetric memory that every peer can address, and a stream for its copies. An all-to-all
is pulled:

1. the sender stages the rows it sends in its own workspace, in its region for the
   (direction, message, chunk) of the exchange, and raises its *ready* flag in every
   peer's workspace;
2. each receiver waits for a source's ready flag, copies its segment out of that
   source's workspace into a fresh tensor (``copy_`` over NVLink: the copy engines), and
   when it has pulled from everyone raises its *done* flag in every peer's workspace.

The flags are 32-bit words written and awaited with CUDA stream memory operations
(``cuStreamWriteValue32`` / ``cuStreamWaitValue32``), which the GPU's front end runs: no
SM is needed anywhere, so nothing waits for a GEMM to give one back. (A barrier kernel,
symmetric memory's own, needs an SM; with the GEMMs holding them all, one per exchange
made the layer up to 3.7x slower than NCCL in the first measurement.) The all-to-all's
flag values are the exchange's sequence number, the same on every rank, so a flag only
ever grows.

Every rank holds the row counts of every rank (:class:`CopyEngineExchange`'s matrices),
so it knows where in a peer's workspace its rows lie, and all ranks size the workspace
alike. A session (one forward or one backward of a layer's pipeline) stages each region
at most once and starts by waiting for every peer's done flag of the previous session:
no rank restages a region before every peer has pulled from it.

The all-gather (:class:`CopyEngineGather`) is captured in CUDA graphs, whose replays
cannot count on the host, so its handshake holds no sequence number: each flag is 0 or 1
and whoever waits for it takes it back. Per chunk region, in the stager's workspace, one
*free* flag per peer (1: that peer has pulled the region's last rows; 1 at the start):
the stager's compute stream waits for all of them and clears them before it stages
(claims the region). In each puller's workspace one *staged* flag per source, which the
puller's copy stream waits for and clears before it copies; after the copy it sets its
free flag in the source's workspace. The landing flags that the experts' GEMM polls
(:mod:`ep_moe.kernels.arrival`) are one per chunk in the rank's own workspace, cleared on
the compute stream before the pulls are queued and raised to w after the w-th source.
The forward's reduce-scatter is pushed instead: each rank has, per chunk, an *inbox* of
P-1 slots for the peers' token sums. Before a push the sender's copy stream waits for its
*inbox-free* flag for that receiver (in the sender's workspace, 1 at the start) and clears
it; after the copy it raises its *arrived* flag in the receiver's workspace. The
receiver's compute stream waits for every arrived flag and clears them, reads the inbox,
and sets its inbox-free flag in every sender's workspace.

Limits: NCCL still carries the layer's counts and the small message of expert ids and
top-k weights (and, with the all-gather dispatch, their gradients), and the all-gather
dispatch's backward reduce-scatters (under the dW GEMMs). The GPUs must reach each other's memory (NVLink or
PCIe peer access); symmetric memory's rendezvous fails otherwise. The workspace grows,
collectively and with a device sync, whenever a layer call needs more than it holds.
A flag wait has no timeout: if a rank dies between two exchanges, its peers' streams
wait for it (NCCL's watchdog does not see these waits), so the job must be torn down
from outside, as after a failed rank in any collective.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import math
import socket
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ep_moe.dispatch import PendingExchange
from ep_moe.gathered import GatherExchange
from ep_moe.kernels.arrival import Departure, Landing, rows_departing

DISPATCH, COMBINE = "dispatch", "combine"
"""Directions: rows to the experts' ranks (``matrix[q][p]`` rows from q to p), and back
(the transpose)."""
_ALIGN = 256  # bytes between regions: every dtype's element size divides it
_MAX_RANKS = 128
_MAX_CHUNKS = 32  # chunks of one all-gather exchange (MoEConfig.overlap_chunks)
# The flags: 32-bit words at the start of every workspace, then the data.
_READY, _DONE = 0, _MAX_RANKS  # + source / puller: the all-to-all's sequence numbers
# the all-gather's 0/1 handshakes, + chunk * _MAX_RANKS + rank:
_STAGED = 2 * _MAX_RANKS  # rows of a source staged (in the puller's workspace)
_FREE = _STAGED + _MAX_CHUNKS * _MAX_RANKS  # a puller has pulled them (in the stager's)
_ARRIVED = _FREE + _MAX_CHUNKS * _MAX_RANKS  # a sender's sums are in the inbox (the receiver's)
_INBOX_FREE = _ARRIVED + _MAX_CHUNKS * _MAX_RANKS  # a receiver's inbox is free (in the sender's)
_LANDED = _INBOX_FREE + _MAX_CHUNKS * _MAX_RANKS  # + chunk: sources landed (for the GEMMs)
_FLAGS = 1 << 17  # bytes reserved for them
assert 4 * (_LANDED + _MAX_CHUNKS) <= _FLAGS
_GROWTH = 1.25  # a workspace that must grow takes this much headroom
_SUPPORTED: dict[str, tuple[bool, str]] = {}  # group name -> copy_engine_supported(group)
_WORKSPACES: dict[tuple[str, int], "SymmetricWorkspace"] = {}


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class _StreamMemOps:
    """``cuStreamWriteValue32`` and ``cuStreamWaitValue32`` of the CUDA driver, through
    ctypes: PyTorch does not expose the wait."""

    _WAIT_GEQ, _WAIT_EQ = 0x0, 0x1

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._write = self._function(lib, "cuStreamWriteValue32")
        self._wait = self._function(lib, "cuStreamWaitValue32")

    @staticmethod
    def _function(lib, name: str):
        fn = getattr(lib, name + "_v2", None) or getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn

    @staticmethod
    def _check(name: str, result: int) -> None:
        if result != 0:
            raise RuntimeError(f"{name} failed with CUresult {result}")

    def write(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        """After the stream's earlier work (and a memory barrier): ``*address = value``."""
        self._check("cuStreamWriteValue32", self._write(stream.cuda_stream, address, value, 0))

    def wait(self, stream: torch.cuda.Stream, address: int, value: int, equal: bool) -> None:
        """The stream's later work waits until ``*address == value`` (``equal``) or
        ``*address >= value``."""
        flags = self._WAIT_EQ if equal else self._WAIT_GEQ
        self._check("cuStreamWaitValue32", self._wait(stream.cuda_stream, address, value, flags))


def _uses_nccl(group: ProcessGroup) -> bool:
    """Whether ``group`` runs CUDA collectives on NCCL ("nccl", "cpu:gloo,cuda:nccl", or
    a group made without naming a backend, as ``init_device_mesh`` does)."""
    name = dist.get_backend(group)
    if name == "nccl" or "cuda:nccl" in name:
        return True
    try:
        return type(group._get_backend(torch.device("cuda"))).__name__ == "ProcessGroupNCCL"
    except (AttributeError, RuntimeError, ValueError):
        return False


def _local_reason(group: ProcessGroup) -> Optional[str]:
    """Why this rank cannot take part in a copy-engine exchange (None: it can)."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if not _uses_nccl(group):
        return f"the EP group's CUDA backend is not NCCL (backend {dist.get_backend(group)!r})"
    if dist.get_world_size(group) > _MAX_RANKS:
        return f"the EP group has more than {_MAX_RANKS} ranks"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:
        return "this PyTorch has no torch.distributed._symmetric_memory"
    try:
        _StreamMemOps()
    except (OSError, AttributeError) as err:
        return f"the CUDA driver's stream memory operations are not available ({err})"
    return None


def copy_engine_supported(group: ProcessGroup) -> tuple[bool, str]:
    """Whether every rank of ``group`` can exchange rows on the copy engines: CUDA, an
    NCCL group, symmetric memory in this PyTorch, the driver's stream memory operations,
    every rank on this host. Collective the first time (every rank of the group must
    call it) and the same answer on every rank; cached per group. Returns (supported,
    why not)."""
    key = group.group_name
    if key not in _SUPPORTED:
        hosts = [None] * dist.get_world_size(group)
        dist.all_gather_object(hosts, (socket.gethostname(), _local_reason(group)), group=group)
        reasons = sorted({r for _, r in hosts if r is not None})
        if len({h for h, _ in hosts}) > 1:
            reasons.append("the EP group spans several hosts (copy engines reach only this node's GPUs)")
        _SUPPORTED[key] = (not reasons, "; ".join(reasons))
    return _SUPPORTED[key]


class SymmetricWorkspace:
    """One rank's symmetric-memory buffer for an EP group (flags, then data), the stream
    its copies run on, the all-to-all's sequence number and the flag protocols of the
    module docstring. It grows on demand; growing is collective and every rank asks for
    the same size. A buffer that a CUDA graph was captured with stays mapped when the
    workspace grows past it: the graph's replays still copy and signal there."""

    def __init__(self, group: ProcessGroup, device: torch.device) -> None:
        self.group, self.device = group, device
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.stream = torch.cuda.Stream(device)
        self.capacity = 0
        self.epoch = 0
        """Sequence number of the all-to-all's last exchange (its flags hold such numbers)."""
        self._memops = _StreamMemOps()
        self._buffers: list[torch.Tensor] = []  # every rank's buffer, flat uint8, mapped here
        self._allocation = None
        self._captured = False  # a CUDA graph holds the current buffers' addresses
        self._retired: list = []  # earlier (allocation, buffers) that captured graphs replay into

    @classmethod
    def for_group(cls, group: ProcessGroup, device: torch.device, user: str) -> "SymmetricWorkspace":
        """The workspace of ``group`` on ``device`` for ``user`` (an exchange class: each
        has its own, as their protocols differ), shared by every layer using it."""
        key = (group.group_name, device.index, user)
        if key not in _WORKSPACES:
            _WORKSPACES[key] = cls(group, device)
        return _WORKSPACES[key]

    def reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` of data (collective when it grows: same ``nbytes``
        everywhere). Growing waits for every rank's device, then starts the flags over;
        it cannot happen while a CUDA graph is captured."""
        capturing = self._capturing()
        if self._buffers and nbytes <= self.capacity:  # the flags exist even for 0 bytes of data
            self._captured |= capturing
            return
        if capturing:
            raise RuntimeError(f"the copy-engine workspace must grow to {nbytes} bytes while a CUDA graph is "
                               "captured; run the layer once eagerly with the same shapes before capturing")
        if self._buffers:  # peers may still be pulling from the old buffers
            self._quiesce()
            if self._captured:  # and graphs captured with them may replay: keep them mapped
                self._retired.append((self._allocation, list(self._buffers)))
            self._buffers, self._allocation, self._captured = [], None, False
        capacity = _round_up(int(nbytes * _GROWTH), 1 << 21)
        self._buffers = self._allocate(_FLAGS + capacity)
        flags = self._buffers[self.rank][:_FLAGS].view(torch.int32)
        flags.zero_()
        for free in (_FREE, _INBOX_FREE):  # every region free
            flags[free: free + _MAX_CHUNKS * _MAX_RANKS].fill_(1)
        self._quiesce()  # every rank's flags are set before anyone raises one
        self.capacity, self.epoch = capacity, 0

    def _capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def _allocate(self, nbytes: int) -> list[torch.Tensor]:
        """Every rank's buffer of ``nbytes`` (collective), this rank's own at its index."""
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        handle = symm_mem.rendezvous(buffer, self.group)
        # the peers' views do not own their memory: keep the allocation and its handle alive
        self._allocation = (buffer, handle)
        return [handle.get_buffer(q, (nbytes,), torch.uint8) for q in range(self.size)]

    def _quiesce(self) -> None:
        """Wait for this rank's device, then for every rank (collective)."""
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def view(self, rank: int, byte_offset: int, rows: int, row_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """[rows, *row_shape] of ``dtype`` at ``byte_offset`` of ``rank``'s data."""
        start = _FLAGS + byte_offset
        nbytes = rows * math.prod(row_shape) * dtype.itemsize
        return self._buffers[rank][start: start + nbytes].view(dtype).view(rows, *row_shape)

    def flag(self, rank: int, index: int) -> torch.Tensor:
        """Flag word ``index`` of ``rank``'s workspace, as int32 [1]."""
        return self._buffers[rank][4 * index: 4 * index + 4].view(torch.int32)

    def _signal(self, stream: Optional[torch.cuda.Stream], rank: int, index: int, value: int) -> None:
        """On ``stream``, after its earlier work: flag ``index`` of ``rank``'s workspace = ``value``."""
        self._memops.write(stream, self._buffers[rank].data_ptr() + 4 * index, value)

    def _await(self, stream: Optional[torch.cuda.Stream], index: int, value: int, equal: bool) -> None:
        """``stream``'s later work waits until this rank's flag ``index`` == ``value``
        (``equal``) or >= ``value``."""
        self._memops.wait(stream, self._buffers[self.rank].data_ptr() + 4 * index, value, equal)

    def _compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def _peers(self) -> list[int]:
        return [q for q in range(self.size) if q != self.rank]

    def follow_compute(self) -> None:
        """The workspace's stream waits for the work queued so far on the current stream."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copying(self):
        """Context in which ``copy_`` runs on the workspace's stream."""
        return torch.cuda.stream(self.stream)

    def mark_copies(self) -> torch.cuda.Event:
        """An event after the copies queued so far (for :meth:`wait_copies`)."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait_copies(self, event: torch.cuda.Event) -> None:
        """The current stream waits for the copies before ``event`` (also what joins the
        workspace's stream back into a CUDA graph being captured)."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def keep_for_copies(self, t: torch.Tensor) -> None:
        """Keep ``t``'s memory from reuse until the copies queued so far have run."""
        t.record_stream(self.stream)

    def finish(self, out: torch.Tensor, landing: Optional[Landing] = None) -> PendingExchange:
        """``out``, filled on the workspace's stream, as an exchange the current stream can wait for."""
        self.keep_for_copies(out)
        done = torch.cuda.Event()
        done.record(self.stream)
        return PendingExchange(out, event=done, landing=landing)

    # The all-to-all's protocol: sequence numbers.

    def signal_ready(self, epoch: int) -> None:
        """On the workspace's stream: tell every peer this rank staged exchange ``epoch``."""
        for peer in self._peers():
            self._signal(self.stream, peer, _READY + self.rank, epoch)

    def wait_ready(self, source: int, epoch: int) -> None:
        """On the workspace's stream: wait until ``source`` staged exchange ``epoch``."""
        self._await(self.stream, _READY + source, epoch, equal=False)

    def signal_done(self, epoch: int) -> None:
        """On the workspace's stream: tell every peer this rank pulled exchange ``epoch``."""
        for peer in self._peers():
            self._signal(self.stream, peer, _DONE + self.rank, epoch)

    def wait_done(self, epoch: int) -> None:
        """On the current stream: wait until every peer pulled exchange ``epoch``."""
        for peer in self._peers():
            self._await(self._compute_stream(), _DONE + peer, epoch, equal=False)

    # The all-gather's protocol: 0/1 flags, replayable in CUDA graphs.

    def claim_region(self, chunk: int) -> None:
        """On the current stream: wait until every peer has pulled what this rank last
        staged in chunk ``chunk``'s region, then mark the region taken."""
        compute = self._compute_stream()
        for peer in self._peers():
            self._await(compute, _FREE + chunk * _MAX_RANKS + peer, 1, equal=True)
        for peer in self._peers():
            self._signal(compute, self.rank, _FREE + chunk * _MAX_RANKS + peer, 0)

    def clear_landed(self, chunk: int) -> torch.Tensor:
        """On the current stream: chunk ``chunk``'s landing flag = 0; returns the flag."""
        self._signal(self._compute_stream(), self.rank, _LANDED + chunk, 0)
        return self.flag(self.rank, _LANDED + chunk)

    def signal_staged(self, chunk: int) -> None:
        """On the workspace's stream: tell every peer this rank staged chunk ``chunk``."""
        for peer in self._peers():
            self._signal(self.stream, peer, _STAGED + chunk * _MAX_RANKS + self.rank, 1)

    def await_staged(self, chunk: int, source: int) -> None:
        """On the workspace's stream: wait until ``source`` staged chunk ``chunk``, and take
        the flag back."""
        index = _STAGED + chunk * _MAX_RANKS + source
        self._await(self.stream, index, 1, equal=True)
        self._signal(self.stream, self.rank, index, 0)

    def signal_landed(self, chunk: int, sources: int) -> None:
        """On the workspace's stream: chunk ``chunk``'s first ``sources`` pulled sources landed."""
        self._signal(self.stream, self.rank, _LANDED + chunk, sources)

    def signal_pulled(self, chunk: int, source: int) -> None:
        """On the workspace's stream: tell ``source`` this rank has pulled its chunk ``chunk``."""
        self._signal(self.stream, source, _FREE + chunk * _MAX_RANKS + self.rank, 1)

    def claim_inbox(self, chunk: int, receiver: int) -> None:
        """On the workspace's stream: wait until ``receiver`` has read what this rank last
        sent to its chunk ``chunk`` inbox, then mark it taken."""
        index = _INBOX_FREE + chunk * _MAX_RANKS + receiver
        self._await(self.stream, index, 1, equal=True)
        self._signal(self.stream, self.rank, index, 0)

    def signal_arrived(self, chunk: int, receiver: int) -> None:
        """On the workspace's stream: tell ``receiver`` this rank's sums are in its inbox."""
        self._signal(self.stream, receiver, _ARRIVED + chunk * _MAX_RANKS + self.rank, 1)

    def await_inbox(self, chunk: int) -> None:
        """On the current stream: wait until every peer's sums are in this rank's chunk
        ``chunk`` inbox, taking the flags back."""
        compute = self._compute_stream()
        for peer in self._peers():
            index = _ARRIVED + chunk * _MAX_RANKS + peer
            self._await(compute, index, 1, equal=True)
            self._signal(compute, self.rank, index, 0)

    def free_inbox(self, chunk: int) -> None:
        """On the current stream, after the inbox was read: tell every peer it is free."""
        for peer in self._peers():
            self._signal(self._compute_stream(), peer, _INBOX_FREE + chunk * _MAX_RANKS + self.rank, 1)


def segment_layout(matrix: list[list[int]], me: int) -> list[tuple[int, int, int]]:
    """Where rank ``me``'s rows of one exchange come from: ``(source rank, first row in the
    source's staged rows, count)`` per source with rows, in the order they land in the
    output (grouped by source rank). ``matrix[q][p]``: rows q sends p; a sender stages
    its rows grouped by destination rank."""
    return [(q, sum(matrix[q][:me]), matrix[q][me]) for q in range(len(matrix)) if matrix[q][me]]


class CopyEngineExchange:
    """The all-to-alls of one layer call's pipeline on the copy engines.

    ``matrices[c][q][p]``: rows rank q sends rank p in chunk c's dispatch (every rank
    holds all of them, from one all-gather of counts); ``row_bytes``: bytes per row of
    each message kind (e.g. ``{"rows": H * 2, "weights": K * 4}``). Every rank's
    workspace holds one region per (direction, kind, chunk), sized for what that rank
    stages there; the workspace is sized for the largest rank. Every rank must make the
    same sequence of :meth:`begin`, :meth:`dispatch` and :meth:`combine` calls."""

    uses_sms = False
    """Copies on the copy engines and stream memory operations: no SM needed."""

    def __init__(self, workspace: SymmetricWorkspace, matrices: list[list[list[int]]],
                 row_bytes: dict[str, int]) -> None:
        self.workspace, self.row_bytes = workspace, row_bytes
        self.rank = workspace.rank
        ranks = range(len(matrices[0]))
        self.matrices = {DISPATCH: matrices, COMBINE: [[list(col) for col in zip(*m)] for m in matrices]}
        self.offsets: dict[tuple[str, str, int], list[int]] = {}
        ends = [0 for _ in ranks]
        for direction, per_chunk in self.matrices.items():
            for kind, width in row_bytes.items():
                for c, matrix in enumerate(per_chunk):
                    self.offsets[(direction, kind, c)] = list(ends)
                    ends = [_round_up(ends[q] + sum(matrix[q]) * width, _ALIGN) for q in ranks]
        workspace.reserve(max(ends))

    def begin(self) -> None:
        """Start a session (a forward or a backward): the current stream waits until every
        peer has pulled everything this rank staged before, so it may stage again."""
        self.workspace.wait_done(self.workspace.epoch)

    def staging(self, chunk: int, kind: str, rows: int, row_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """Where :meth:`dispatch` stages chunk ``chunk``'s rows of ``kind``: a tensor
        written there (after :meth:`begin`) is sent without a copy."""
        return self.workspace.view(self.rank, self.offsets[(DISPATCH, kind, chunk)][self.rank], rows,
                                   row_shape, dtype)

    def dispatch(self, x: torch.Tensor, chunk: int, kind: str) -> PendingExchange:
        """Send chunk ``chunk``'s rows of message ``kind`` (grouped by destination rank)
        to the experts' ranks; they arrive grouped by source rank."""
        return self._exchange(x, DISPATCH, kind, chunk)

    def combine(self, x: torch.Tensor, chunk: int, kind: str) -> PendingExchange:
        """The reverse of :meth:`dispatch`: rows in arrival order go back to their senders
        and arrive in each sender's send order."""
        return self._exchange(x, COMBINE, kind, chunk)

    def _exchange(self, x: torch.Tensor, direction: str, kind: str, chunk: int) -> PendingExchange:
        ws, me = self.workspace, self.rank
        matrix, offsets = self.matrices[direction][chunk], self.offsets[(direction, kind, chunk)]
        row_shape, width = tuple(x.shape[1:]), self.row_bytes[kind]
        if x.shape[0] != sum(matrix[me]) or math.prod(row_shape) * x.element_size() != width:
            raise ValueError(f"{direction} of {kind!r}, chunk {chunk}: got {tuple(x.shape)} {x.dtype}, "
                             f"expected {sum(matrix[me])} rows of {width} bytes")
        staged = ws.view(me, offsets[me], x.shape[0], row_shape, x.dtype)
        if x.shape[0] and staged.data_ptr() != x.data_ptr():
            staged.copy_(x)
        out = x.new_empty((sum(row[me] for row in matrix), *row_shape))
        ws.epoch += 1
        ws.follow_compute()  # staged, and `out` allocated
        ws.signal_ready(ws.epoch)
        with ws.copying():
            landed = 0
            for source, first, count in segment_layout(matrix, me):
                if source != me:
                    ws.wait_ready(source, ws.epoch)
                src = ws.view(source, offsets[source] + first * width, count, row_shape, x.dtype)
                out[landed: landed + count].copy_(src)
                landed += count
        ws.signal_done(ws.epoch)
        return ws.finish(out)


class CopyEngineGather(GatherExchange):
    """The all-gather dispatch (:class:`~ep_moe.gathered.GatherExchange`) with the rows'
    all-gathers and the forward's reduce-scatter on the copy engines, each overlapped with
    the GEMM at its end; capturable in CUDA graphs.

    A dispatch of chunk c's rows claims the chunk's region of this rank's workspace (waits
    until every peer has pulled what was staged there last), stages this rank's [T, H] there
    and copies them into its own slot of the output (all on the current stream, so the own
    rows are there before any reader), then pulls the peers' rows on the copy engines in
    landing order, the next rank first, raising the chunk's landing flag to w after the w-th
    source (the 0/1 handshake of the module docstring). The exchange comes back with its
    :class:`~ep_moe.kernels.arrival.Landing`: the grouped GEMM that reads the rows first (the
    up projection in the forward, the down projection's dX in the backward) waits tile by
    tile for its source instead of the whole transfer (:mod:`ep_moe.kernels.arrival`);
    everything after waits for the transfer (``PendingExchange.wait``).

    The forward's reduce-scatter of the partial sums: inside :meth:`departing` the down
    projection sums the tokens source by source, the peers' first (a
    :class:`~ep_moe.kernels.arrival.Departure`), and as each source's [T, H] sums are queued
    the copy engines push them into that rank's *inbox* in its workspace (after waiting until
    it has read what it got there last) and raise its arrived flag. :meth:`combine` then waits
    for every peer's sums on the device and adds them to the own ones; that wait is queued
    on the compute stream at once, so with several chunks the next chunk's experts start
    once this chunk's sums have arrived from every peer (one chunk is the faster setting
    on this path, as measured). The expert ids and
    top-k weights (small, needed at once by the routing) and the backward's reduce-scatters
    (under the dW GEMMs already) stay on NCCL.

    Every rank must make the same sequence of :meth:`dispatch`, :meth:`departing` and
    :meth:`combine` calls with the same chunk sizes ``rows_per_chunk``, at most
    ``_MAX_CHUNKS`` chunks."""

    def __init__(self, group: ProcessGroup, workspace: SymmetricWorkspace, rows_per_chunk: list[int],
                 row_bytes: int) -> None:
        super().__init__(group)
        if len(rows_per_chunk) > _MAX_CHUNKS:
            raise ValueError(f"the copy-engine all-gather takes at most {_MAX_CHUNKS} chunks, got "
                             f"{len(rows_per_chunk)}; lower MoEConfig.overlap_chunks")
        self.workspace, self.rank, self.rows_per_chunk = workspace, workspace.rank, rows_per_chunk
        # per chunk: the staged rows [T, H], then the inbox of the peers' sums [P-1, T, H]
        sizes = [rows * row_bytes for rows in rows_per_chunk] + [
            (self.size - 1) * rows * row_bytes for rows in rows_per_chunk]
        starts, end = [], 0
        for nbytes in sizes:
            starts.append(end)
            end = _round_up(end + nbytes, _ALIGN)
        self.offsets, self.inboxes = starts[:len(rows_per_chunk)], starts[len(rows_per_chunk):]
        workspace.reserve(end)
        self._departures: dict[int, Departure] = {}
        self._pushed: dict[int, torch.cuda.Event] = {}  # per chunk: after its last push

    def dispatch(self, x: torch.Tensor, chunk: int, kind: str) -> PendingExchange:
        """All-gather ``x`` [T, ...]: rows on the copy engines (landing source by source),
        anything else (``kind`` other than ``"rows"``) on NCCL."""
        if kind != "rows":
            return super().dispatch(x, chunk, kind)
        ws, me, size = self.workspace, self.rank, self.size
        rows, row_shape = x.shape[0], tuple(x.shape[1:])
        x = x.detach()
        ws.claim_region(chunk)
        ws.view(me, self.offsets[chunk], rows, row_shape, x.dtype).copy_(x)
        out = x.new_empty((size * rows, *row_shape))
        out[me * rows: (me + 1) * rows].copy_(x)
        landed = ws.clear_landed(chunk)
        ws.follow_compute()  # staged, `out` allocated, the landing flag cleared
        ws.signal_staged(chunk)
        with ws.copying():
            for w in range(1, size):
                source = (me + w) % size
                ws.await_staged(chunk, source)
                out[source * rows: (source + 1) * rows].copy_(
                    ws.view(source, self.offsets[chunk], rows, row_shape, x.dtype))
                ws.signal_landed(chunk, w)
                ws.signal_pulled(chunk, source)
        return ws.finish(out, Landing(landed, 0, size))

    @contextlib.contextmanager
    def departing(self, chunk: int, like: torch.Tensor):
        """Around chunk ``chunk``'s expert function, whose output is like ``like`` [P*T, H]:
        a slot-summing down projection inside sends each source's sums as it finishes them
        (a chunk without tokens sends nothing: its combine is NCCL's)."""
        if self.rows_per_chunk[chunk] == 0:
            yield
            return
        out = torch.empty_like(like)
        departure = Departure(out, tuple(range(1, self.size)) + (0,), self.rank,
                              lambda position: self._send(chunk, out, position))
        self._departures[chunk] = departure
        try:
            with rows_departing(departure):
                yield
        except BaseException:
            # Stopped between the sends and the combine (a checkpoint's recompute stops once
            # it has what the backward needs, at the same point on every rank): take the
            # peers' sums in and free the inbox as the combine would, so the next call finds
            # the flags at rest. Stopped halfway through the sends (an error in the GEMM),
            # the exchange is left as after a failed rank in any collective.
            del self._departures[chunk]
            if departure.complete:
                self._receive(chunk, like)
                self.workspace.free_inbox(chunk)
            raise

    def _send(self, chunk: int, sums: torch.Tensor, position: int) -> None:
        """Push the sums of landing position ``position``'s tokens into that rank's inbox
        (on the copy engines, after the work queued so far)."""
        if position == 0:  # the own tokens' sums stay here
            return
        ws, me, size, rows = self.workspace, self.rank, self.size, self.rows_per_chunk[chunk]
        receiver = (me + position) % size
        slot = (me - receiver) % size - 1  # senders fill the receiver's inbox by distance
        ws.follow_compute()
        ws.claim_inbox(chunk, receiver)
        row_bytes = math.prod(sums.shape[1:]) * sums.element_size()
        with ws.copying():  # the push itself on the copy engines, between the flag wait and raise
            ws.view(receiver, self.inboxes[chunk] + slot * rows * row_bytes, rows, tuple(sums.shape[1:]),
                    sums.dtype).copy_(sums[receiver * rows: (receiver + 1) * rows])
        ws.signal_arrived(chunk, receiver)
        ws.keep_for_copies(sums)
        self._pushed[chunk] = ws.mark_copies()

    def combine(self, x: torch.Tensor, chunk: int, kind: str) -> PendingExchange:
        """Reduce-scatter ``x`` [P*T, ...]: the forward's rows (sent from :meth:`departing`)
        on the copy engines, anything else on NCCL."""
        departure = self._departures.pop(chunk) if kind == "rows" and chunk in self._departures else None
        if departure is None:
            return super().combine(x, chunk, kind)
        if departure.used and (x.data_ptr() != departure.out.data_ptr() or x.shape != departure.out.shape):
            raise RuntimeError("the expert function must return the slot-summing down projection's output as it "
                               "is: its sums were sent source by source, and a changed output would not be")
        if not departure.used:  # no GEMM sent them source by source: send the finished sums
            departure.out.copy_(x)
            for position in departure.order:
                departure.send(position)
        inbox = self._receive(chunk, x)
        me, rows = self.rank, self.rows_per_chunk[chunk]
        out = inbox.sum(0).add_(departure.out[me * rows: (me + 1) * rows])
        self.workspace.free_inbox(chunk)
        return PendingExchange(out)

    def _receive(self, chunk: int, like: torch.Tensor) -> torch.Tensor:
        """On the current stream: wait for the peers' sums of chunk ``chunk`` (and this rank's
        own pushes); the inbox [P-1, T, ...] (rows like ``like``'s), until ``free_inbox``."""
        ws, rows = self.workspace, self.rows_per_chunk[chunk]
        ws.await_inbox(chunk)
        pushed = self._pushed.pop(chunk, None)
        if pushed is not None:  # this rank's pushes are done too (and, in a capture, joined)
            ws.wait_copies(pushed)
        inbox = ws.view(self.rank, self.inboxes[chunk], (self.size - 1) * rows, tuple(like.shape[1:]), like.dtype)
        return inbox.view(self.size - 1, rows, *like.shape[1:])
