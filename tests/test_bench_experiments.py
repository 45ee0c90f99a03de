"""CPU smoke runs of the experiments in ``benchmarks/experiments/`` that the docs still point to:
``bench_bounded_rows.py`` (what sets ``GROUPED_MM_MAX_ROWS`` for the all-gather's bounded rows)
and ``bench_slot_rows.py`` (the all-to-all's slot-row format against its main format). They
catch a script broken by a change to the layer before a GPU session spends its time on it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "benchmarks" / "experiments"


def test_bench_bounded_rows_runs_both_paths_and_they_agree(tmp_path):
    """The all-gather's expert step on the kernels (interpreter) and on the small-call path:
    the same output, every path and round timed."""
    out = tmp_path / "bounded.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(EXPERIMENTS / "bench_bounded_rows.py"), "--device", "cpu", "--shape", "tiny",
           "--tokens", "4,9", "--rounds", "2", "--calls", "1", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [row["tokens_per_rank"] for row in rows] == [4, 9]
    for row in rows:
        assert row["rel_err"] < 1e-5 and row["counted_rows"] < row["bound_rows"] == 4 * row["tokens_per_rank"] * 2
        assert all(len(times) == 2 and min(times) > 0 for times in row["rounds_us"].values())


@pytest.mark.distributed
def test_bench_slot_rows_smoke_run(tmp_path):
    """``benchmarks/experiments/bench_slot_rows.py`` on gloo with two ranks, the tiny shape: both formats
    and the plain layer timed, every round kept (on the CPU both formats are the main one)."""
    out = tmp_path / "slot_rows.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXPERIMENTS / "bench_slot_rows.py"), "--device", "cpu", "--shape", "tiny", "--tokens", "1,4",
           "--calls", "2", "--rounds", "2", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["ep_size"] == 2 and data["rounds"] == 2
    rows = {(row["layer"], row["tokens"], row["call"]) for row in data["results"]}
    assert rows == {(layer, tokens, call) for layer in ("slot_rows", "main_format", "plain") for tokens in (1, 4)
                    for call in ("fwd", "fwd+bwd")}
    assert all(len(row["wall_rounds_us"]) == 2 and row["outputs_rel_diff"] == 0.0 for row in data["results"])
