"""Run a function in N gloo processes on the CPU and collect what each rank returns.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, each with a
gloo default group (file:// rendezvous in a temporary directory), calls
``fn(rank, world_size, *args)`` and returns the per-rank results, in rank order, as
saved with ``torch.save`` (tensors, dicts, lists). ``fn`` must be a module-level function
so the spawned processes can import it. An exception on any rank fails the caller with
the tracebacks of every rank that failed, earliest first (the first is the cause; the
others are usually peers that lost their connection); a collective stuck for
``timeout_s`` fails instead of hanging. ``skip_teardown=True``: the workers exit without
``destroy_process_group``, for functions that captured NCCL collectives in CUDA graphs,
whose communicators cannot be destroyed (pytorch/pytorch#115388: it waits forever).
A wait that no collective timeout sees (a GPU stream waiting on a flag): set
``EP_MOE_TEST_DUMP_AFTER=S`` and every worker prints its Python stack to stderr after S
seconds (``faulthandler``), to show where each rank waits; :func:`progress` lines then say
what each rank was doing.
"""

from __future__ import annotations

import datetime
import faulthandler
import glob
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException


def _worker(rank: int, fn: Callable, world_size: int, tmp: str, timeout_s: float, skip_teardown: bool,
            args: tuple) -> None:
    torch.set_num_threads(1)
    if os.environ.get("EP_MOE_TEST_DUMP_AFTER"):
        faulthandler.dump_traceback_later(float(os.environ["EP_MOE_TEST_DUMP_AFTER"]), exit=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    ok = False
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(tmp, f"result_{rank}.pt"))
        ok = True
    except BaseException:
        path = os.path.join(tmp, f"error_{rank}.txt")
        with open(path + ".part", "w") as f:  # renamed when complete: the parent may read at any time
            f.write(f"{time.monotonic():.6f}\n-- rank {rank}:\n{traceback.format_exc()}")
        os.replace(path + ".part", path)
        if not skip_teardown:
            raise
    finally:
        if not skip_teardown:
            dist.destroy_process_group()
    # No interpreter finalization: the result is saved, and destructors running then (gloo's
    # worker threads, seen twice in CI as "terminate called without an active exception"
    # after every rank had returned) could only turn a finished run into a crash; with
    # skip_teardown they would destroy the communicators too.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


def progress(message: str) -> None:
    """Print ``message`` to stderr (with the time) when ``EP_MOE_TEST_DUMP_AFTER`` is set:
    what a worker is about to do, for reading a stack dump (needs ``pytest -s``)."""
    if os.environ.get("EP_MOE_TEST_DUMP_AFTER"):
        print(f"[{time.strftime('%H:%M:%S')} rank {dist.get_rank()}] {message}", file=sys.stderr, flush=True)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0,
                    skip_teardown: bool = False) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, run in parallel."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(_worker, args=(fn, world_size, tmp, timeout_s, skip_teardown, args),
                               nprocs=world_size, join=True, start_method="spawn")
        except ProcessException as exc:
            reports = [_read(path).split("\n", 1) for path in glob.glob(os.path.join(tmp, "error_*.txt"))]
            details = "\n".join(text for _, text in sorted(reports, key=lambda r: float(r[0])))
            finished = [r for r in range(world_size) if os.path.exists(os.path.join(tmp, f"result_{r}.pt"))]
            raise RuntimeError(f"distributed run failed ({exc}; ranks whose function had returned: {finished}); "
                               f"rank tracebacks, earliest first:\n{details or '(none: a process died outside Python)'}"
                               ) from exc
        return [torch.load(os.path.join(tmp, f"result_{r}.pt"), weights_only=False) for r in range(world_size)]
