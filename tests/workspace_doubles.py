"""CPU doubles of the copy engines' symmetric memory. :class:`HostWorkspace` keeps all of
:class:`ep_moe.copy_engine.SymmetricWorkspace`'s own code (the layout, the regions, the flag
protocols) and runs its stream operations at once on the calling thread: a copy is a plain
``copy_``, a flag wait blocks. Subclasses say where the buffers live and how a wait blocks:
threads over plain buffers (``tests/ep/test_copy_engine.py``) or :class:`FileWorkspace`, one
file per rank that every rank maps (``torch.from_file(shared=True)``), flags polled there (on
x86 the stores of one process become visible to the others in order, so a peer that sees a
flag also sees the rows written before it), for gloo tests of the whole layer with
``dispatch="all_gather_copy_engine"``.

``with file_workspaces(group):`` makes the layer take file workspaces (and skips the CUDA
checks) inside the block; every rank of ``group`` must enter it (collective: rank 0 picks
the folder).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist

from ep_moe.ep.base import PendingExchange
from ep_moe.ep.copy_engine import gather as gather_module
from ep_moe.ep.copy_engine.workspace import SymmetricWorkspace

WAIT_S = 60.0


class HostWorkspace(SymmetricWorkspace):
    """:class:`SymmetricWorkspace` whose stream operations run at once on the host; a
    subclass gives ``_allocate``, ``_quiesce``, ``_signal`` and ``_await``."""

    def _capturing(self) -> bool:
        return False

    def _compute_stream(self):
        return None

    def follow_compute(self) -> None:
        pass

    @contextlib.contextmanager
    def copying(self):
        self._in_copying = True
        try:
            yield
        finally:
            self._in_copying = False

    def view(self, rank: int, byte_offset: int, rows: int, row_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        # On the GPU a copy into or out of a peer's memory outside copying() runs on the
        # compute stream, unordered with the flags the copy stream waits for and raises.
        assert rank == self.rank or getattr(self, "_in_copying", False), \
            f"rank {self.rank} touches rank {rank}'s workspace outside copying(): not on the copy engines"
        return super().view(rank, byte_offset, rows, row_shape, dtype)

    def keep_for_copies(self, t: torch.Tensor) -> None:
        pass

    def mark_copies(self):
        return None

    def wait_copies(self, event) -> None:
        pass

    def finish(self, out: torch.Tensor, landing=None) -> PendingExchange:
        return PendingExchange(out, landing=landing)


class FileWorkspace(HostWorkspace):
    """A workspace over files in ``directory`` that every rank of ``group`` maps."""

    def __init__(self, group, directory: str) -> None:
        self.group, self.device, self.directory = group, torch.device("cpu"), directory
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.stream, self.capacity, self._buffers, self._generation = None, 0, [], 0
        self._allocation, self._captured, self._retired = None, False, []

    def _allocate(self, nbytes: int) -> list[torch.Tensor]:
        self._generation += 1
        paths = [os.path.join(self.directory, f"{group_file(self.group)}-{self._generation}-{q}") for q in range(self.size)]
        with open(paths[self.rank], "wb") as f:
            f.truncate(nbytes)
        dist.barrier(group=self.group)  # every file exists before anyone maps it
        return [torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8) for path in paths]

    def _quiesce(self) -> None:
        dist.barrier(group=self.group)

    def _signal(self, stream, rank: int, index: int, value: int) -> None:
        self.flag(rank, index)[0] = value

    def _await(self, stream, index: int, value: int, equal: bool) -> None:
        word, deadline = self.flag(self.rank, index), time.monotonic() + WAIT_S
        while not (word.item() == value or (not equal and word.item() > value)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank} waited {WAIT_S:.0f} s for its flag {index} "
                                   f"{'==' if equal else '>='} {value} (it holds {word.item()})")
            time.sleep(1e-4)


class LaggingFileWorkspace(FileWorkspace):
    """A :class:`FileWorkspace` whose pulls start ``LAG_S`` late: a rank whose copy engines
    fall behind, so that its peers run ahead and restage a region it has not pulled yet
    unless the protocol makes them wait."""

    LAG_S = 0.05

    def await_staged(self, source: int) -> None:
        time.sleep(self.LAG_S)
        super().await_staged(source)


def group_file(group) -> str:
    """A file-name-safe name of ``group``."""
    return "".join(c if c.isalnum() else "_" for c in group.group_name)


@contextlib.contextmanager
def file_workspaces(group, lagging_rank: Optional[int] = None):
    """Inside the block, layers on ``group`` take :class:`FileWorkspace` s (collective);
    ``lagging_rank``'s pull late (:class:`LaggingFileWorkspace`)."""
    folder = [tempfile.mkdtemp(prefix="ep_moe_ws_") if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(folder, src=dist.get_global_rank(group, 0), group=group)
    workspaces: dict[str, FileWorkspace] = {}
    kind = LaggingFileWorkspace if dist.get_rank(group) == lagging_rank else FileWorkspace

    def for_group(cls, group, device):
        if group.group_name not in workspaces:
            workspaces[group.group_name] = kind(group, folder[0])
        return workspaces[group.group_name]

    saved = gather_module.copy_engine_supported, SymmetricWorkspace.__dict__["for_group"]
    gather_module.copy_engine_supported = lambda group: (True, "")
    SymmetricWorkspace.for_group = classmethod(for_group)
    try:
        yield
    finally:
        gather_module.copy_engine_supported, SymmetricWorkspace.for_group = saved
        dist.barrier(group=group)  # every rank done with the files
        if dist.get_rank(group) == 0:
            shutil.rmtree(folder[0], ignore_errors=True)
