"""The test harness itself (tests/dist_utils.py): results in rank order, errors reported,
with and without the process-group teardown; hangs stopped by ``deadline_s`` (in a
collective or not); ``gloo=False``; ``start_method="forkserver"``."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed


def _sum_worker(rank, world_size, fail_rank):
    if rank == fail_rank:
        raise ValueError(f"rank {rank} fails on purpose")
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return dict(rank=rank, total=t.item())


@pytest.mark.distributed
@pytest.mark.parametrize("skip_teardown", [False, True])
def test_results_in_rank_order(skip_teardown):
    results = run_distributed(_sum_worker, 2, None, skip_teardown=skip_teardown)
    assert results == [dict(rank=0, total=3.0), dict(rank=1, total=3.0)]


@pytest.mark.distributed
@pytest.mark.parametrize("skip_teardown", [False, True])
def test_errors_name_the_rank(skip_teardown):
    with pytest.raises(RuntimeError, match=r"(?s)rank tracebacks.*-- rank 1:.*rank 1 fails on purpose"):
        run_distributed(_sum_worker, 2, 1, skip_teardown=skip_teardown, timeout_s=20)


def _dying_worker(rank, world_size, rank0_done):
    if rank == 1:  # after rank 0 has returned (and saved its result), so that the report lists it
        deadline = time.monotonic() + 15
        while not os.path.exists(rank0_done) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        os._exit(3)  # as a C++ abort would: no Python traceback, no result
    open(rank0_done, "w").close()
    return rank


@pytest.mark.distributed
def test_a_process_dying_outside_python_is_reported(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)exit code 3.*returned: \[0\]\).*none: a process died outside Python"):
        run_distributed(_dying_worker, 2, str(tmp_path / "rank0_done"), timeout_s=20)


# --- deadline_s: a run that hangs is stopped, whatever its ranks wait on ---------------------

_HANG_S = 40.0  # far beyond every deadline below: a broken deadline makes the test fail, not pass


def _stuck_outside_worker(rank, world_size):
    if rank == 1:
        time.sleep(_HANG_S)  # no collective, no peer: only the deadline ends this
    return rank


@pytest.mark.distributed
def test_deadline_stops_a_rank_stuck_outside_any_collective():
    deadline_s = 12.0  # spawn start (1 to 4 s on 2 loaded cores) stays well inside it
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run_distributed(_stuck_outside_worker, 2, deadline_s=deadline_s, timeout_s=_HANG_S)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "distributed run hung: ranks [1] still running after 12s" in message
    assert "returned: [0]" in message
    stacks = message.split("Python stacks of the ranks still running:\n", 1)[1]
    assert stacks.startswith("-- rank 1:\n")
    assert "-- rank 0:" not in stacks
    assert "in _stuck_outside_worker" in stacks  # the stack the rank printed, not a placeholder
    assert elapsed < deadline_s + 10.0, f"took {elapsed:.1f}s for a deadline of {deadline_s}s"


def _stuck_in_collective_worker(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins; the group's timeout is far away
    else:
        time.sleep(_HANG_S)  # alive (a peer that exits would break rank 0's wait at once)
    return rank


@pytest.mark.distributed
def test_deadline_stops_a_rank_stuck_in_a_collective():
    deadline_s = 12.0  # spawn start (1 to 4 s on 2 loaded cores) stays well inside it
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run_distributed(_stuck_in_collective_worker, 2, deadline_s=deadline_s, timeout_s=_HANG_S)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "distributed run hung: ranks [0, 1] still running after 12s" in message
    rank0 = message.split("-- rank 0:\n", 1)[1].split("-- rank 1:\n", 1)[0]
    assert "in all_reduce" in rank0 and "in _stuck_in_collective_worker" in rank0
    assert elapsed < deadline_s + 10.0, f"took {elapsed:.1f}s for a deadline of {deadline_s}s"


# --- gloo=False: no process group -------------------------------------------------------------

def _no_group_worker(rank, world_size):
    return dict(rank=rank, initialized=dist.is_initialized(), value=torch.tensor([rank * 10.0]))


@pytest.mark.distributed
def test_without_gloo_there_is_no_group():
    results = run_distributed(_no_group_worker, 2, gloo=False, deadline_s=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["initialized"] for r in results] == [False, False]
    assert [r["value"].item() for r in results] == [0.0, 10.0]


# --- start_method="forkserver": as spawn, with the caller's environment at call time -----------

_ENV_VAR = "EP_MOE_TEST_DIST_UTILS_VALUE"


def _forkserver_worker(rank, world_size, fail_rank):
    if rank == fail_rank:
        raise ValueError(f"rank {rank} fails on purpose under forkserver")
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return dict(env=os.environ.get(_ENV_VAR), pid=os.getpid(), parent=os.getppid(),
                tensor=torch.arange(6, dtype=torch.float64).reshape(2, 3) * t)


@pytest.mark.distributed
def test_forkserver_environment_results_and_errors(monkeypatch):
    # The first run starts the forkserver (unless an earlier test did) with "before" in its
    # environment; the second must see the value set after it, which only the copy of the
    # caller's os.environ brings.
    monkeypatch.setenv(_ENV_VAR, "before")
    first = run_distributed(_forkserver_worker, 2, None, start_method="forkserver", deadline_s=60)
    assert [r["env"] for r in first] == ["before", "before"]
    monkeypatch.setenv(_ENV_VAR, "after")
    second = run_distributed(_forkserver_worker, 2, None, start_method="forkserver", deadline_s=60)
    assert [r["env"] for r in second] == ["after", "after"]
    expected = torch.arange(6, dtype=torch.float64).reshape(2, 3) * 3.0
    for r in second:
        assert r["tensor"].dtype == torch.float64 and torch.equal(r["tensor"], expected)
    assert len({r["pid"] for r in first + second} | {os.getpid()}) == 5  # fresh children each run
    # Forked by one server, not started by this process as spawn would.
    assert len({r["parent"] for r in first + second}) == 1 and first[0]["parent"] != os.getpid()

    with pytest.raises(RuntimeError, match=r"(?s)rank tracebacks.*-- rank 1:\nTraceback \(most recent call last\):"
                                           r".*in _forkserver_worker\n.*ValueError: rank 1 fails on purpose under forkserver"):
        run_distributed(_forkserver_worker, 2, 1, start_method="forkserver", timeout_s=20, deadline_s=60)
