"""Plots of the benchmark results: the JSON files in ``benchmarks/results/`` in, PNGs out.

    python benchmarks/plot.py                                  # all six, into benchmarks/results/plots/
    python benchmarks/plot.py --results DIR --out DIR --only gemm,ep

Each figure takes, per device, the most complete results (then the newest: git commit
time, else the file's mtime) and names the device and the files in its titles:

- ``gemm_tflops.png``: grouped GEMM TFLOP/s of ep_moe's kernels against ``torch._grouped_mm``
  (on rows already sorted by expert, and with the permutation copy), per shape and
  projection, forward and forward+backward (``bench_grouped_gemm.py``'s
  ``grouped_gemm_<device>.json``; FLOPs 2*M*N*K forward, 3x that with the backward); the
  dense bf16 matmul rate of the same run as a dashed line.
- ``layer_vs_ep.png``: a whole MoE layer's forward+backward time (slowest rank) against the
  EP size, one panel per shape and device, one line per implementation (``bench_ep.py``'s
  ``ep_*.json``: one file per EP size, a series is the files whose names differ only in
  ``_ep<N>``; the series with the most EP sizes, then the most valid rows).
- ``train_scaling.png``: the trainer's tokens/s per GPU for each configuration, one panel per
  model, MFU on the bars where known, the best one-GPU rate as the ceiling; below, each
  profiled step split by kernel category (``bench_train.py`` results, or the runs of a
  ``train_ep_levers_*.json`` log; the file with the most runs).
- ``loss_curves.png``: training loss against step: the ``graphs_vs_eager`` runs of
  ``train_ep_levers_*.json``, and the trainer's metrics files ``train_*.jsonl``
  (``launch/train.py --metrics-file``).
- ``train_hf.png``: an HF model in the trainer (``bench_train.py --hf-model``, the runs of
  ``benchmarks/run_train_hf_gpu.sh`` in one ``hf_train_<device>_x<N>.json`` per GPU count): tokens/s per GPU
  with ep_moe's experts and transformers' ``grouped_mm`` per precision regime, and the
  200-step loss curves of both.
- ``fp8_parity.png``: the trainer with bf16 and with FP8 experts, the same seed and data
  (``fp8_parity_<device>_x<N>.json``; the newest file): one panel per configuration, the
  training loss against step of each precision, the val losses as markers, the final val
  losses, their relative difference and each precision's median tokens/s in the panel's title.

``bench_train.py --plot`` draws its scaling figure with :func:`plot_train`.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

RESULTS = Path(__file__).resolve().parent / "results"
# Colors of the step breakdown's categories (bench_train.py's summary_ms).
BREAKDOWN_COLORS = {"experts": "tab:blue", "dense_attention": "tab:green", "exchange_exposed": "tab:red",
                    "grad_sync": "tab:orange", "optimizer": "tab:purple", "host_copy": "tab:brown",
                    "idle": "lightgray"}


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _load(path: Path) -> Any:
    """A JSON file's contents, or None when it is not valid JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def file_date(path: Path) -> float:
    """When ``path`` was last committed (git), else its modification time."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%ct", "--", path.name], cwd=path.parent,
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return float(out) if out else path.stat().st_mtime


def device_name(text: str) -> str:
    """A device as results name it, without a trailing note: ``NVIDIA H200 (2 per machine)``
    -> ``NVIDIA H200``."""
    return re.sub(r"\s*\(.*\)\s*$", "", text).strip() or "unknown"


def _newest_complete(groups: dict[str, list[Any]], size: Callable[[Any], tuple],
                     paths: Callable[[Any], list[Path]]) -> dict[str, Any]:
    """Per device, the candidate with the largest ``size``, then the newest file."""
    return {device: max(cands, key=lambda c: (*size(c), max(file_date(p) for p in paths(c))))
            for device, cands in sorted(groups.items())}


def _save(fig, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    _pyplot().close(fig)
    print(f"plot: {out}")
    return out


# --- grouped GEMM ------------------------------------------------------------------------

def gemm_files(results: Path) -> dict[str, tuple[Path, dict]]:
    """Per device, the ``bench_grouped_gemm.py`` result with the most rows (then the newest)."""
    groups = defaultdict(list)
    for path in sorted(results.glob("grouped_gemm_*.json")):
        data = _load(path)
        if isinstance(data, dict) and isinstance(data.get("results"), list) and data["results"]:
            groups[device_name(data.get("environment", {}).get("device", "unknown"))].append((path, data))
    return _newest_complete(groups, lambda c: (len(c[1]["results"]),), lambda c: [c[0]])


def plot_gemm(chosen: dict[str, tuple[Path, dict]], out: Path) -> Path:
    """``gemm_tflops.png``: per device, forward above forward+backward."""
    plt = _pyplot()
    series = (("ours", "ep_moe (gather/scatter fused)", "tab:blue"), ("gmm", "torch._grouped_mm", "tab:gray"),
              ("gmm_perm", "torch._grouped_mm + permute", "silver"))
    widest = max(len(data["results"]) for _, data in chosen.values())
    fig, axes = plt.subplots(2 * len(chosen), 1, figsize=(max(8.0, 1.3 * widest), 4.0 * 2 * len(chosen)),
                             squeeze=False)
    passes = (("fwd", 1, "forward"), ("fwdbwd", 3, "forward+backward"))
    for row, (device, (path, data)) in enumerate(chosen.items()):
        rows = data["results"]
        labels = [f"{r['shape']}\n{r['projection']}" for r in rows]
        for offset, (suffix, factor, what) in enumerate(passes):
            ax = axes[2 * row + offset][0]
            width = 0.8 / len(series)
            top = data.get("matmul_tflops") or 0.0
            for i, (key, name, color) in enumerate(series):
                tflops = [factor * r["flops_fwd"] / (r["ms"][f"{key}_{suffix}"] / 1e3) / 1e12 for r in rows]
                ax.bar([j + (i - 1) * width for j in range(len(rows))], tflops, width, label=name, color=color)
                top = max(top, *tflops)
            if data.get("matmul_tflops"):
                ax.axhline(data["matmul_tflops"], ls="--", color="k", lw=1, label="dense bf16 matmul")
            ax.set_ylim(0, 1.2 * top)
            ax.set_xticks(range(len(rows)), labels, fontsize=8)
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{device}, {what} ({path.name}, {data.get('tokens', '?')} tokens)", fontsize=10)
            ax.legend(fontsize=7, loc="upper center", ncol=4)
    fig.suptitle("Grouped GEMM throughput: ep_moe against torch._grouped_mm (bench_grouped_gemm.py)")
    fig.tight_layout()
    return _save(fig, out)


# --- the layer at each EP size -------------------------------------------------------------

def ep_series(results: Path) -> dict[str, dict[int, tuple[Path, dict]]]:
    """Per device, the ``bench_ep.py`` series (one file per EP size) with the most EP sizes,
    then the most valid rows, then the newest: ``{device: {ep_size: (path, data)}}``."""
    groups: dict[tuple[str, str], dict[int, tuple[Path, dict]]] = defaultdict(dict)
    for path in sorted(results.glob("ep_*.json")):
        data = _load(path)
        if not isinstance(data, dict):
            continue
        rows = data.get("results")
        if not (isinstance(data.get("ep_size"), int) and isinstance(rows, list)
                and all(isinstance(r, dict) and {"impl", "ms", "shape"} <= r.keys() for r in rows)):
            continue  # not a bench_ep result (e.g. a session's notes)
        ep = data["ep_size"]
        family = re.sub(rf"(?<=_)ep{ep}(_|$)", "", path.stem)  # ep_X_ep2_note and ep_X_ep1_note -> ep_X_note
        device = device_name(data.get("environment", {}).get("device", "unknown"))
        groups[(device, family)].setdefault(ep, (path, data))
    by_device = defaultdict(list)
    for (device, _), series in groups.items():
        by_device[device].append(series)

    def size(series: dict[int, tuple[Path, dict]]) -> tuple[int, int]:
        return len(series), sum(r.get("valid", True) for _, data in series.values() for r in data["results"])

    return _newest_complete(by_device, size, lambda series: [p for p, _ in series.values()])


_IMPL_NAMES = {"plain": "plain (torchtitan-style: argsort, all_to_all, _grouped_mm)", "deepspeed": "DeepSpeed MoE",
               "ep_moe": "ep_moe (local at EP=1, all_to_all at EP>1)", "ep_moe_ag": "ep_moe all_gather",
               "ep_moe_agce": "ep_moe all_gather_copy_engine"}


def impl_label(impl: str) -> str:
    """A readable name of a ``bench_ep.py`` implementation (its ``variant_name``, or the older
    ``_c1`` names), with ``+graph`` / ``+compile`` spelled out."""
    base, _, suffix = impl.partition("+")
    base = base.removesuffix("_c1")
    extra = {"graph": " + CUDA graph", "compile": " + torch.compile"}.get(suffix, f" + {suffix}" if suffix else "")
    return _IMPL_NAMES.get(base, base) + extra


def plot_ep(chosen: dict[str, dict[int, tuple[Path, dict]]], out: Path) -> Path:
    """``layer_vs_ep.png``: rows of devices, columns of shapes, a line per implementation."""
    plt = _pyplot()
    shapes = list(dict.fromkeys(r["shape"] for s in chosen.values() for _, d in s.values() for r in d["results"]))
    impls = list(dict.fromkeys(impl_label(r["impl"]) for s in chosen.values() for _, d in s.values()
                               for r in d["results"]))
    colors = {impl: plt.get_cmap("tab10")(i % 10) for i, impl in enumerate(impls)}
    fig, axes = plt.subplots(len(chosen), len(shapes), figsize=(4.2 * len(shapes), 3.8 * len(chosen) + 1.2),
                             squeeze=False)
    for row, (device, series) in enumerate(chosen.items()):
        sizes = sorted(series)
        for col, shape in enumerate(shapes):
            ax = axes[row][col]
            for impl in impls:
                points = [(ep, r["ms"]) for ep in sizes for r in series[ep][1]["results"]
                          if r["shape"] == shape and impl_label(r["impl"]) == impl and r.get("valid", True)]
                if points:
                    ax.plot(*zip(*points), marker="o", color=colors[impl], label=impl,
                            ls="-" if impl.startswith("ep_moe") else "--")
            first = next((r for ep in sizes for r in series[ep][1]["results"] if r["shape"] == shape), None)
            detail = f"\nE={first['num_experts']}, top-{first['top_k']}" if first and "num_experts" in first else ""
            ax.set_title(f"{shape} on {device}{detail}", fontsize=9)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(s) for s in sizes])
            ax.set_xlabel("EP size")
            ax.set_ylabel("layer fwd+bwd (ms)")
            ax.set_ylim(bottom=0)
    handles = {label: h for ax in axes.flat for h, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(len(handles), 4), fontsize=8)
    names = "; ".join(f"{device}: " + ", ".join(series[ep][0].name for ep in sorted(series))
                      for device, series in chosen.items())
    fig.suptitle(textwrap.fill(f"MoE layer forward+backward against EP size (bench_ep.py, tokens per rank "
                               f"fixed, slowest rank): {names}", 150), fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return _save(fig, out)


# --- the trainer ---------------------------------------------------------------------------

def _world_and_ep(configuration: str) -> tuple[int, int]:
    """World and EP size from bench_train's configuration name (``1 GPU``, ``DP=4``,
    ``EP=4``, ``EP=2xDP=2``)."""
    ep = re.search(r"EP=(\d+)", configuration)
    dp = re.search(r"DP=(\d+)", configuration)
    ep_size, dp_size = int(ep.group(1)) if ep else 1, int(dp.group(1)) if dp else 1
    return ep_size * dp_size, ep_size


def train_runs(paths: Iterable[str | Path]) -> list[dict]:
    """The trainer runs in ``paths``: ``bench_train.py`` results (one run or a list) as they
    are, and each run of a ``train_ep_levers`` log in the same form (``setting``: its note,
    ``breakdown.summary_ms``: its ``breakdown_ms``). Other files are skipped."""
    runs = []
    for path in map(Path, paths):
        data = _load(path)
        if isinstance(data, dict) and data.get("benchmark") == "train_ep_levers":
            for run in data.get("runs", []):
                world, ep = _world_and_ep(run["configuration"])
                runs.append({**run, "benchmark": "train", "device": data.get("device", "unknown"),
                             "torch": data.get("torch"), "triton": data.get("triton"), "world_size": world,
                             "ep_size": ep, "setting": run.get("note"),
                             "breakdown": {"summary_ms": run.get("breakdown_ms") or {}}})
            continue
        for run in data if isinstance(data, list) else [data]:
            if isinstance(run, dict) and run.get("benchmark") == "train":
                runs.append(run)
    return runs


def train_files(results: Path) -> dict[str, tuple[Path, list[dict]]]:
    """Per device, the trainer results file with the most runs (then the newest)."""
    groups = defaultdict(list)
    for path in sorted(results.glob("train_*.json")):
        runs = train_runs([path])
        if runs:
            groups[device_name(runs[0]["device"])].append((path, runs))
    return _newest_complete(groups, lambda c: (len(c[1]),), lambda c: [c[0]])


def _run_label(run: dict) -> str:
    """A bar's label: the configuration, and at EP>1 the dispatch (long names on two lines)."""
    label = run["configuration"]
    if run["ep_size"] > 1 and run.get("dispatch"):
        label += "\n" + run["dispatch"].replace("_copy_engine", "\ncopy_engine")
    return label


def plot_train(runs: Sequence[dict], out: Path, source: str) -> Path:
    """Tokens/s per GPU by configuration, one panel per model (bars colored by ``setting``
    where runs have one, MFU on the bars where known, the best one-GPU rate drawn as the
    ceiling); below, each profiled step split into the breakdown's summary. ``source``
    names the input in the title. Prints a table; returns ``out``."""
    plt = _pyplot()
    models = list(dict.fromkeys(r["model"] for r in runs))
    settings = list(dict.fromkeys(r.get("setting") for r in runs))
    palette = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(settings)}
    widest = max(sum(r["model"] == m for r in runs) for m in models)
    fig, axes = plt.subplots(2, len(models), figsize=(max(5.5, 0.75 * widest + 1.5) * len(models), 9.5),
                             squeeze=False)
    print(f"{'model':12s} {'configuration':14s} {'dispatch':24s} {'tok/s/GPU':>11s} {'MFU':>6s}  setting")
    for j, model in enumerate(models):
        rs = sorted((r for r in runs if r["model"] == model),
                    key=lambda r: (settings.index(r.get("setting")), r["world_size"] > 1, r["ep_size"] > 1,
                                   r["ep_size"], r["world_size"]))
        ax, ax2 = axes[0][j], axes[1][j]
        bars = ax.bar(range(len(rs)), [r["tokens_per_s_per_gpu"] for r in rs],
                      color=[palette[r.get("setting")] for r in rs])
        for bar, r in zip(bars, rs):
            if r.get("mfu") is not None:
                ax.annotate(f"{100 * r['mfu']:.1f}% MFU", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
        one = [r["tokens_per_s_per_gpu"] for r in rs if r["world_size"] == 1]
        if one:
            ax.axhline(max(one), ls="--", color="k", lw=1, label="1 GPU (ceiling)")
            if settings == [None]:
                ax.legend(fontsize=8, loc="lower left")
        ax.set_xticks(range(len(rs)), [_run_label(r) for r in rs], fontsize=7)
        ax.set_ylabel("tokens/s per GPU")
        flops = rs[0].get("flops") or {}
        size = (f": {flops['total_params'] / 1e9:.3g}B params, {flops['active_params'] / 1e9:.3g}B active"
                if {"total_params", "active_params"} <= flops.keys() else "")
        ax.set_title(f"{model}{size}", fontsize=10)
        bottom = [0.0] * len(rs)
        for key, color in BREAKDOWN_COLORS.items():
            vals = [((r.get("breakdown") or {}).get("summary_ms") or {}).get(key, 0.0) for r in rs]
            ax2.bar(range(len(rs)), vals, bottom=bottom, color=color, label=key)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax2.set_xticks(range(len(rs)), [_run_label(r) for r in rs], fontsize=7)
        ax2.set_ylabel("profiled step (ms)")
        ax2.set_title("where the step goes (exclusive GPU time)", fontsize=10)
        if j == 0:
            ax2.legend(fontsize=7, loc="best")
        for r in rs:
            mfu = f"{100 * r['mfu']:5.1f}%" if r.get("mfu") is not None else "     -"
            print(f"{model:12s} {r['configuration']:14s} {str(r.get('dispatch', '')):24s} "
                  f"{r['tokens_per_s_per_gpu']:11,.0f} {mfu}  {r.get('setting') or ''}")
    devices = sorted({device_name(r["device"]) for r in runs})
    title = (f"Trainer throughput per GPU (bench_train.py), {' + '.join(devices)}, torch {runs[0].get('torch')}, "
             f"triton {runs[0].get('triton')}: {source}")
    fig.suptitle(textwrap.fill(title, int(13 * fig.get_figwidth())), fontsize=10)
    top = 0.96
    if settings != [None]:  # one color per setting, named above the panels
        handles = [plt.Rectangle((0, 0), 1, 1, color=palette[s]) for s in settings]
        handles.append(plt.Line2D([], [], ls="--", color="k", lw=1))
        labels = [str(s) for s in settings] + ["best 1 GPU rate (ceiling)"]
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.965), ncol=2, fontsize=7)
        top = 0.97 - 0.018 * ((len(labels) + 1) // 2)
    fig.tight_layout(rect=(0, 0, 1, top))
    return _save(fig, out)


# --- loss curves ---------------------------------------------------------------------------

def loss_inputs(results: Path) -> Optional[tuple[Optional[tuple[Path, dict]], list[tuple[Path, list[dict]]]]]:
    """The newest ``train_ep_levers_*.json`` with ``graphs_vs_eager`` curves, and every
    trainer metrics file ``train_*.jsonl`` with loss records; None when there are neither."""
    levers = [(p, d) for p in sorted(results.glob("train_ep_levers_*.json"))
              if isinstance(d := _load(p), dict) and isinstance(d.get("graphs_vs_eager"), dict)]
    metrics = []
    for path in sorted(results.glob("train_*.jsonl")):
        records = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "loss" in record and "step" in record:
                records.append(record)
        if records:
            metrics.append((path, records))
    if not levers and not metrics:
        return None
    return (max(levers, key=lambda c: file_date(c[0])) if levers else None), metrics


def plot_losses(levers: Optional[tuple[Path, dict]], metrics: list[tuple[Path, list[dict]]], out: Path) -> Path:
    """``loss_curves.png``: a panel of ``graphs_vs_eager`` runs ([loss, grad norm] per step)
    and one of the metrics files, whichever exist."""
    plt = _pyplot()
    panels = int(levers is not None) + int(bool(metrics))
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4.8), squeeze=False)
    col = 0
    if levers is not None:
        path, data = levers
        curves = data["graphs_vs_eager"]
        ax = axes[0][col]
        runs = [(name, points) for name, points in curves.items() if isinstance(points, list) and points]
        for (name, points), style in zip(runs, ("-", "--", ":", "-.") * len(runs)):  # curves that coincide stay visible
            ax.plot(range(1, len(points) + 1), [p[0] for p in points], ls=style, marker=".", label=name)
        ax.set_title(textwrap.fill(f"{device_name(data.get('device', ''))}: {curves.get('what', '')} "
                                   f"({path.name})", 80), fontsize=8)
        col += 1
    if metrics:
        ax = axes[0][col]
        for path, records in metrics:
            ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=".", label=path.stem)
        ax.set_title(textwrap.fill("launch/train.py metrics files (--metrics-file): "
                                   + ", ".join(p.name for p, _ in metrics), 80), fontsize=8)
    for ax in axes[0]:
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.legend(fontsize=8)
    fig.suptitle("Training loss curves")
    fig.tight_layout()
    return _save(fig, out)


def hf_train_files(results: Path) -> list[tuple[Path, list[dict]]]:
    """The newest ``hf_train_*.json`` of each GPU count (``benchmarks/run_train_hf_gpu.sh``'s
    ``hf_train_<device>_x<N>.json``: bench_train runs of an HF model, ep_moe's experts and
    transformers' own), fewest GPUs first."""
    newest: dict[int, tuple[Path, list[dict]]] = {}
    for path in sorted(results.glob("hf_train_*.json"), key=file_date):
        runs = train_runs([path])
        if runs:
            newest[max(r.get("world_size", 1) for r in runs)] = (path, runs)
    return [newest[world] for world in sorted(newest)]


def _hf_configuration(run: dict) -> str:
    layout = "1 GPU" if run.get("world_size", 1) == 1 else run.get("configuration", f"{run['world_size']} GPUs")
    return layout + (", compiled" if _compiled(run) else "")


def _compiled(run: dict) -> bool:
    """Whether the run compiled the model's decoder layers (``training.compile``)."""
    return "training.compile=true" in run.get("overrides", [])


def plot_hf_train(chosen: list[tuple[Path, list[dict]]], out: Path) -> Path:
    """``train_hf.png``: tokens/s per GPU of each timed run (precision regime, GPUs and layout,
    experts), ep_moe's speedup over transformers' grouped_mm of the same regime and GPU count on
    its bar; beside it, the loss curves of the long runs (every step's loss), which should lie on
    each other."""
    plt = _pyplot()
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(15, 5))
    runs = [r for _, file_runs in chosen for r in file_runs]
    timed = [r for r in runs if len(r.get("losses") or []) < 50]
    regime_names = {"bfloat16": "pure bf16", "float32": "fp32 master"}
    order = {"grouped_mm": 0, "ep_moe": 1}
    timed.sort(key=lambda r: (r.get("world_size", 1), r["param_dtype"], _compiled(r), r.get("ep_size", 1),
                              order.get(r["experts"], 2)))
    colors = {"ep_moe": "tab:blue", "grouped_mm": "tab:orange"}
    for i, run in enumerate(timed):
        bars.bar(i, run["tokens_per_s_per_gpu"], 0.7, color=colors.get(run["experts"], "tab:gray"))
        note = f"{run['step_ms']:.1f} ms\nMFU {100 * run['mfu']:.1f}%"
        base = next((b for b in timed if b["experts"] == "grouped_mm" and b["param_dtype"] == run["param_dtype"]
                     and b.get("world_size", 1) == run.get("world_size", 1) and _compiled(b) == _compiled(run)), None)
        if run["experts"] != "grouped_mm" and base is not None:
            note += f"\n{run['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.2f}x"
        bars.annotate(note, (i, run["tokens_per_s_per_gpu"]), ha="center", va="bottom", fontsize=7)
    bars.set_xticks(range(len(timed)), [f"{_hf_configuration(r)}\n{regime_names.get(r['param_dtype'], r['param_dtype'])}"
                                        for r in timed], fontsize=7)
    from matplotlib.patches import Patch
    bars.legend(handles=[Patch(color=colors["ep_moe"], label="ep_moe experts"),
                         Patch(color=colors["grouped_mm"], label="transformers grouped_mm experts")],
                fontsize=8, loc="lower right")
    bars.set_ylabel("tokens/s per GPU")
    bars.margins(y=0.25)
    first = timed[0] if timed else runs[0]
    bars.set_title(textwrap.fill(f"{first['model']}, {first['tokens_per_step']} tokens/step per GPU, "
                                 f"{device_name(first['device'])}: the trainer's step; the speedup is over "
                                 "grouped_mm at the same GPU count, regime and compilation", 80), fontsize=9)
    for run in (r for r in runs if len(r.get("losses") or []) >= 50):
        seed = next((o.split("=", 1)[1] for o in run.get("overrides", []) if o.startswith("training.seed=")), "0")
        curves.plot(range(1, len(run["losses"]) + 1), run["losses"], lw=1,
                    label=f"{run['experts']} {_hf_configuration(run)} ({run['param_dtype']} params, seed {seed})")
    curves.set_xlabel("step")
    curves.set_ylabel("training loss")
    curves.set_yscale("log")
    curves.legend(fontsize=8)
    curves.set_title("loss curves: the same data and init (seed 0), and another seed for scale", fontsize=9)
    fig.suptitle(f"An HF model in the trainer ({', '.join(path.name for path, _ in chosen)})")
    fig.tight_layout()
    return _save(fig, out)


# --- FP8 experts against bf16 ------------------------------------------------------------

def fp8_parity_files(results: Path) -> dict[str, tuple[Path, dict]]:
    """Per device, the newest ``fp8_parity_*.json`` with trainer runs (empty when there is none)."""
    groups = defaultdict(list)
    for path in sorted(results.glob("fp8_parity_*.json")):
        data = _load(path)
        if isinstance(data, dict) and isinstance(data.get("runs"), list) and any(
                isinstance(r, dict) and {"config", "expert_precision", "loss"} <= r.keys() for r in data["runs"]):
            groups[device_name(data.get("device", "unknown"))].append((path, data))
    return _newest_complete(groups, lambda c: (), lambda c: [c[0]])


def fp8_parity_runs(data: dict) -> dict[str, dict[str, dict]]:
    """``{config: {precision: run}}``: the last run of each (config, precision) in the file,
    leaving out the runs kept for an older throughput (``note`` starting with "before")."""
    runs: dict[str, dict[str, dict]] = defaultdict(dict)
    for run in data["runs"]:
        if (isinstance(run, dict) and {"config", "expert_precision", "loss"} <= run.keys()
                and not str(run.get("note") or "").lower().startswith("before")):
            runs[run["config"]][run["expert_precision"]] = run
    return dict(runs)


def plot_fp8_parity(chosen: dict[str, tuple[Path, dict]], out: Path, first_step: int = 50) -> Path:
    """``fp8_parity.png``: for the newest device file, one panel per configuration: each
    precision's training loss from ``first_step`` on (the first steps' loss is 10x the rest),
    its val losses as markers; the final val losses, their relative difference (fp8 against
    bf16) and the median tokens/s of each precision in the title."""
    plt = _pyplot()
    path, data = max(chosen.values(), key=lambda c: file_date(c[0]))
    configs = fp8_parity_runs(data)
    styles = {"bf16": ("tab:blue", "-", "o"), "fp8": ("tab:red", "--", "s")}
    fig, axes = plt.subplots(1, len(configs), figsize=(7 * len(configs), 5.2), squeeze=False)
    for ax, (config, runs) in zip(axes[0], configs.items()):
        for precision, run in sorted(runs.items()):
            color, ls, marker = styles.get(precision, ("tab:gray", ":", "^"))
            points = [(s, v) for s, v in run["loss"] if s >= first_step]
            tps = run.get("median_tokens_per_s")
            label = f"{precision} train loss ({tps:,.0f} tokens/s" if tps else f"{precision} train loss ("
            ax.plot(*zip(*points), color=color, ls=ls, lw=1, label=f"{label}, commit {run.get('commit', '?')})")
            val = sorted((int(s), v) for s, v in (run.get("val_loss") or {}).items())
            if val:
                ax.plot(*zip(*val), ls="", marker=marker, ms=7, mfc="none", mew=1.5, color=color,
                        label=f"{precision} val loss")
        lines = [f"{config}: {data.get('device', '?')}, {max(r.get('steps', 0) for r in runs.values())} steps"]
        finals = {p: r["final_val_loss"] for p, r in runs.items() if r.get("final_val_loss") is not None}
        if finals:
            lines.append("final val loss " + ", ".join(f"{p} {v:.4f}" for p, v in sorted(finals.items()))
                         + (f" (fp8 {(finals['fp8'] - finals['bf16']) / finals['bf16']:+.3%})"
                            if {"bf16", "fp8"} <= finals.keys() else ""))
        rates = {p: r["median_tokens_per_s"] for p, r in runs.items() if r.get("median_tokens_per_s")}
        if rates:
            lines.append("median tokens/s " + ", ".join(f"{p} {v:,.0f}" for p, v in sorted(rates.items()))
                         + (f" (fp8 {rates['fp8'] / rates['bf16']:.3f}x)" if {"bf16", "fp8"} <= rates.keys() else ""))
        ax.set_title("\n".join(lines), fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(f"FP8 experts against bf16 in the trainer ({path.name}, {data.get('date', '')}, "
                               f"torch {data.get('torch')}, triton {data.get('triton')}): {data.get('what', '')}",
                               int(15 * fig.get_figwidth())), fontsize=9)
    fig.tight_layout()
    return _save(fig, out)


# --- command line --------------------------------------------------------------------------

def _draw_train(chosen: dict[str, tuple[Path, list[dict]]], out: Path) -> Path:
    runs = [r for _, file_runs in chosen.values() for r in file_runs]
    return plot_train(runs, out, ", ".join(path.name for path, _ in chosen.values()))


def _draw_losses(inputs: tuple[Optional[tuple[Path, dict]], list[tuple[Path, list[dict]]]], out: Path) -> Path:
    return plot_losses(*inputs, out)


# name: (PNG, the results it reads, what picks them from the directory (falsy: none), what draws them)
FIGURES = {
    "gemm": ("gemm_tflops.png", "grouped_gemm_*.json", gemm_files, plot_gemm),
    "ep": ("layer_vs_ep.png", "bench_ep ep_*.json", ep_series, plot_ep),
    "train": ("train_scaling.png", "bench_train train_*.json", train_files, _draw_train),
    "loss": ("loss_curves.png", "train_ep_levers_*.json or train_*.jsonl", loss_inputs, _draw_losses),
    "hf_train": ("train_hf.png", "bench_train --hf-model hf_train_*.json", hf_train_files, plot_hf_train),
    "fp8_parity": ("fp8_parity.png", "trainer bf16/fp8 fp8_parity_*.json", fp8_parity_files, plot_fp8_parity),
}


def make_plots(results: Path = RESULTS, out_dir: Optional[Path] = None,
               only: Sequence[str] = tuple(FIGURES)) -> list[Path]:
    """Draw the figures of ``only`` from ``results`` into ``out_dir`` (default
    ``<results>/plots``); a figure whose inputs are missing is skipped with a line saying so.
    Returns the PNGs written."""
    out_dir = out_dir or results / "plots"
    written = []
    for name in only:
        png, reads, pick, draw = FIGURES[name]
        inputs = pick(results)
        if inputs:
            written.append(draw(inputs, out_dir / png))
        else:
            print(f"skipped {png}: no {reads} results in {results}")
    return written


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS, help="results directory (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="PNG directory (default: RESULTS/plots)")
    parser.add_argument("--only", default=",".join(FIGURES),
                        help=f"comma-separated figures to draw, of {', '.join(FIGURES)} (default: all)")
    args = parser.parse_args(argv)
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(only) - set(FIGURES))
    if unknown:
        parser.error(f"--only {args.only!r}: unknown figure(s) {', '.join(unknown)}; choose from {', '.join(FIGURES)}")
    if not args.results.is_dir():
        parser.error(f"--results {args.results}: no such directory")
    if not make_plots(args.results, args.out, only):
        raise SystemExit(f"plot.py: no results to plot in {args.results}")


if __name__ == "__main__":
    main()
