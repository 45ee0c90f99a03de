"""The all-gather dispatch's row exchanges on the GPUs' copy engines, through symmetric memory
(``MoEConfig.dispatch="all_gather_copy_engine"``).

Why: NCCL's collectives run as kernels, which need SMs, and a persistent grouped GEMM holds
every SM until it ends: a collective queued beside it hardly progresses. A ``cudaMemcpy``
between GPU memories over NVLink runs on the copy engines instead, with no SM, so the
transfer of one source's tokens runs while the experts' first GEMM already computes on the
tokens that have landed.

How: every rank of the EP group holds one :class:`SymmetricWorkspace`, a buffer in
symmetric memory that every peer can address, and a stream for its copies. Flags are 32-bit
words at the start of each workspace, written and awaited with CUDA stream memory operations
(``cuStreamWriteValue32`` / ``cuStreamWaitValue32``), which the GPU's front end runs: no SM is
needed anywhere, so nothing waits for a GEMM to give one back (a barrier kernel needs an SM;
with the GEMMs holding them all, one per exchange made the layer up to 3.7x slower than NCCL
when first measured).

The layer's exchanges are captured in CUDA graphs, whose replays cannot count on the host,
so each flag is 0 or 1 and whoever waits for it takes it back:

- *Rows, pulled* (:meth:`CopyEngineGather.dispatch`). In the stager's workspace one *free*
  flag per peer (1: that peer has pulled the rows staged last; 1 at the start): the stager's
  compute stream waits for all of them and clears them before it stages (claims the region).
  In each puller's workspace one *staged* flag per source, which the puller's copy stream
  waits for and clears before it copies; after the copy it sets its free flag in the
  source's workspace. The *landing* flag that the experts' GEMM polls
  (:mod:`ep_moe.kernels.arrival`) is in the rank's own workspace, cleared on the compute
  stream before the pulls are queued and raised to w after the w-th source.
- *Sums, pushed* (the forward's reduce-scatter, :meth:`CopyEngineGather.departing`). Each rank
  has an *inbox* of P-1 slots for the peers' token sums. Before a push the sender's copy
  stream waits for its *inbox-free* flag for that receiver (in the sender's workspace, 1 at
  the start) and clears it; after the copy it raises its *arrived* flag in the receiver's
  workspace. The receiver's compute stream waits for every arrived flag and clears them,
  reads the inbox, and sets its inbox-free flag in every sender's workspace.

Limits: NCCL still carries the expert ids and top-k weights (small, needed at once by the
routing), their gradients, and the backward's reduce-scatter (under the dW GEMMs). The GPUs
must reach each other's memory (NVLink or PCIe peer access); symmetric memory's rendezvous
fails otherwise. The workspace grows, collectively and with a device sync, whenever a layer
call needs more than it holds. A flag wait has no timeout: if a rank dies between two
exchanges, its peers' streams wait for it (NCCL's watchdog does not see these waits), so the
job must be torn down from outside, as after a failed rank in any collective.
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

_ALIGN = 256  # bytes between regions: every dtype's element size divides it
_MAX_RANKS = 128
# The flags: 32-bit words at the start of every workspace (+ rank), then the data.
_STAGED = 0  # rows of a source staged (in the puller's workspace)
_FREE = _MAX_RANKS  # a puller has pulled them (in the stager's)
_ARRIVED = 2 * _MAX_RANKS  # a sender's sums are in the inbox (the receiver's)
_INBOX_FREE = 3 * _MAX_RANKS  # a receiver's inbox is free (in the sender's)
_LANDED = 4 * _MAX_RANKS  # sources landed, for the GEMMs (no rank offset)
_FLAGS = 1 << 12  # bytes reserved for them
assert 4 * (_LANDED + 1) <= _FLAGS and _FLAGS % _ALIGN == 0
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
    its copies run on and the flag protocols of the module docstring. It grows on demand; growing is collective and every rank asks for
    the same size. A buffer that a CUDA graph was captured with stays mapped when the
    workspace grows past it: the graph's replays still copy and signal there."""

    def __init__(self, group: ProcessGroup, device: torch.device) -> None:
        self.group, self.device = group, device
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.stream = torch.cuda.Stream(device)
        self.capacity = 0
        self._memops = _StreamMemOps()
        self._buffers: list[torch.Tensor] = []  # every rank's buffer, flat uint8, mapped here
        self._allocation = None
        self._captured = False  # a CUDA graph holds the current buffers' addresses
        self._retired: list = []  # earlier (allocation, buffers) that captured graphs replay into

    @classmethod
    def for_group(cls, group: ProcessGroup, device: torch.device) -> "SymmetricWorkspace":
        """The workspace of ``group`` on ``device``, shared by every layer using it."""
        key = (group.group_name, device.index)
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
            flags[free: free + _MAX_RANKS].fill_(1)
        self._quiesce()  # every rank's flags are set before anyone raises one
        self.capacity = capacity

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

    # The protocols: 0/1 flags, replayable in CUDA graphs.

    def claim_region(self) -> None:
        """On the current stream: wait until every peer has pulled what this rank last
        staged, then mark the region taken."""
        compute = self._compute_stream()
        for peer in self._peers():
            self._await(compute, _FREE + peer, 1, equal=True)
        for peer in self._peers():
            self._signal(compute, self.rank, _FREE + peer, 0)

    def clear_landed(self) -> torch.Tensor:
        """On the current stream: the landing flag = 0; returns the flag."""
        self._signal(self._compute_stream(), self.rank, _LANDED, 0)
        return self.flag(self.rank, _LANDED)

    def signal_staged(self) -> None:
        """On the workspace's stream: tell every peer this rank staged its rows."""
        for peer in self._peers():
            self._signal(self.stream, peer, _STAGED + self.rank, 1)

    def await_staged(self, source: int) -> None:
        """On the workspace's stream: wait until ``source`` staged its rows, and take the
        flag back."""
        self._await(self.stream, _STAGED + source, 1, equal=True)
        self._signal(self.stream, self.rank, _STAGED + source, 0)

    def signal_landed(self, sources: int) -> None:
        """On the workspace's stream: the first ``sources`` pulled sources landed."""
        self._signal(self.stream, self.rank, _LANDED, sources)

    def signal_pulled(self, source: int) -> None:
        """On the workspace's stream: tell ``source`` this rank has pulled its rows."""
        self._signal(self.stream, source, _FREE + self.rank, 1)

    def claim_inbox(self, receiver: int) -> None:
        """On the workspace's stream: wait until ``receiver`` has read what this rank last
        sent to its inbox, then mark it taken."""
        self._await(self.stream, _INBOX_FREE + receiver, 1, equal=True)
        self._signal(self.stream, self.rank, _INBOX_FREE + receiver, 0)

    def signal_arrived(self, receiver: int) -> None:
        """On the workspace's stream: tell ``receiver`` this rank's sums are in its inbox."""
        self._signal(self.stream, receiver, _ARRIVED + self.rank, 1)

    def await_inbox(self) -> None:
        """On the current stream: wait until every peer's sums are in this rank's inbox,
        taking the flags back."""
        compute = self._compute_stream()
        for peer in self._peers():
            self._await(compute, _ARRIVED + peer, 1, equal=True)
            self._signal(compute, self.rank, _ARRIVED + peer, 0)

    def free_inbox(self) -> None:
        """On the current stream, after the inbox was read: tell every peer it is free."""
        for peer in self._peers():
            self._signal(self._compute_stream(), peer, _INBOX_FREE + self.rank, 1)


class CopyEngineGather(GatherExchange):
    """The all-gather dispatch (:class:`~ep_moe.gathered.GatherExchange`) with the rows'
    all-gathers and the forward's reduce-scatter on the copy engines, each overlapped with
    the GEMM at its end; capturable in CUDA graphs.

    A dispatch of rows claims this rank's region of its workspace (waits until every peer
    has pulled what was staged there last), stages this rank's [T, H] there and copies them
    into its own slot of the output (all on the current stream, so the own rows are there
    before any reader), then pulls the peers' rows on the copy engines in landing order, the
    next rank first, raising the landing flag to w after the w-th source (the 0/1 handshake
    of the module docstring). The exchange comes back with its
    :class:`~ep_moe.kernels.arrival.Landing`: the grouped GEMM that reads the rows first (the
    up projection in the forward, the down projection's dX in the backward) waits tile by
    tile for its source instead of the whole transfer (:mod:`ep_moe.kernels.arrival`);
    everything after waits for the transfer (``PendingExchange.wait``).

    The forward's reduce-scatter of the partial sums: inside :meth:`departing` the down
    projection sums the tokens source by source, the peers' first (a
    :class:`~ep_moe.kernels.arrival.Departure`), and as each source's [T, H] sums are queued
    the copy engines push them into that rank's *inbox* in its workspace (after waiting until
    it has read what it got there last) and raise its arrived flag. :meth:`combine` then waits
    for every peer's sums on the device and adds them to the own ones. The expert ids and
    top-k weights (small, needed at once by the routing) and the backward's reduce-scatter
    (under the dW GEMMs already) stay on NCCL.

    Every rank must make the same sequence of :meth:`dispatch`, :meth:`departing` and
    :meth:`combine` calls with the same ``num_tokens``."""

    def __init__(self, group: ProcessGroup, workspace: SymmetricWorkspace, num_tokens: int, row_bytes: int,
                 landing: bool = True) -> None:
        super().__init__(group)
        self.workspace, self.rank, self.num_tokens = workspace, workspace.rank, num_tokens
        self.landing = landing
        """Whether the rows' dispatches hand them over while they land (their first reader is a
        Triton grouped GEMM that waits source by source); else they come whole, after the
        transfer (the reference GEMMs read them like any tensor)."""
        # the staged rows [T, H], then the inbox of the peers' sums [P-1, T, H]
        self.inbox_offset = _round_up(num_tokens * row_bytes, _ALIGN)
        workspace.reserve(self.inbox_offset + (self.size - 1) * num_tokens * row_bytes)
        self._departure: Optional[Departure] = None
        self._pushed: Optional[torch.cuda.Event] = None  # after the last push

    def dispatch(self, x: torch.Tensor, kind: str) -> PendingExchange:
        """All-gather ``x`` [T, ...]: rows on the copy engines (landing source by source),
        anything else (``kind`` other than ``"rows"``) on NCCL."""
        if kind != "rows":
            return super().dispatch(x, kind)
        ws, me, size = self.workspace, self.rank, self.size
        rows, row_shape = x.shape[0], tuple(x.shape[1:])
        x = x.detach()
        ws.claim_region()
        ws.view(me, 0, rows, row_shape, x.dtype).copy_(x)
        out = x.new_empty((size * rows, *row_shape))
        out[me * rows: (me + 1) * rows].copy_(x)
        landed = ws.clear_landed()
        ws.follow_compute()  # staged, `out` allocated, the landing flag cleared
        ws.signal_staged()
        with ws.copying():
            for w in range(1, size):
                source = (me + w) % size
                ws.await_staged(source)
                out[source * rows: (source + 1) * rows].copy_(ws.view(source, 0, rows, row_shape, x.dtype))
                ws.signal_landed(w)
                ws.signal_pulled(source)
        return ws.finish(out, Landing(landed, 0, size) if self.landing else None)

    @contextlib.contextmanager
    def departing(self, like: torch.Tensor):
        """Around the expert function, whose output is like ``like`` [P*T, H]: a
        slot-summing down projection inside sends each source's sums as it finishes them
        (without tokens nothing is sent: the combine is NCCL's)."""
        if self.num_tokens == 0:
            yield
            return
        out = torch.empty_like(like)
        departure = Departure(out, tuple(range(1, self.size)) + (0,), self.rank,
                              lambda position: self._send(out, position))
        self._departure = departure
        try:
            with rows_departing(departure):
                yield
        except BaseException:
            # Stopped between the sends and the combine (a checkpoint's recompute stops once
            # it has what the backward needs, at the same point on every rank): take the
            # peers' sums in and free the inbox as the combine would, so the next call finds
            # the flags at rest. Stopped halfway through the sends (an error in the GEMM),
            # the exchange is left as after a failed rank in any collective.
            self._departure = None
            if departure.complete:
                self._receive(like)
                self.workspace.free_inbox()
            raise

    def _send(self, sums: torch.Tensor, position: int) -> None:
        """Push the sums of landing position ``position``'s tokens into that rank's inbox
        (on the copy engines, after the work queued so far)."""
        if position == 0:  # the own tokens' sums stay here
            return
        ws, me, size, rows = self.workspace, self.rank, self.size, self.num_tokens
        receiver = (me + position) % size
        slot = (me - receiver) % size - 1  # senders fill the receiver's inbox by distance
        ws.follow_compute()
        ws.claim_inbox(receiver)
        row_bytes = math.prod(sums.shape[1:]) * sums.element_size()
        with ws.copying():  # the push itself on the copy engines, between the flag wait and raise
            ws.view(receiver, self.inbox_offset + slot * rows * row_bytes, rows, tuple(sums.shape[1:]),
                    sums.dtype).copy_(sums[receiver * rows: (receiver + 1) * rows])
        ws.signal_arrived(receiver)
        ws.keep_for_copies(sums)
        self._pushed = ws.mark_copies()

    def combine(self, x: torch.Tensor, kind: str) -> PendingExchange:
        """Reduce-scatter ``x`` [P*T, ...]: the forward's rows (sent from :meth:`departing`)
        on the copy engines, anything else on NCCL."""
        departure = self._departure if kind == "rows" else None
        if departure is None:
            return super().combine(x, kind)
        self._departure = None
        if departure.used and (x.data_ptr() != departure.out.data_ptr() or x.shape != departure.out.shape):
            raise RuntimeError("the expert function must return the slot-summing down projection's output as it "
                               "is: its sums were sent source by source, and a changed output would not be")
        if not departure.used:  # no GEMM sent them source by source: send the finished sums
            departure.out.copy_(x)
            for position in departure.order:
                departure.send(position)
        inbox = self._receive(x)
        me, rows = self.rank, self.num_tokens
        own = departure.out[me * rows: (me + 1) * rows]
        # summed in fp32 and returned in the rows' dtype, whatever autocast is on: CUDA's
        # autocast runs `sum` in fp32, and an fp32 output would make the backward's output
        # gradients fp32, which autograd then casts for the down projection before they land
        out = torch.sum(inbox, 0, dtype=torch.float32).add_(own).to(own.dtype)
        self.workspace.free_inbox()
        return PendingExchange(out)

    def _receive(self, like: torch.Tensor) -> torch.Tensor:
        """On the current stream: wait for the peers' sums (and this rank's own pushes); the
        inbox [P-1, T, ...] (rows like ``like``'s), until ``free_inbox``."""
        ws, rows = self.workspace, self.num_tokens
        ws.await_inbox()
        pushed, self._pushed = self._pushed, None
        if pushed is not None:  # this rank's pushes are done too (and, in a capture, joined)
            ws.wait_copies(pushed)
        inbox = ws.view(self.rank, self.inbox_offset, (self.size - 1) * rows, tuple(like.shape[1:]), like.dtype)
        return inbox.view(self.size - 1, rows, *like.shape[1:])
