"""Run a function in N processes on the CPU (optionally joined by a gloo group) and collect
what each rank returns: the one process harness of the test suite.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, each with a
gloo default group (file:// rendezvous in a temporary directory; ``gloo=False``: no group),
calls ``fn(rank, world_size, *args)`` and returns the per-rank results, in rank order, as
saved with ``torch.save`` (tensors, dicts, lists). ``fn`` must be a module-level function
so the new processes can import it by name; a test that needs a directory passes it in
``args`` (``tmp_path`` pickles).

Failures:

- An exception on any rank fails the caller with the tracebacks of every rank that
  failed, earliest first (the first is the cause; the others are usually peers that lost
  their connection); the ranks still running are then terminated.
- A collective stuck for ``timeout_s`` raises on its rank (the group's timeout).
- A run still going after ``deadline_s`` (default: 600 s, or twice ``timeout_s`` if more)
  is a hang whatever the ranks wait on (a file lock, a peer without a group, a GPU
  stream): the ranks still running print their Python stacks, are killed, and the caller
  fails with those stacks. With ``EP_MOE_TEST_DUMP_AFTER=S`` every worker also prints its
  stack to stderr after S seconds (``faulthandler``; needs ``pytest -s``), and
  :func:`progress` lines say what each rank was doing.

``skip_teardown=True``: the workers exit without ``destroy_process_group``, for functions
that captured NCCL collectives in CUDA graphs, whose communicators cannot be destroyed
(pytorch/pytorch#115388: it waits forever).

``start_method``: ``"spawn"`` (the default) starts each child as a fresh interpreter that
imports torch and the test module itself (~2-4 s of CPU per child) and inherits the
caller's environment at call time. ``"forkserver"`` forks each child from a server process
that imported :data:`FORKSERVER_PRELOAD` (torch, ep_moe) once, when the first forkserver
run of the pytest session started it, and never ran anything: as clean as spawn and much
cheaper per child (16 children on 2 cores). Its children get the caller's ``os.environ``
at call time too (copied in), but whatever a preloaded module read while importing (e.g.
``TRITON_INTERPRET``) is as it was when the server started, and ``sys.path`` is the one of
that moment. Use it for workers that depend on neither (the autotune tests do).
"""

from __future__ import annotations

import datetime
import faulthandler
import glob
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

# What the forkserver imports once, before forking any child (takes effect when the first
# forkserver run of the session starts the server).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "ep_moe", "ep_moe.autotune"]

_RANK: int | None = None  # this worker's rank, for progress()
_STACK_FILE = None  # kept open: faulthandler writes the stack into it on SIGUSR1


def _write_atomic(path: str, text: str) -> None:
    with open(path + ".part", "w") as f:  # renamed when complete: the parent may read at any time
        f.write(text)
    os.replace(path + ".part", path)


def _worker(rank: int, fn: Callable, world_size: int, tmp: str, gloo: bool, timeout_s: float,
            skip_teardown: bool, env: dict[str, str] | None, args: tuple) -> None:
    global _RANK, _STACK_FILE
    _RANK = rank
    if env is not None:  # forkserver: the caller's environment, not the server's
        os.environ.clear()
        os.environ.update(env)
    torch.set_num_threads(1)
    _STACK_FILE = open(os.path.join(tmp, f"stack_{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=_STACK_FILE, all_threads=True)
    if os.environ.get("EP_MOE_TEST_DUMP_AFTER"):
        faulthandler.dump_traceback_later(float(os.environ["EP_MOE_TEST_DUMP_AFTER"]), exit=False)
    if gloo:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    ok = False
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(tmp, f"result_{rank}.pt"))
        ok = True
    except BaseException:
        _write_atomic(os.path.join(tmp, f"error_{rank}.txt"),
                      f"{time.monotonic():.6f}\n-- rank {rank}:\n{traceback.format_exc()}")
        if not skip_teardown:
            raise
    finally:
        if gloo and not skip_teardown:
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
        rank = _RANK if _RANK is not None else dist.get_rank()
        print(f"[{time.strftime('%H:%M:%S')} rank {rank}] {message}", file=sys.stderr, flush=True)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _tracebacks(tmp: str) -> str:
    reports = [_read(path).split("\n", 1) for path in glob.glob(os.path.join(tmp, "error_*.txt"))]
    return "\n".join(text for _, text in sorted(reports, key=lambda r: float(r[0])))


def _returned(tmp: str, world_size: int) -> list[int]:
    return [r for r in range(world_size) if os.path.exists(os.path.join(tmp, f"result_{r}.pt"))]


def _kill_hung(ctx: Any, tmp: str) -> list[tuple[int, str]]:
    """The ranks still running, with the Python stacks they print on SIGUSR1; kills them."""
    hung = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
    for r in hung:
        try:
            os.kill(ctx.processes[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(1.0)  # faulthandler writes from its signal handler, even while a rank waits in C++
    stacks = []
    for r in hung:
        ctx.processes[r].kill()
        ctx.processes[r].join()
        path = os.path.join(tmp, f"stack_{r}.txt")
        stack = _read(path).strip() if os.path.exists(path) else ""
        stacks.append((r, stack or "(no stack: still starting, or stuck outside Python)"))
    return stacks


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0,
                    deadline_s: float | None = None, skip_teardown: bool = False, gloo: bool = True,
                    start_method: str = "spawn") -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, run in parallel
    (see the module docstring for the options)."""
    if deadline_s is None:
        deadline_s = max(600.0, 2 * timeout_s)
    env = None
    if start_method == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
        env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(fn, world_size, tmp, gloo, timeout_s, skip_teardown, env, args),
                                 nprocs=world_size, join=False, start_method=start_method)
        deadline = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    returned = _returned(tmp, world_size)
                    stacks = _kill_hung(ctx, tmp)
                    details = _tracebacks(tmp)
                    raise RuntimeError(
                        f"distributed run hung: ranks {[r for r, _ in stacks]} still running after {deadline_s:g}s "
                        f"(killed; ranks whose function had returned: {returned}); "
                        f"rank tracebacks, earliest first:\n{details or '(none)'}\n"
                        "Python stacks of the ranks still running:\n"
                        + "\n".join(f"-- rank {r}:\n{stack}" for r, stack in stacks))
        except ProcessException as exc:
            details = _tracebacks(tmp)
            raise RuntimeError(f"distributed run failed ({exc}; ranks whose function had returned: "
                               f"{_returned(tmp, world_size)}); rank tracebacks, earliest first:\n"
                               f"{details or '(none: a process died outside Python)'}") from exc
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [torch.load(os.path.join(tmp, f"result_{r}.pt"), weights_only=False) for r in range(world_size)]
