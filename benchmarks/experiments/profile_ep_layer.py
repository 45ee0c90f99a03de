"""Where the EP>1 layer's time goes on each rank: compute, exposed communication, idle.

    torchrun --nproc-per-node 4 benchmarks/experiments/profile_ep_layer.py [--shapes qwen3-30b-a3b,mixtral-8x7b]

For each shape (the layer of ``bench_ep.py``: same config, seed and tokens), on every
rank: forward+backward time of the EP=P layer and of an EP=1 layer on the same GPU and
tokens (CUDA-event medians) with what the caching allocator did meanwhile (new and freed
segments, out-of-memory retries, reserved peak), the slots this rank's experts serve (load imbalance), then
one profiled step of the EP=P layer split, from the CUDA kernel timeline, into compute
kernels (union), communication kernels not overlapped by compute, and idle GPU time
(host syncs and launch gaps). ``--dispatch`` picks the EP layer's ``MoEConfig.dispatch``
(``all_to_all``, ``all_gather`` or ``all_gather_copy_engine``; the copy engines' memcpys
count as compute there, only NCCL's kernels as communication).
Optional: ``--top N`` GPU ops by time (of one EP=1 step, then one EP=P step; ``--launches S``
also each kernel whose name contains S, in launch order), ``--cprofile N``
Python functions by host time, ``--sync-check`` every host sync of one step with where it
happens, ``--trace DIR`` each rank's host + GPU timeline (gzipped Chrome trace), with ``--gaps N``
the largest GPU idle gaps and which host op launched the kernel after each. Parameter gradients are cleared before each
step, as ``bench_ep.py`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import cProfile
import gzip
import json
import os
import pstats
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import SHAPES, fixed_median_ms  # noqa: E402

from ep_moe import MoEConfig, MoELayer  # noqa: E402


def union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total / 1e3


def kernel_breakdown(step, top: int = 0, launches: str = "") -> dict:
    """One profiled ``step``: its GPU time split into compute, communication (and the part
    of it no compute overlaps) and idle; prints the ``top`` ops by time and, in launch
    order, each kernel whose name contains ``launches`` with its duration."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    kernels = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
               if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if top:
        totals: dict[str, list] = {}
        for s, e, n in kernels:
            entry = totals.setdefault(n[:90], [0.0, 0])
            entry[0] += (e - s) / 1e3
            entry[1] += 1
        for name, (ms, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"    {ms:8.3f} ms {calls:4d}x  {name}", flush=True)
    if launches:
        print("    " + " ".join(f"{(e - s) / 1e3:.3f}" for s, e, n in sorted(kernels) if launches in n)
              + f" ms: each '{launches}' kernel in launch order", flush=True)
    comm = [(s, e) for s, e, n in kernels if "nccl" in n.lower()]
    compute = [(s, e) for s, e, n in kernels if "nccl" not in n.lower()]
    gemm = [(s, e) for s, e, n in kernels if "grouped" in n]
    span = (max(e for _, e, _ in kernels) - min(s for s, _, _ in kernels)) / 1e3
    busy = union_ms(comm + compute)
    return dict(span_ms=span, compute_ms=union_ms(compute), gemm_ms=union_ms(gemm),
                comm_ms=union_ms(comm), comm_exposed_ms=busy - union_ms(compute), idle_ms=span - busy)


def allocator_churn(label: str, before: dict, after: dict) -> dict:
    """What the caching allocator did during the timed steps: new cudaMalloc'd segments
    and freed ones (each can stall the host), retries after an out-of-memory (each frees
    the cache and synchronizes), and the peak of reserved memory so far (GB)."""
    def grew(key: str) -> int:
        return int(after.get(key, 0) - before.get(key, 0))
    return {f"{label}_segments_new": grew("segment.all.allocated"), f"{label}_segments_freed": grew("segment.all.freed"),
            f"{label}_alloc_retries": grew("num_alloc_retries"),
            f"{label}_reserved_peak_gb": after.get("reserved_bytes.all.peak", 0) / 2**30}


def host_ms(label: str, layer, x, dy) -> dict:
    """Host time of one forward and one backward call started on an idle GPU (the forward's
    includes waiting for its host sync, if any)."""
    x.grad = layer.experts.gate_up.grad = layer.experts.down.grad = None
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    y = layer(x)
    t1 = time.perf_counter()
    y.backward(dy)
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    dist.barrier()
    return {f"{label}_host_fwd_ms": (t1 - t0) * 1e3, f"{label}_host_bwd_ms": (t2 - t1) * 1e3}


def host_profile(step, top: int, steps: int = 10) -> None:
    """cProfile of ``steps`` steps (every rank runs them; rank 0 with ``top`` > 0 prints)."""
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    if top:
        for key in ("tottime", "cumulative"):
            print(f"    --- host time of {steps} steps by {key}", flush=True)
            pstats.Stats(profiler, stream=sys.stdout).sort_stats(key).print_stats(top)


def export_trace(step, path: str, steps: int = 2, gaps: int = 0) -> None:
    """Host ops and GPU kernels of ``steps`` steps as a gzipped Chrome trace at ``path``
    (open in Perfetto); with ``gaps`` > 0, print the largest GPU idle gaps and the host op
    that launched the kernel ending each (what the GPU waited for)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            dst.write(src.read())
        if gaps:
            print_idle_gaps(json.load(open(raw))["traceEvents"], gaps)


def print_idle_gaps(events: list[dict], count: int) -> None:
    """The ``count`` largest GPU idle gaps of a trace, with the innermost host op around
    the launch of the kernel that ended each (profiler overhead inflates them all)."""
    spans = [e for e in events if e.get("ph") == "X"]
    gpu = sorted((e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in spans if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    host_ops = [e for e in spans if e.get("cat") in ("cpu_op", "python_function", "user_annotation")]
    if not gpu:
        return
    found, busy_until = [], gpu[0]["ts"] + gpu[0]["dur"]
    for e in gpu[1:]:
        if e["ts"] > busy_until:
            found.append((e["ts"] - busy_until, busy_until, e))
        busy_until = max(busy_until, e["ts"] + e["dur"])
    start = gpu[0]["ts"]
    print(f"    GPU idle: {sum(g for g, _, _ in found) / 1e3:.3f} ms in {len(found)} gaps; largest:", flush=True)
    for gap, at, kernel in sorted(found, key=lambda g: -g[0])[:count]:
        launch = launches.get(kernel["args"].get("correlation"))
        around = [o for o in host_ops if launch and o.get("tid") == launch.get("tid")
                  and o["ts"] <= launch["ts"] and o["ts"] + o["dur"] >= launch["ts"] + launch["dur"]]
        by = min(around, key=lambda o: o["dur"])["name"][:50] if around else "?"
        print(f"      {gap / 1e3:6.3f} ms at {(at - start) / 1e3:7.3f} ms, before {kernel['name'][:45]!r} "
              f"launched in {by!r}", flush=True)


def report_host_syncs(step) -> None:
    """Run one step with CUDA sync debugging on and print where each host sync happens."""
    seen = []

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f"{Path(f.filename).name}:{f.lineno}({f.name})" for f in traceback.extract_stack()[:-1]
                  if "ep_moe" in f.filename or "benchmarks" in f.filename]
        seen.append(f"{str(message).splitlines()[0][:60]} at {' < '.join(reversed(frames[-4:]))}")

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"    host syncs in one step: {len(seen)}", flush=True)
    for s in seen:
        print(f"      {s}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dispatch", default="all_to_all",
                        choices=("all_to_all", "all_gather", "all_gather_copy_engine"),
                        help="MoEConfig.dispatch of the EP layer")
    parser.add_argument("--top", type=int, default=0, help="rank 0 lists this many GPU ops by time")
    parser.add_argument("--launches", default="", help="with --top: rank 0 also lists, in launch order, the "
                        "duration of each kernel whose name contains this (e.g. _grouped)")
    parser.add_argument("--cprofile", type=int, default=0,
                        help="rank 0 lists this many Python functions by own and by cumulative host time "
                             "(cProfile over 10 steps)")
    parser.add_argument("--trace", default="", help="folder for each rank's gzipped Chrome trace (host and GPU)")
    parser.add_argument("--gaps", type=int, default=0, help="with --trace: rank 0 lists this many largest GPU "
                        "idle gaps and the host op before each")
    parser.add_argument("--sync-check", action="store_true", help="rank 0 lists the host syncs of one step")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        config = MoEConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                           num_experts=shape.num_experts, top_k=shape.top_k, aux_loss_coef=0.0,
                           backend="triton")
        ep_config = dataclasses.replace(config, dispatch=args.dispatch)
        torch.manual_seed(0)
        ep_layer = MoELayer(ep_config, dist.group.WORLD, device="cuda", dtype=torch.bfloat16)
        torch.manual_seed(0)
        one_layer = MoELayer(config, None, device="cuda", dtype=torch.bfloat16)
        gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
        x = torch.randn(args.tokens, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        x.requires_grad_()
        dy = torch.randn_like(x)
        row = {"rank": rank}
        for label, layer in (("ep1", one_layer), (f"ep{world}", ep_layer)):
            def step(layer=layer):
                x.grad = layer.experts.gate_up.grad = layer.experts.down.grad = None  # as bench_ep
                layer(x).backward(dy)
            dist.barrier()
            before = torch.cuda.memory_stats()
            row[f"{label}_ms"] = fixed_median_ms(step)
            row.update(allocator_churn(label, before, torch.cuda.memory_stats()))
            row.update(host_ms(label, layer, x, dy))
        counts = ep_layer.last_stats.tokens_per_expert.clone()
        dist.all_reduce(counts)
        local = counts.view(world, -1).sum(1)
        row["slots_served"] = int(local[rank])
        row["imbalance"] = float(local.max() / local.float().mean())

        def ep_step():
            x.grad = ep_layer.experts.gate_up.grad = ep_layer.experts.down.grad = None
            ep_layer(x).backward(dy)
        if rank == 0 and args.top:
            def one_step():
                x.grad = one_layer.experts.gate_up.grad = one_layer.experts.down.grad = None
                one_layer(x).backward(dy)
            print(f"--- {name} rank 0 GPU ops, one step at EP=1")
            kernel_breakdown(one_step, args.top, args.launches)
        if rank == 0:
            print(f"--- {name} rank 0 GPU ops, one step (dispatch {args.dispatch})")
        row.update(kernel_breakdown(ep_step, args.top if rank == 0 else 0, args.launches if rank == 0 else ""))
        if args.cprofile:
            host_profile(ep_step, args.cprofile if rank == 0 else 0)
        if args.sync_check and rank == 0:
            report_host_syncs(ep_step)
        elif args.sync_check:
            ep_step()
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            export_trace(ep_step, os.path.join(args.trace, f"trace_{name}_ep{world}_rank{rank}.json.gz"),
                         gaps=args.gaps if rank == 0 else 0)
        rows = [None] * world
        dist.all_gather_object(rows, row)
        if rank == 0:
            print(f"--- {name} (EP={world}, dispatch {args.dispatch})", flush=True)
            for r in rows:
                print("  " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                       for k, v in r.items()), flush=True)
        del ep_layer, one_layer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
