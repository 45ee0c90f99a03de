"""The EP benchmark's CPU smoke run: ``benchmarks/bench_ep.py`` on gloo with two ranks, the
tiny shape, ep_moe against the plain layer in rotated rounds, at EP=2 and as two EP=1
replicas (``--ep-size 1``). Catches a benchmark broken by a change to the layer before a
GPU session spends its time on it. And once with ``--routing zipf``: the skewed routing
reaches every layer alike (they still validate) and is reported; and with ``--fp8``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.distributed
@pytest.mark.parametrize("ep_size", [2, 1])
def test_bench_ep_runs_validates_and_records_every_round(tmp_path, ep_size):
    out = tmp_path / "ep.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # the CPU path uses the reference backend
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "benchmarks" / "bench_ep.py"), "--device", "cpu", "--dtype", "float32", "--shapes", "tiny",
           "--tokens", "256", "--impls", "ep_moe,plain", "--rounds", "3", "--iters", "2", "--warmup", "1",
           "--out", str(out)] + (["--ep-size", "1"] if ep_size == 1 else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["ep_size"] == ep_size and data["world_size"] == 2 and data["rounds"] == 3
    rows = {row["impl"]: row for row in data["results"]}
    assert set(rows) == {"ep_moe", "plain"}
    for row in rows.values():
        assert row["valid"] and row["rel_err_y"] < 1e-5 and row["rel_err_dx"] < 1e-5
        assert len(row["ms_rounds"]) == 3 and len(row["ms_per_rank"]) == 2  # every replica timed
        assert row["local_experts"] == 8 // ep_size
        assert row["ms"] == sorted(row["ms_rounds"])[1] > 0
    assert (rows["ep_moe"]["a2a_ms"] > 0) == (ep_size > 1)


@pytest.mark.distributed
def test_bench_ep_zipf_routing_skews_expert_load_and_says_so(tmp_path):
    out = tmp_path / "ep_zipf.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "benchmarks" / "bench_ep.py"), "--device", "cpu", "--dtype", "float32", "--shapes", "tiny",
           "--tokens", "256", "--impls", "ep_moe,plain", "--iters", "1", "--warmup", "0",
           "--routing", "zipf", "--zipf-s", "1.0", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "routing zipf" in proc.stdout and "zipf(s=1) load expert" in proc.stdout
    data = json.loads(out.read_text())
    assert data["routing"] == "zipf" and data["zipf_s"] == 1.0
    rows = {row["impl"]: row for row in data["results"]}
    assert set(rows) == {"ep_moe", "plain"}
    for row in rows.values():
        assert row["routing"] == "zipf" and row["zipf_s"] == 1.0
        assert row["valid"] and row["rel_err_y"] < 1e-5 and row["rel_err_dx"] < 1e-5  # every layer routes alike
        assert row["expert_load_max_mean"] > 1.5  # the hottest expert well above the mean (2.4x measured)
        assert 1.0 < row["rank_load_max_mean"] <= row["expert_load_max_mean"]
        assert len(row["ms_per_rank"]) == 2 and row["ms"] == max(row["ms_per_rank"]) > 0  # the slowest rank


@pytest.mark.distributed
def test_bench_ep_fp8_column_times_fp8_experts_on_the_same_weights(tmp_path):
    """``--fp8``: each ep_moe variant once more with FP8 experts sharing its weights (the Triton
    interpreter on the CPU, float16): validated against the plain layer within the FP8 bound,
    quantized (off by more than float16's noise)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "benchmarks" / "bench_ep.py"), "--device", "cpu", "--dtype", "float16", "--shapes", "tiny",
           "--tokens", "64", "--impls", "ep_moe,plain", "--variants", "nccl,ag", "--fp8", "--iters", "1",
           "--warmup", "0", "--out", str(tmp_path / "ep_fp8.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "ep_fp8.json").read_text())
    assert data["fp8"] is True
    rows = {row["impl"]: row for row in data["results"]}
    assert set(rows) == {"plain", "ep_moe", "ep_moe_ag", "ep_moe+fp8", "ep_moe_ag+fp8"}
    for name in ("ep_moe", "ep_moe_ag"):
        assert rows[name]["valid"] and rows[name]["rel_err_y"] < 5e-3
        fp8 = rows[name + "+fp8"]
        assert fp8["valid"] and 1e-2 < fp8["rel_err_y"] < 1e-1 and 1e-2 < fp8["rel_err_dx"] < 1e-1
        assert fp8["ms"] > 0


def test_bench_host_smoke_run(tmp_path):
    """``benchmarks/bench_host.py`` on the CPU (one process, the tiny shape): every layer,
    token count and call is timed and saved (the host-only time needs a GPU: None here)."""
    out = tmp_path / "host.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_host.py"), "--device", "cpu", "--dtype", "float32",
           "--shape", "tiny", "--calls", "2", "--rounds", "2", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert {(r["layer"], r["call"]) for r in rows} == {
        (layer, call) for layer in ("ep_moe[local]", "ep_moe[local]+aux", "plain") for call in ("fwd", "fwd+bwd")}
    assert sorted({r["tokens"] for r in rows}) == [1, 4, 16, 64, 256]
    assert all(r["wall_us"] > 0 and r["host_us"] is None and not r["syncs"] for r in rows)
    assert all(len(r["wall_rounds_us"]) == 2 and r["host_rounds_us"] == [] for r in rows)
