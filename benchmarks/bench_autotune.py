"""Autotune benchmark: tuned vs default vs heuristic configs of every grouped GEMM pass,
tuning time, and the time to serve cached configs, on the MoE shapes of ANCHORS.md.

Each shape is a model preset (``ep_moe/configs/models/``) at an expert-parallel size; its
problems are both expert projections at T tokens per rank (M = T*k routed rows).

1. tune: one ``ep_moe.autotune.warmup(..., force=True)`` over the distinct problems of all
   shapes into a fresh cache directory, timed end to end (data, compilation, benchmarking,
   the cache writes);
2. serve: per shape, the in-memory table dropped, ``get_kernel_configs`` for both
   projections timed from the cache files (the start of a warm job; target under 50 ms a
   layer), then the per-call cost once in memory;
3. compare: per shape, forward, dX and dW each run on the same data (the exact kernel mode
   of the projection, as the tuner saw it) with the default, the heuristic and the tuned
   config, validated against the default's output, then timed with
   ``triton.testing.do_bench`` (median). FLOPs = 2*M*N*K per pass. The tuned config should
   never be slower than the default beyond timing noise (flagged otherwise).

Under torchrun (2 or 4 GPUs) step 1 is the warmup of the whole group (split tuning: the
node's GPUs tune disjoint shares of all problems, rank 0 publishes) and checks that every
rank holds identical configs; rank 0 does step 2; step 3 is spread over the ranks (rank r
compares shapes r, r + world, ...) and gathered on rank 0.

    python benchmarks/bench_autotune.py [--tokens 8192] [--shapes mixtral-8x7b,deepseek-v3:8]
    torchrun --nproc-per-node 4 benchmarks/bench_autotune.py
    python benchmarks/bench_autotune.py --tiny        # CPU: Triton interpreter smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if "--tiny" in sys.argv:  # the interpreter must be on before any kernel is decorated (import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, environment, save_results  # noqa: E402

from ep_moe.autotune import Tuner, clear_memory_cache, device_limits, get_kernel_configs, warmup  # noqa: E402
from ep_moe.autotune.bench import PassLaunch, default_device, gpu_timer, time_configs, wall_clock_timer  # noqa: E402
from ep_moe.autotune.cache import ENV_CACHE_DIR, SHIPPED_DIR, device_dir_name, load_model_shape  # noqa: E402
from ep_moe.autotune.space import default_config, heuristic_config, initial_candidates  # noqa: E402
from ep_moe.kernels.config import PASSES  # noqa: E402

DEFAULT_SHAPES = "mixtral-8x7b,qwen3-30b-a3b,gpt-oss-20b,deepseek-v3:8"
NOISE = 0.03  # tuned may read this much slower than the default before it is flagged


def parse_shapes(text: str) -> list[tuple[str, int]]:
    """``name[:ep_size],...`` -> [(preset, ep_size)]."""
    out = []
    for item in text.split(","):
        name, _, ep = item.partition(":")
        out.append((name, int(ep or 1)))
    return out


def compare(problem, rows: int, tuned, dev, device, timer) -> list[dict]:
    """Default vs heuristic vs tuned for each pass of one problem, on one set of data."""
    lines = []
    flops = 2 * rows * problem.n * problem.k
    for which in PASSES:
        variants = {"default": default_config(problem, which, dev),
                    "heuristic": heuristic_config(problem, which, rows, dev),
                    "tuned": tuned.for_pass(which)}
        distinct = list(dict.fromkeys(variants.values()))
        launch = PassLaunch(problem, which, rows, device)
        timings, _ = time_configs(launch, distinct, problem.dtype, timer)
        ms = {name: (timings[distinct.index(c)].median_ms if timings[distinct.index(c)] else None)
              for name, c in variants.items()}
        line = {"pass": which, "rows": rows, "flops": flops,
                **{f"{name}_config": c.short() for name, c in variants.items()},
                **{f"{name}_ms": ms[name] for name in variants},
                **{f"{name}_tflops": flops / ms[name] / 1e9 if ms[name] else None for name in variants}}
        if ms["tuned"] and ms["default"]:
            line["speedup_vs_default"] = ms["default"] / ms["tuned"]
            line["slower_than_default"] = ms["tuned"] > ms["default"] * (1 + NOISE)
        if ms["tuned"] and ms["heuristic"]:
            line["speedup_vs_heuristic"] = ms["heuristic"] / ms["tuned"]
        lines.append(line)
        del launch
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return lines


def time_serving(problems, rows: int, device) -> dict:
    """Cold (from the cache files) and hot (in memory) cost of serving one layer's configs."""
    clear_memory_cache()
    start = time.perf_counter()
    served = [get_kernel_configs(p, rows, device) for p in problems]
    cold_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    for _ in range(1000):
        for p in problems:
            get_kernel_configs(p, rows, device)
    hot_us = (time.perf_counter() - start) * 1e6 / (1000 * len(problems))
    return {"cold_layer_ms": cold_ms, "hot_call_us": hot_us, "served": [s.forward.short() for s in served]}


def tune(problems, args, tuner: Tuner, distributed: bool) -> tuple[dict, dict]:
    """One timed warmup over every problem; under torchrun, whether all ranks got identical tables."""
    if distributed:
        dist.barrier()
    start = time.perf_counter()
    resolved = warmup(problems, num_tokens=args.tokens, force=True, tuner=tuner, timeout=args.timeout)
    summary = {"tune_s_total": time.perf_counter() - start, "num_problems": len(problems),
               "world_size": dist.get_world_size() if distributed else 1}
    if distributed:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [resolved[p].to_dict()["table"] for p in problems])
        summary["identical_on_all_ranks"] = all(g == gathered[0] for g in gathered)
    return resolved, summary


def print_record(r: dict) -> None:
    serve = r["serve"]
    print(f"{r['shape']} ep{r['ep_size']}: {r['sources']}; serving a layer from the cache "
          f"{serve['cold_layer_ms']:.1f} ms, in memory {serve['hot_call_us']:.1f} us/call", flush=True)
    for projection, lines in r["passes"].items():
        for x in lines:
            fmt = lambda v: f"{v:8.3f}" if v else "    fail"  # noqa: E731
            flag = "  SLOWER THAN DEFAULT" if x.get("slower_than_default") else ""
            print(f"  {projection:7s} {x['pass']:7s} default {fmt(x['default_ms'])} ms  heuristic "
                  f"{fmt(x['heuristic_ms'])} ms  tuned {fmt(x['tuned_ms'])} ms "
                  f"({(x['tuned_tflops'] or 0):.0f} TFLOP/s, {x.get('speedup_vs_default', 0):.2f}x default, "
                  f"{x.get('speedup_vs_heuristic', 0):.2f}x heuristic)  {x['tuned_config']}{flag}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated preset[:ep_size]")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--refine-top", type=int, default=2, help="second-round seeds per pass (0: none)")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: a fresh temporary directory")
    parser.add_argument("--ship", action="store_true",
                        help="copy the tuned cache files to ep_moe/autotune/shipped/<device>/")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke run: tiny shape, float32, 2 candidates, wall-clock timer")
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default: benchmarks/results/)")
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    if args.tiny:
        args.shapes, args.tokens, args.dtype = "tiny:1", 32, "float32"
        timer = lambda fn: wall_clock_timer(fn, repeats=2)  # noqa: E731
        tuner = Tuner(timer=timer, refine_top=0,
                      candidates=lambda p, w, rows, dev: initial_candidates(p, w, rows, dev)[:2])
    else:
        timer = gpu_timer
        tuner = Tuner(refine_top=args.refine_top)
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="ep_moe_autotune_"))
    if distributed:  # one directory for the node: rank 0's choice
        box = [str(cache)]
        dist.broadcast_object_list(box, src=0)
        cache = Path(box[0])
    os.environ[ENV_CACHE_DIR] = str(cache)
    is_root = not distributed or dist.get_rank() == 0
    env = environment()
    if is_root:
        print(f"device {env['device']}, torch {env['torch']}, triton {env['triton']}; cache {cache}", flush=True)
    try:
        shapes = parse_shapes(args.shapes)
        by_shape = [load_model_shape(name).problems(ep_size, args.dtype) for name, ep_size in shapes]
        rows = [args.tokens * problems[0].top_k for problems in by_shape]
        resolved, summary = tune(list(dict.fromkeys(p for ps in by_shape for p in ps)), args, tuner, distributed)
        device = default_device()
        if is_root:
            identical = f"; identical on all ranks: {summary['identical_on_all_ranks']}" if distributed else ""
            print(f"tuned {summary['num_problems']} problems in {summary['tune_s_total']:.1f} s on "
                  f"{summary['world_size']} rank(s){identical}", flush=True)
            serve = [time_serving(problems, n, device) for problems, n in zip(by_shape, rows)]
        rank, world = dist.get_rank() if distributed else 0, summary["world_size"]
        dev = device_limits(device)
        passes = {i: {p.projection: compare(p, rows[i], resolved[p].for_rows(rows[i]), dev, device, timer)
                      for p in by_shape[i]}
                  for i in range(rank, len(shapes), world)}  # this rank's share of the shapes
        if distributed:
            gathered = [None] * world
            dist.all_gather_object(gathered, passes)
            passes = {i: x for g in gathered for i, x in g.items()}
        if is_root:
            records = [{"shape": name, "ep_size": ep_size, "tokens": args.tokens,
                        "sources": {p.projection: resolved[p].source for p in by_shape[i]},
                        "serve": serve[i], "passes": passes[i]}
                       for i, (name, ep_size) in enumerate(shapes)]
            for record in records:
                print_record(record)
            suffix = f"_x{world}" if distributed else ""
            out = args.out or REPO / "benchmarks" / "results" / (
                f"autotune_{device_dir_name(env['device'])}{suffix}.json")
            save_results(out, {"tokens": args.tokens, "dtype": args.dtype, **summary, "records": records})
            print(json.dumps({"saved": str(out)}))
            if args.ship:
                ship = SHIPPED_DIR / device_dir_name(env["device"])
                ship.mkdir(parents=True, exist_ok=True)
                for f in cache.glob("*.json"):
                    shutil.copy(f, ship)
                print(json.dumps({"shipped": str(ship)}))
    finally:
        if distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
