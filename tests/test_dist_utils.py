"""The test harness itself (tests/dist_utils.py): results in rank order, errors reported,
with and without the process-group teardown."""

import os

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


def _dying_worker(rank, world_size):
    if rank == 1:
        os._exit(3)  # as a C++ abort would: no Python traceback, no result
    return rank


@pytest.mark.distributed
def test_a_process_dying_outside_python_is_reported():
    with pytest.raises(RuntimeError, match=r"(?s)exit code 3.*returned: \[0\]\).*none: a process died outside Python"):
        run_distributed(_dying_worker, 2, timeout_s=20)
