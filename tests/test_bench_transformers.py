"""``benchmarks/bench_transformers.py``'s CPU smoke run: every section (the four families'
blocks forward+backward, the no-grad forward at few tokens, the Qwen3-MoE training step) on
tiny shapes in float32, its JSON checked; an implementation that raises is recorded as
unavailable while the run goes on; and the figure of the results (needs matplotlib).

The benchmark runs as a subprocess without ``TRITON_INTERPRET`` (ep_moe's CPU path is torch's),
as the other benchmarks' smoke runs do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCKS = {"qwen3-30b-a3b": "Qwen3MoeSparseMoeBlock", "gpt-oss-20b": "GptOssMLP",
          "mixtral-8x7b": "MixtralSparseMoeBlock", "deepseek-v3": "DeepseekV3MoE"}

pytest.importorskip("transformers.integrations.moe", reason="needs transformers 5 (its ExpertsInterface)")


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("bench_transformers") / "transformers.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_transformers.py"), "--smoke", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=out.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads(out.read_text()), proc.stdout


def test_smoke_run_records_every_section(smoke_results):
    _, data, stdout = smoke_results
    assert data["benchmark"] == "transformers" and data["smoke"] and data["dtype"] == "float32"
    assert data["environment"]["device"] == "cpu" and {"torch", "triton"} <= data["environment"].keys()
    assert data["transformers"] and data["warnings"] == []
    assert {"block", "small", "step"} <= data.keys()

    block = data["block"]["results"]
    assert {r["shape"]: r["block_class"] for r in block} == BLOCKS
    for r in block:
        assert set(r["impls"]) == {"grouped_mm", "ep_moe"}
        for impl in r["impls"].values():
            assert impl["available"] and impl["ms"] > 0 and len(impl["ms_rounds"]) == data["rounds"]
        assert r["speedup"] == pytest.approx(r["impls"]["grouped_mm"]["ms"] / r["impls"]["ep_moe"]["ms"])
        numerics = r["numerics"]
        assert numerics["reference"] == "grouped_mm"
        assert numerics["out"]["max_rel"] < 1e-5 and numerics["dx"]["rel"] < 1e-5
        assert numerics["grads"] and all(e["rel"] < 1e-5 for e in numerics["grads"].values())
        assert any("router" in n or "gate.weight" in n for n in numerics["grads"])  # the top-k weights' gradient
    deepseek = next(r for r in block if r["shape"] == "deepseek-v3")
    assert "shared_experts.down_proj.weight" in deepseek["numerics"]["grads"]

    small = data["small"]["results"]
    assert {(r["shape"], r["tokens"]) for r in small} == {(s, t) for s in BLOCKS for t in (1, 4)}
    for r in small:
        assert set(r["impls"]) == {"grouped_mm", "batched_mm", "eager", "ep_moe"}
        assert all(impl["ms"] > 0 for impl in r["impls"].values())
        assert r["impls"]["ep_moe"]["vs_grouped_mm"]["max_rel"] < 1e-5
        assert r["best_hf"] in ("grouped_mm", "batched_mm", "eager") and r["speedup"] > 0

    step = data["step"]
    assert step["model"] == "Qwen3MoeForCausalLM" and step["tokens_per_step"] == step["batch"] * step["seq"]
    for impl in ("grouped_mm", "ep_moe"):
        r = step["impls"][impl]
        assert r["available"] and r["ms"] > 0 and r["tokens_per_s"] > 0
        assert len(r["step_ms"]) == step["steps"] and len(r["losses"]) == step["steps"] + step["warmup"]
    assert step["max_loss_abs_diff"] < 1e-4  # the same start, batches and optimizer: the same losses
    assert "block forward+backward" in stdout and "training step" in stdout


def test_plot_of_the_smoke_results(smoke_results, tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_transformers

    png = tmp_path / "transformers.png"
    bench_transformers.main(["--plot", str(smoke_results[0]), "--plot-out", str(png)])
    assert png.stat().st_size > 10_000


def test_a_failing_implementation_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    """grouped_mm raising (as on a GPU without its kernel): recorded unavailable, ep_moe still
    timed and checked against transformers' eager loop instead."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_transformers
    from transformers.integrations.moe import ExpertsInterface

    def broken(*args, **kwargs):
        raise RuntimeError("grouped_mm: no kernel for this device")

    monkeypatch.setitem(ExpertsInterface._global_mapping, "grouped_mm", broken)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "x.json"
    data = bench_transformers.main(["--smoke", "--sections", "block,small", "--shapes", "mixtral-8x7b",
                                    "--small-tokens", "2", "--out", str(out)])
    assert json.loads(out.read_text())["block"] == data["block"]
    (block,) = data["block"]["results"]
    assert block["impls"]["grouped_mm"] == {"available": False,
                                            "error": "RuntimeError: grouped_mm: no kernel for this device"}
    assert block["impls"]["ep_moe"]["ms"] > 0 and block["speedup"] is None
    assert block["numerics"]["reference"] == "eager" and block["numerics"]["out"]["max_rel"] < 1e-5
    (small,) = data["small"]["results"]
    assert not small["impls"]["grouped_mm"]["available"] and small["best_hf"] in ("batched_mm", "eager")
    assert small["impls"]["ep_moe"]["vs_eager"]["max_rel"] < 1e-5


def test_fp8_experts_in_the_block_section(tmp_path):
    """``ep_moe_fp8`` in ``--block-impls``: ep_moe with FP8 experts on the same parameters (the
    Triton interpreter, float16), timed, its output and dX against the reference within the
    FP8 bound and quantized (off by more than float16's noise), bf16 ep_moe unchanged beside
    it; the other sections refuse it."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_transformers

    data = bench_transformers.main(["--smoke", "--dtype", "float16", "--sections", "block", "--shapes", "mixtral-8x7b",
                                    "--block-impls", "grouped_mm,ep_moe_fp8,ep_moe", "--out", str(tmp_path / "x.json")])
    (block,) = data["block"]["results"]  # FP8 before bf16: a leak of its options would show in ep_moe's check
    assert block["impls"]["ep_moe_fp8"]["ms"] > 0 and block["speedup_fp8"] > 0 and block["speedup"] > 0
    fp8 = block["numerics_fp8"]
    assert 1e-2 < fp8["out"]["rel"] < bench_transformers.FP8_BOUND and 1e-2 < fp8["dx"]["rel"] < bench_transformers.FP8_BOUND
    assert block["numerics"]["out"]["max_rel"] < 1e-2  # the bf16 experts on the same block, not quantized
    assert not data["warnings"]
    with pytest.raises(SystemExit):
        bench_transformers.parse_args(["--smoke", "--small-impls", "ep_moe_fp8"])


def test_fp8_experts_without_fp8_hardware_are_recorded_unavailable(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_transformers

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a CPU without the interpreter: no FP8
    data = bench_transformers.main(["--smoke", "--sections", "block", "--shapes", "qwen3-30b-a3b",
                                    "--block-impls", "grouped_mm,ep_moe,ep_moe_fp8", "--out", str(tmp_path / "x.json")])
    (block,) = data["block"]["results"]
    fp8 = block["impls"]["ep_moe_fp8"]
    assert not fp8["available"] and "FP8 experts run on CUDA GPUs with FP8 tensor cores" in fp8["error"]
    assert block["impls"]["ep_moe"]["ms"] > 0 and block["speedup"] > 0 and "speedup_fp8" in block
    assert block["speedup_fp8"] is None and "numerics_fp8" not in block
