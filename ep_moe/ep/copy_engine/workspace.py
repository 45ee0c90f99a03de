"""One rank's symmetric-memory workspace for the copy engines (:class:`SymmetricWorkspace`):
its buffer, its copy stream, and the 0/1 flag handshakes of :mod:`ep_moe.ep.copy_engine`,
written and awaited with the CUDA driver's stream memory operations (no SM)."""

from __future__ import annotations

import ctypes
import importlib
import math
import socket
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ep_moe.ep.base import PendingExchange, round_up
from ep_moe.kernels.arrival import Landing

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
        capacity = round_up(int(nbytes * _GROWTH), 1 << 21)
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
