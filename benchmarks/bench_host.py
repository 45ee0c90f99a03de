"""Time per eager call at few tokens, where the host sets the pace: ep_moe's layer against
the plain ``torch._grouped_mm`` layer (``benchmarks/baselines.py``), forward and forward +
backward, at 1 to 256 tokens a rank.

Two numbers per case:

- ``wall_us``: calls back to back, one sync per round of ``--calls``, divided by the calls
  (the median round): what an eager user waits per call at this size;
- ``host_us``: the same calls while the GPU is kept busy (``torch.cuda._sleep`` queued first),
  so no launch waits for the GPU: the host's own cost per call (the median round, and
  ``host_min_us`` the least disturbed one). A layer that syncs with the host (the
  all-to-all's split sizes) waits for the sleep: reported as ``syncs``.

The layers take turns round by round in a rotated order (:func:`measure`), and every
round's numbers are kept in the results: neighbouring runs of one layer on one machine have
differed by up to 2x, so compare layers measured in one run, over many rounds.

At EP=1 (``--ep-size 1``, every rank a replica) and EP = world (the dispatch of
``--dispatch``, default ``auto``, and the all-to-all)::

    torchrun --nproc-per-node 4 benchmarks/bench_host.py --shape qwen3-30b-a3b
    python benchmarks/bench_host.py --device cpu --dtype float32 --shape tiny   # smoke run

Results: ``benchmarks/results/host_<device>_ep<P>.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from baselines import PlainEPMoE  # noqa: E402
from common import SHAPES, TINY, MoEShape, environment, save_results  # noqa: E402

from ep_moe import MoEConfig, MoELayer  # noqa: E402
from ep_moe.grouped_mm_experts import GROUPED_MM_MAX_ROWS  # noqa: E402

TOKENS = (1, 4, 16, 64, 256)
BUSY_CALLS = 8
"""Calls per round while the GPU sleeps (the host-time measure)."""


def sleep_cycles_per_s(device: torch.device) -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per second, measured once."""
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize(device)
    return 100_000_000 / (time.perf_counter() - start)


def per_call_us(fn, calls: int, rounds: int, device: torch.device, sleep_cycles: int = 0) -> list[float]:
    """Microseconds per call of ``fn`` in each round (a round: ``calls`` calls, then one sync).
    With ``sleep_cycles`` a GPU sleep is queued ahead of each round and only the host's time
    to issue the calls counts (no launch waits for the GPU unless the layer syncs)."""
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            if sleep_cycles:
                torch.cuda._sleep(sleep_cycles)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host = time.perf_counter() - start
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
        times.append(1e6 * (host if sleep_cycles else wall) / calls)
    return times


def _sleep_s(wall_us: float, calls: int) -> float:
    """The GPU sleep ahead of a busy round: three times what the round takes when the GPU is
    free. Few calls a round (``BUSY_CALLS``): a sleeping GPU takes about a thousand queued
    launches before the host blocks, and a call launches up to about a hundred."""
    return max(3 * wall_us * min(calls, BUSY_CALLS) / 1e6, 0.02)


def measure(fns: list, calls: int, rounds: int, device: torch.device,
            cycles_per_s: float) -> tuple[list[list[float]], list[list[float]]]:
    """Per function, the microseconds per call of each round: wall (``calls`` calls, then a
    sync) and, on CUDA, host (``BUSY_CALLS`` calls behind a GPU sleep; empty lists on the CPU).
    The functions take turns round by round, in an order rotated every round, so a drift of
    the machine (clocks, other processes) spreads over all of them instead of favouring the
    one measured first. Every rank runs the same order (the layers' collectives match)."""
    walls = [per_call_us(fn, calls, 1, device) for fn in fns]  # a first round sizes the sleeps
    hosts: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for i in [(r + j) % len(fns) for j in range(len(fns))]:
            if r:
                walls[i] += per_call_us(fns[i], calls, 1, device)
            if device.type == "cuda":
                sleep = int(_sleep_s(statistics.median(walls[i]), calls) * cycles_per_s)
                hosts[i] += per_call_us(fns[i], min(calls, BUSY_CALLS), 1, device, sleep)
    return walls, hosts


def cases(layer: torch.nn.Module, x: torch.Tensor):
    """(name, fn) for the forward alone and the forward + backward."""
    dy = torch.randn_like(x)
    xg = x.detach().clone().requires_grad_()

    def forward():
        with torch.no_grad():
            layer(x)

    def forward_backward():
        layer(xg).backward(dy)

    return [("fwd", forward), ("fwd+bwd", forward_backward)]


def build(shape: MoEShape, dispatch: str, group, device, dtype) -> dict[str, torch.nn.Module]:
    """ep_moe's layer with ``dispatch`` (and the all-to-all too at EP>1) and the plain layer,
    doing the same work: no aux loss, as the plain layer computes none (``bench_ep.py`` too);
    and ep_moe with its default aux loss (``+aux``), what a training call costs."""
    cfg = MoEConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_experts=shape.num_experts,
                    top_k=shape.top_k, dispatch=dispatch, aux_loss_coef=0.0)
    torch.manual_seed(0)
    ours = MoELayer(cfg, group, device=device, dtype=dtype)
    layers = {f"ep_moe[{ours.dispatch}]": ours}
    variants = {f"ep_moe[{ours.dispatch}]+aux": dataclasses.replace(cfg, aux_loss_coef=MoEConfig.aux_loss_coef)}
    if group is not None and ours.dispatch != "all_to_all":
        variants["ep_moe[all_to_all]"] = dataclasses.replace(cfg, dispatch="all_to_all")
    for name, variant_cfg in variants.items():
        layers[name] = MoELayer(variant_cfg, group, device=device, dtype=dtype)
        layers[name].load_state_dict(ours.state_dict())
    layers["plain"] = PlainEPMoE.like(ours)
    return layers


def profile_host(layers: dict[str, torch.nn.Module], tokens: int, hidden: int, device: torch.device,
                 dtype: torch.dtype, calls: int, show: bool) -> None:
    """Print, per layer and call, cProfile's top functions by own time, the torch ops per
    call, and the profiler's table of host time by op, CUDA launches included (``--profile``)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    for name, layer in layers.items():
        for what, fn in cases(layer, x):
            fn()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                fn()
            prof.disable()
            with profile(activities=[ProfilerActivity.CPU]) as ops:
                for _ in range(calls):
                    fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if show:
                print(f"===== {name} {what} T={tokens}: cProfile over {calls} calls")
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)
                rows = sorted(ops.key_averages(), key=lambda e: -e.count)
                print(f"torch ops per call ({sum(e.count for e in rows) / calls:.0f} in all): " + ", ".join(
                    f"{e.key} {e.count / calls:g}" for e in rows[:30]))
                print("host time by op (self CPU, all calls):")
                print(ops.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", help=f"one of {list(SHAPES)} or 'tiny'")
    parser.add_argument("--ep-size", type=int, default=0, help="1: replicas; 0 (default): the world size")
    parser.add_argument("--dispatch", default="auto", help="ep_moe's MoEConfig.dispatch at EP>1")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated tokens per rank")
    parser.add_argument("--calls", type=int, default=20, help="calls per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", type=int, default=0, metavar="TOKENS",
                        help="instead of timing: where the host time of each layer's calls at TOKENS goes "
                             "(cProfile's top functions and the torch ops launched per call)")
    args = parser.parse_args()

    torchrun = "RANK" in os.environ
    device = torch.device(args.device)
    if torchrun:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world = dist.get_world_size() if torchrun else 1
    ep_size = args.ep_size or world
    group = dist.group.WORLD if ep_size > 1 else None
    shape = TINY if args.shape == "tiny" else SHAPES[args.shape]
    dtype = getattr(torch, args.dtype)
    layers = build(shape, args.dispatch, group, device, dtype)
    rank0 = not torchrun or dist.get_rank() == 0
    if args.profile:
        profile_host(layers, args.profile, shape.hidden, device, dtype, args.calls, rank0)
        if torchrun:
            dist.destroy_process_group()
        return
    rows = []
    cycles_per_s = sleep_cycles_per_s(device) if device.type == "cuda" else 0.0
    for tokens in map(int, args.tokens.split(",")):
        x = torch.randn(tokens, shape.hidden, device=device, dtype=dtype)
        timed = [(name, what, fn) for name, layer in layers.items() for what, fn in cases(layer, x)]
        for _, _, fn in timed:
            fn()  # compile, tune, allocate
        walls, hosts = measure([fn for _, _, fn in timed], args.calls, args.rounds, device, cycles_per_s)
        for (name, what, _), wall_rounds, host_rounds in zip(timed, walls, hosts):
            wall = statistics.median(wall_rounds)
            host = statistics.median(host_rounds) if host_rounds else None
            # a layer that syncs waits for the sleep (its round lasts it); one that does not is done well before
            syncs = host is not None and host * min(args.calls, BUSY_CALLS) / 1e6 > _sleep_s(wall, args.calls) / 2
            rows.append(dict(layer=name, tokens=tokens, call=what, wall_us=wall,
                             host_us=None if syncs else host, syncs=syncs,
                             host_min_us=None if syncs or not host_rounds else min(host_rounds),
                             wall_rounds_us=wall_rounds, host_rounds_us=host_rounds))
            if rank0:
                shown = "syncs" if syncs else ("-" if host is None else f"{host:8.1f} (min {min(host_rounds):8.1f})")
                print(f"{shape.name:14s} EP={ep_size} T={tokens:4d} {name:22s} {what:8s} "
                      f"wall {wall:8.1f} us  host {shown}", flush=True)
    if rank0:
        env = environment()
        out = args.out or REPO / "benchmarks" / "results" / (
            f"host_{env['device'].replace(' ', '_')}_{shape.name}_ep{ep_size}.json")
        save_results(out, {"benchmark": "host", "shape": shape.name, "grouped_mm_max_rows": GROUPED_MM_MAX_ROWS,
                           "ep_size": ep_size, "world_size": world,
                           "dtype": args.dtype, "calls": args.calls, "rounds": args.rounds, "results": rows})
        print(f"saved {out}")
    if torchrun:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
