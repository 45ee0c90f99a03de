"""Host cost of one eager MoE layer call, counted on a CPU: a proxy for the GPU's host time
(``benchmarks/bench_host.py``) that needs no GPU.

The Triton kernels run in the interpreter (``TRITON_INTERPRET=1``) with every launch faked
(counted, not run: outputs are garbage, nothing reads them on the host), and the value
checks that cost a host sync on a GPU, and so run there only in debug mode, are turned off
as on a GPU (``ep_moe.kernels.ops.value_checks``). Per call, for the forward (under
``no_grad``, as ``bench_host.py`` times it) and the forward + backward:

- ``py_calls``: Python function calls (cProfile's total, builtins included);
- ``torch_ops``: aten ops dispatched (a ``TorchDispatchMode`` counter, views included);
- ``launches``: Triton kernel launches;
- ``wall_us``: CPU time per call, launches faked, no profiler (the fastest of the rounds:
  still noisy on a loaded machine, where the counts are exact). The plain layer's includes
  its ``torch._grouped_mm`` computing on the CPU, which ep_moe's faked launches skip.

for ep_moe's layer at EP=1 (``backend="triton"``) on its fused kernels (``ep_moe[kernels]``:
larger calls, CUDA graphs, compile), on its small-call path (``ep_moe[grouped_mm]``: what an
eager bf16 call of few rows runs on a Hopper GPU, :mod:`ep_moe.grouped_mm_experts`, computing
on the CPU here), and the plain ``torch._grouped_mm`` layer (``benchmarks/baselines.py``: no
Triton). Under torchrun (gloo, one process a rank) the same at EP = the world size, for the
all-gather and the all-to-all dispatch (``ep_moe[all_gather,kernels]``, ...)::

    python benchmarks/host_proxy.py                      # hidden 256, 128 experts, top 8, 16 tokens, bf16
    python benchmarks/host_proxy.py --tokens 64 --profile 25   # and cProfile's top 25 functions
    torchrun --nproc-per-node 2 benchmarks/host_proxy.py       # EP=2 (rank 0 prints)

``tests/test_host_overhead.py`` bounds the counts of ep_moe's layer with :func:`measure`.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Callable, Iterator
from unittest import mock

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is decorated

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from baselines import PlainEPMoE  # noqa: E402

from ep_moe import MoEConfig, MoELayer  # noqa: E402


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def small_call_path() -> Iterator[None]:
    """Inside the block, the layer's small calls take the ``torch._grouped_mm`` path on the CPU
    too (as eager bf16 calls do on a Hopper GPU): its ops run for real."""
    with mock.patch("ep_moe.grouped_mm_experts._eager_bf16_where_it_runs", lambda x: True):
        yield


@contextlib.contextmanager
def faked_launches() -> Iterator[list[int]]:
    """Inside the block, Triton launches in the interpreter are counted (the list's one
    entry) and not run, and value checks are off as on a GPU."""
    from triton.runtime.interpreter import InterpretedFunction

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError("host_proxy needs TRITON_INTERPRET=1 set before triton kernels are decorated")
    launches = [0]

    def run(self, *args, grid, warmup, **kwargs):
        launches[0] += 1

    with mock.patch.object(InterpretedFunction, "run", run), \
            mock.patch("ep_moe.kernels.ops.value_checks", lambda device, debug=None: False), \
            mock.patch.dict(os.environ, {"EP_MOE_DEBUG": "0"}):
        yield launches


def cases(layer: torch.nn.Module, x: torch.Tensor) -> dict[str, Callable[[], None]]:
    """The forward (under ``no_grad``) and the forward + backward, as ``bench_host.py`` (the
    parameters' gradients set to None first)."""
    dy = torch.randn_like(x)
    xg = x.detach().clone().requires_grad_()
    params = list(layer.parameters())

    def forward() -> None:
        with torch.no_grad():
            layer(x)

    def forward_backward() -> None:
        for p in params:  # as after zero_grad(set_to_none=True): on the CPU, adding to the
            p.grad = None  # experts' .grad would take most of the time
        layer(xg).backward(dy)

    return {"fwd": forward, "fwd+bwd": forward_backward}


def measure(fn: Callable[[], None], calls: int = 5, rounds: int = 5, profile: int = 0) -> dict[str, float]:
    """Per-call counts of ``fn`` (already warm) with the launches faked; ``rounds`` of
    ``calls`` calls timed for ``wall_us`` (0: not timed); ``profile``: print cProfile's top
    functions by own time."""
    with faked_launches() as launches:
        fn()  # warm: first-call caches
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        stats = pstats.Stats(prof)
        with _OpCounter() as ops:
            before = launches[0]
            for _ in range(calls):
                fn()
        result = {"py_calls": stats.total_calls / calls, "torch_ops": ops.count / calls,
                  "launches": (launches[0] - before) / calls}
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append(1e6 * (time.perf_counter() - start) / calls)
        result["wall_us"] = min(times) if times else 0.0
    if profile:
        stats.sort_stats("tottime").print_stats(profile)
    return result


def build(hidden: int, intermediate: int, num_experts: int, top_k: int, dtype: torch.dtype,
          group=None) -> dict[str, tuple[torch.nn.Module, Callable[[], contextlib.AbstractContextManager]]]:
    """{name: (layer, context to call it in)}: ep_moe's layer on the Triton backend, on its
    kernels and on its small-call path, and the plain layer with its weights; at EP=1, or
    with ``group`` at EP = its size, once per dispatch (all-gather, all-to-all)."""
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=hidden, intermediate_size=intermediate, num_experts=num_experts, top_k=top_k,
                    backend="triton")
    dispatches = [""] if group is None else ["all_gather", "all_to_all"]
    layers = {}
    for dispatch in dispatches:
        ours = MoELayer(cfg if not dispatch else dataclasses.replace(cfg, dispatch=dispatch), group, dtype=dtype)
        prefix = f"{dispatch}," if dispatch else ""
        layers[f"ep_moe[{prefix}kernels]"] = (ours, contextlib.nullcontext)
        layers[f"ep_moe[{prefix}grouped_mm]"] = (ours, small_call_path)
        layers.setdefault("plain", (PlainEPMoE.like(ours), contextlib.nullcontext))
    return layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print cProfile's top N functions (own time) of each case")
    args = parser.parse_args()
    torch.set_num_threads(1)  # steadier times; the counts do not depend on it
    group = None
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:  # under torchrun: EP = the world
        dist.init_process_group("gloo")
        group = dist.group.WORLD
    show = group is None or dist.get_rank() == 0
    dtype = getattr(torch, args.dtype)
    layers = build(args.hidden, args.intermediate, args.experts, args.top_k, dtype, group)
    x = torch.randn(args.tokens, args.hidden, dtype=dtype)
    if show:
        print(f"EP={1 if group is None else dist.get_world_size()} T={args.tokens} H={args.hidden} "
              f"I={args.intermediate} E={args.experts} K={args.top_k} {args.dtype}")
    for name, (layer, context) in layers.items():
        for what, fn in cases(layer, x).items():
            if args.profile and show:
                print(f"===== {name} {what}")
            with context():
                r = measure(fn, args.calls, args.rounds, args.profile if show else 0)
            if show:
                print(f"{name:29s} {what:8s} py_calls {r['py_calls']:7.0f}  torch_ops {r['torch_ops']:5.0f}  "
                      f"launches {r['launches']:3.0f}  wall {r['wall_us']:8.1f} us", flush=True)
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
