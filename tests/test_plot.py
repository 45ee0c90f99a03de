"""``benchmarks/plot.py`` on small synthetic results: which file it picks per device for each
figure, every PNG from the command line, and its errors. Drawing needs matplotlib (those
tests skip without it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import plot  # noqa: E402

DEVICE = "Fake GPU"
ENV = {"device": DEVICE, "torch": "2.x", "triton": "3.x"}
SHAPES = ("small", "wide")


def _write(path: Path, data) -> Path:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def _gemm(rows: int) -> dict:
    results = [{"shape": SHAPES[i % 2], "projection": ("gate_up", "down")[i // 2 % 2], "rows": 64, "n": 32, "k": 16,
                "flops_fwd": 2 * 64 * 32 * 16,
                "ms": {f"{impl}_{p}": 0.01 * (1 + i) for impl in ("ours", "gmm", "gmm_perm")
                       for p in ("fwd", "fwdbwd")}}
               for i in range(rows)]
    return {"environment": ENV, "tokens": 32, "matmul_tflops": 1.0, "results": results}


def _ep(ep: int, impls=("plain", "ep_moe", "deepspeed")) -> dict:
    rows = [{"shape": s, "num_experts": 8, "top_k": 2, "impl": impl, "ms": 1.0 + ep + i, "valid": True}
            for s in SHAPES for i, impl in enumerate(impls)]
    rows.append({"shape": "small", "num_experts": 8, "top_k": 2, "impl": "broken", "ms": 0.1, "valid": False})
    return {"environment": ENV, "ep_size": ep, "results": rows}


def _train_run(model: str, world: int, ep: int) -> dict:
    configuration = "1 GPU" if world == 1 else f"DP={world}" if ep == 1 else f"EP={ep}"
    return {"benchmark": "train", "device": DEVICE, "torch": "2.x", "triton": "3.x", "model": model,
            "configuration": configuration, "world_size": world, "ep_size": ep, "dispatch": "all_to_all",
            "tokens_per_s_per_gpu": 1000.0 / world, "mfu": 0.2, "flops": {"active_params": 1e6, "total_params": 4e6},
            "breakdown": {"summary_ms": {"experts": 3.0, "idle": 1.0}}}


LEVERS = {
    "benchmark": "train_ep_levers", "device": f"{DEVICE} (2 per machine)", "torch": "2.x", "triton": "3.x",
    "runs": [{"note": note, "model": "tiny", "configuration": conf, "dispatch": dispatch, "step_ms": 10.0,
              "tokens_per_s_per_gpu": tps, "breakdown_ms": {"experts": 4.0, "exchange_exposed": 1.0}}
             for note, conf, dispatch, tps in (("A: eager", "1 GPU", "local", 900.0),
                                               ("A: eager", "EP=2", "all_to_all", 700.0),
                                               ("B: graphs", "EP=2", "all_gather", 950.0))],
    "graphs_vs_eager": {"what": "20 steps, [loss, grad_norm]", "eager": [[5.0, 2.0], [4.0, 1.5], [3.5, 1.0]],
                        "graphed": [[5.0, 2.0], [4.0, 1.5], [3.5, 1.0]]},
}


def _hf_run(experts: str, param_dtype: str, step_ms: float, losses: int = 3, seed: int = 0, world: int = 1,
            ep: int = 1, compiled: bool = False) -> dict:
    return {"benchmark": "train", "device": DEVICE, "model": "qwen3-4l", "experts": experts, "world_size": world,
            "ep_size": ep, "configuration": "1 GPU" if world == 1 else (f"EP={ep}" if ep == world else f"DP={world}"),
            "param_dtype": param_dtype, "step_ms": step_ms, "tokens_per_s_per_gpu": 8192e3 / step_ms, "mfu": 0.2,
            "tokens_per_step": 8192,
            "overrides": [f"training.seed={seed}"] + (["training.compile=true"] if compiled else []),
            "losses": [10.0 / (1 + i) for i in range(losses)]}


def _fp8_run(config: str, precision: str, commit: str, tps: float, final: float, note: str = "") -> dict:
    return {"config": config, "expert_precision": precision, "commit": commit, "steps": 100,
            "median_tokens_per_s": tps, "val_loss": {"50": final + 0.1, "100": final}, "final_val_loss": final,
            "loss": [[s, 5.0 / s + final] for s in (1, *range(10, 101, 10))], "note": note}


def _fp8_parity(note: str = "") -> dict:
    """A parity file: each (config, precision) once, an older fp8 run of ``gpu`` before the newer
    one, and a run kept for its throughput ("before ...") after it."""
    return {"what": f"trainer, bf16 against fp8 {note}", "device": DEVICE, "torch": "2.x", "triton": "3.x",
            "date": "2026-01-01",
            "runs": [_fp8_run("gpu", "bf16", "a", 2000.0, 0.50), _fp8_run("gpu", "fp8", "old", 1500.0, 0.60),
                     _fp8_run("gpu", "fp8", "b", 2100.0, 0.51), _fp8_run("qwen3_ep", "bf16", "c", 800.0, 0.40),
                     _fp8_run("qwen3_ep", "fp8", "c", 900.0, 0.40),
                     _fp8_run("gpu", "fp8", "older", 1000.0, 0.70, note="before the weight kernel: eager")]}


@pytest.fixture
def results(tmp_path) -> Path:
    """A results directory of one fake device: two grouped-GEMM files, two bench_ep series and
    a session log that is not one, a bench_train file and a levers log, a metrics file."""
    res = tmp_path / "results"
    res.mkdir()
    _write(res / "grouped_gemm_Fake_GPU.json", _gemm(4))
    _write(res / "grouped_gemm_Fake_GPU_partial.json", _gemm(2))
    for ep in (1, 2, 4):
        _write(res / f"ep_Fake_GPU_ep{ep}.json", _ep(ep, ("plain", "ep_moe", "deepspeed", "ep_moe_ag+graph")))
    for ep in (1, 2):
        _write(res / f"ep_Fake_GPU_ep{ep}_old.json", _ep(ep))
    _write(res / "ep_session3_Fake_GPU.json", {"what": "notes", "blocks": {}})
    _write(res / "train_Fake_GPU_x2.json", [_train_run("tiny", 1, 1), _train_run("tiny", 2, 2)])
    _write(res / "train_ep_levers_Fake_GPU_x2.json", LEVERS)
    _write(res / "train_Fake_GPU_x1.jsonl", "\n".join(json.dumps({"step": s, "loss": 6.0 - s}) for s in (1, 2, 3)))
    hf_runs = [_hf_run("ep_moe", "bfloat16", 78.0), _hf_run("grouped_mm", "bfloat16", 85.0),
               _hf_run("ep_moe", "float32", 105.0), _hf_run("grouped_mm", "float32", 144.0),
               _hf_run("ep_moe", "bfloat16", 78.0, losses=60), _hf_run("grouped_mm", "bfloat16", 85.0, losses=60),
               _hf_run("ep_moe", "bfloat16", 65.0, compiled=True), _hf_run("grouped_mm", "bfloat16", 62.0, compiled=True)]
    _write(res / "hf_train_Fake_GPU_x1.json", hf_runs)
    _write(res / "hf_train_Fake_GPU_x2.json", [_hf_run("ep_moe", "bfloat16", 80.0, world=2, ep=2),
                                               _hf_run("grouped_mm", "bfloat16", 105.0, world=2),
                                               _hf_run("ep_moe", "bfloat16", 80.0, losses=60, world=2, ep=2)])
    _write(res / "fp8_parity_Fake_GPU_x1.json", _fp8_parity())
    return res


def test_picks_the_most_complete_results_per_device(results):
    (path, data), = plot.gemm_files(results).values()
    assert path.name == "grouped_gemm_Fake_GPU.json" and len(data["results"]) == 4
    series, = plot.ep_series(results).values()
    assert {ep: p.name for ep, (p, _) in series.items()} == {ep: f"ep_Fake_GPU_ep{ep}.json" for ep in (1, 2, 4)}
    (path, runs), = plot.train_files(results).values()
    assert path.name == "train_ep_levers_Fake_GPU_x2.json" and len(runs) == 3  # more runs than the other file
    assert [(r["world_size"], r["ep_size"], r["setting"]) for r in runs] == [(1, 1, "A: eager"), (2, 2, "A: eager"),
                                                                            (2, 2, "B: graphs")]
    assert runs[2]["breakdown"]["summary_ms"] == {"experts": 4.0, "exchange_exposed": 1.0}
    levers, metrics = plot.loss_inputs(results)
    assert levers[0].name == "train_ep_levers_Fake_GPU_x2.json"
    assert [(p.name, len(records)) for p, records in metrics] == [("train_Fake_GPU_x1.jsonl", 3)]
    assert [(p.name, len(runs)) for p, runs in plot.hf_train_files(results)] == [("hf_train_Fake_GPU_x1.json", 8),
                                                                                 ("hf_train_Fake_GPU_x2.json", 3)]


def test_fp8_parity_picks_the_newest_file_and_run(results, tmp_path):
    _write(results / "fp8_parity_Fake_GPU_x1_old.json", _fp8_parity("old"))
    os.utime(results / "fp8_parity_Fake_GPU_x1_old.json", (1e9, 1e9))  # older than the fixture's file
    _write(results / "fp8_parity_notes.json", {"what": "notes", "runs": [{"note": "no config"}]})
    (path, data), = plot.fp8_parity_files(results).values()
    assert path.name == "fp8_parity_Fake_GPU_x1.json"
    runs = plot.fp8_parity_runs(data)
    assert {c: {p: (r["commit"], r["median_tokens_per_s"]) for p, r in by.items()} for c, by in runs.items()} == {
        "gpu": {"bf16": ("a", 2000.0), "fp8": ("b", 2100.0)}, "qwen3_ep": {"bf16": ("c", 800.0), "fp8": ("c", 900.0)}}
    empty = tmp_path / "empty"
    empty.mkdir()
    _write(empty / "fp8_parity_notes.json", {"what": "notes", "runs": []})
    assert not plot.fp8_parity_files(empty)


def test_fp8_parity_figure(results, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    out = tmp_path / "plots"
    proc = _plot_py("--results", str(results), "--out", str(out), "--only", "fp8_parity")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    height, width, _ = imread(out / "fp8_parity.png").shape
    assert height > 300 and width > 800
    titles = []  # the panel titles: the final val losses, their difference and the tokens/s of the newest runs
    monkeypatch.setattr(plot, "_save", lambda fig, path: titles.extend(ax.get_title() for ax in fig.axes)
                        or plot._pyplot().close(fig))
    plot.plot_fp8_parity(plot.fp8_parity_files(results), tmp_path / "x.png")
    assert len(titles) == 2 and titles[0].startswith("gpu: Fake GPU") and titles[1].startswith("qwen3_ep")
    assert "bf16 0.5000, fp8 0.5100 (fp8 +2.000%)" in titles[0] and "bf16 2,000, fp8 2,100 (fp8 1.050x)" in titles[0]
    (results / "fp8_parity_Fake_GPU_x1.json").unlink()
    proc = _plot_py("--results", str(results), "--out", str(tmp_path / "none"), "--only", "fp8_parity,loss")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped fp8_parity.png: no trainer bf16/fp8 fp8_parity_*.json results in" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "none").iterdir()) == ["loss_curves.png"]


def test_names_and_device():
    assert plot.device_name("NVIDIA H200 (2 per machine; 4 machines)") == "NVIDIA H200"
    assert plot.impl_label("ep_moe_agce_c1+graph") == "ep_moe all_gather_copy_engine + CUDA graph"
    assert plot.impl_label("ep_moe_ag") == "ep_moe all_gather"
    assert plot.impl_label("new_impl+compile") == "new_impl + torch.compile"
    assert [plot._world_and_ep(c) for c in ("1 GPU", "DP=4", "EP=4", "EP=2xDP=2")] == [(1, 1), (4, 1), (4, 4), (4, 2)]


def _plot_py(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "plot.py"), *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_command_line_writes_every_figure(results, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    out = tmp_path / "plots"
    proc = _plot_py("--results", str(results), "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = ("gemm_tflops.png", "layer_vs_ep.png", "train_scaling.png", "loss_curves.png", "train_hf.png",
             "fp8_parity.png")
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
    for name in names:
        height, width, _ = imread(out / name).shape
        assert height > 300 and width > 500, name
        assert f"plot: {out / name}" in proc.stdout
    assert "B: graphs" in proc.stdout  # the table of the trainer runs


def test_only_some_figures_and_missing_inputs(results, tmp_path):
    pytest.importorskip("matplotlib")
    for path in results.glob("ep_*.json"):
        path.unlink()
    proc = _plot_py("--results", str(results), "--out", str(tmp_path / "plots"), "--only", "ep,loss")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped layer_vs_ep.png: no bench_ep ep_*.json results in" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["loss_curves.png"]


def test_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _plot_py("--results", str(empty))
    assert proc.returncode == 1 and f"plot.py: no results to plot in {empty}" in proc.stderr
    proc = _plot_py("--results", str(empty), "--only", "gemm,bogus")
    assert proc.returncode == 2 and "unknown figure(s) bogus; choose from gemm, ep, train, loss" in proc.stderr
    proc = _plot_py("--results", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "no such directory" in proc.stderr
