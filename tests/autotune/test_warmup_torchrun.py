"""warmup under torchrun, whose agent hosts the job's store: a rank 0 frozen in its tuning
(SIGSTOP) does not block the other rank's store calls, which falls back after the timeout
and grace; thawed, rank 0 takes the same fallback.

With a ``tcp://`` rendezvous rank 0 hosts the store itself, and a frozen rank 0 blocks the
others until the store's own timeout (documented in ``ep_moe.autotune.coordinate``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT = 2.0
GRACE = 1.0  # coordinate._publish_grace(TIMEOUT)

_WORKER = """
import json, os, signal, sys, time
from pathlib import Path
import torch.distributed as dist
tmp = Path(sys.argv[1])
sys.path.insert(0, sys.argv[2])
from _dist import TINY, CountingTuner, set_cache_env
from ep_moe.autotune import warmup

dist.init_process_group("gloo")
rank = dist.get_rank()
set_cache_env(tmp)
if rank == 0:
    (tmp / "rank0.pid").write_text(str(os.getpid()))
dist.barrier()
start = time.monotonic()
resolved = warmup([TINY], num_tokens=64, timeout=float(sys.argv[3]),
                  tuner=CountingTuner(str(tmp / "tunes.log"), freeze=True))[TINY]
result = {"source": resolved.source, "error": resolved.error, "seconds": time.monotonic() - start,
          "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}
(tmp / f"result{rank}.json").write_text(json.dumps(result))
if rank == 1:
    os.kill(int((tmp / "rank0.pid").read_text()), signal.SIGCONT)
dist.destroy_process_group()
"""


@pytest.mark.distributed
def test_a_frozen_rank0_does_not_block_the_agent_hosted_store(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), str(tmp_path), str(Path(__file__).parent), str(TIMEOUT)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # a frozen rank must not outlive the test
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    results = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in (0, 1)]
    assert all(r["agent_store"] == "True" for r in results), results
    assert all(r["source"] == "fallback" and "gave up for every rank" in r["error"] for r in results), results
    assert TIMEOUT <= results[1]["seconds"] < TIMEOUT + GRACE + 5, results
