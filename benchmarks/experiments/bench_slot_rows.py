"""The all-to-all's slot-row format (``ep_moe/ep/slot_rows.py``) against its main format, in
one run: wall time per eager call of the same all-to-all layer as shipped (small bf16 calls
vote for the slot rows) and forced onto the main format, beside the plain
``torch._grouped_mm`` layer, forward and forward + backward at 1 to 256 tokens a rank
(``bench_host.py``'s method: the layers take turns round by round, every round kept).

Under torchrun at EP = the world size (NCCL); alone on one GPU, the all-to-all dispatcher
without a group: the EP code path with no collective, the host work alone::

    torchrun --nproc-per-node 2 benchmarks/experiments/bench_slot_rows.py
    python benchmarks/experiments/bench_slot_rows.py
    torchrun --nproc-per-node 2 benchmarks/experiments/bench_slot_rows.py --device cpu --shape tiny   # smoke run

(On the CPU no call votes for the slot rows: both formats are the main one there.)

Also prints the relative difference of the two formats' outputs on one input. Results:
``benchmarks/experiments/results/slot_rows_<device>_ep<P>.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_host import TOKENS, build, cases, measure, sleep_cycles_per_s  # noqa: E402
from common import SHAPES, TINY, environment, save_results  # noqa: E402

import ep_moe.ep.all_to_all as all_to_all  # noqa: E402

LAYERS = ("slot_rows", "main_format", "plain")


@contextlib.contextmanager
def main_format():
    """Inside the block no rank votes for the slot rows: the all-to-all's main format."""
    vote = all_to_all.wants_slot_rows
    all_to_all.wants_slot_rows = lambda x_TH, num_slots: False
    try:
        yield
    finally:
        all_to_all.wants_slot_rows = vote


def forced_main_format(fn):
    def call():
        with main_format():
            fn()
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", help=f"one of {list(SHAPES)} or 'tiny'")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated tokens per rank")
    parser.add_argument("--calls", type=int, default=20, help="calls per round")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    torchrun = "RANK" in os.environ
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if torchrun:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    group = dist.group.WORLD if torchrun else None
    ep_size = dist.get_world_size() if torchrun else 1
    shape = TINY if args.shape == "tiny" else SHAPES[args.shape]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layers = build(shape, "all_to_all", group, device, dtype)
    ours, plain = layers["ep_moe[all_to_all]" if torchrun else "ep_moe[local]"], layers["plain"]
    if not torchrun:  # the EP code path, no group: no collective runs
        ours.dispatcher = all_to_all.AllToAllDispatcher(ours.config, None, 0, 1, ours.num_local_experts)
    rank0 = not torchrun or dist.get_rank() == 0
    cycles_per_s = sleep_cycles_per_s(device) if device.type == "cuda" else 0.0
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        x = torch.randn(tokens, shape.hidden, device=device, dtype=dtype)
        with torch.no_grad():
            y_slot_rows = ours(x).float()
            with main_format():
                y_main = ours(x).float()
        rel_diff = ((y_slot_rows - y_main).norm() / y_main.norm().clamp_min(1e-30)).item()
        ours_cases, plain_cases = dict(cases(ours, x)), dict(cases(plain, x))
        fns = {}
        for what in ("fwd", "fwd+bwd"):
            fns["slot_rows", what] = ours_cases[what]
            fns["main_format", what] = forced_main_format(ours_cases[what])
            fns["plain", what] = plain_cases[what]
        for fn in fns.values():
            fn()  # compile, allocate
        walls, hosts = measure(list(fns.values()), args.calls, args.rounds, device, cycles_per_s)
        timed = {key: (wall, host) for key, wall, host in zip(fns, walls, hosts)}
        for what in ("fwd", "fwd+bwd"):
            def ratio(a: str, b: str) -> float:  # median over the rounds of a's time over b's
                return statistics.median(p / q for p, q in zip(timed[a, what][0], timed[b, what][0]))

            median = {layer: statistics.median(timed[layer, what][0]) for layer in LAYERS}
            if rank0:
                print(f"{shape.name} EP={ep_size} T={tokens:4d} {what:8s} slot rows {median['slot_rows']:7.0f} us, "
                      f"main format {median['main_format']:7.0f}, plain {median['plain']:7.0f} | slot rows / plain "
                      f"{ratio('slot_rows', 'plain'):.3f}, main format / plain {ratio('main_format', 'plain'):.3f}, "
                      f"slot rows / main format {ratio('slot_rows', 'main_format'):.3f} | outputs differ by "
                      f"{rel_diff:.1e}", flush=True)
            for layer in LAYERS:
                rows.append(dict(layer=layer, tokens=tokens, call=what, wall_us=median[layer],
                                 wall_rounds_us=timed[layer, what][0], host_rounds_us=timed[layer, what][1],
                                 outputs_rel_diff=rel_diff))
    if rank0:
        env = environment()
        device_name = env["device"].replace(" ", "_")
        out = args.out or (REPO / "benchmarks" / "experiments" / "results"
                           / f"slot_rows_{device_name}_ep{ep_size}.json")
        save_results(out, {"benchmark": "slot_rows", "shape": shape.name, "ep_size": ep_size,
                           "dtype": str(dtype).removeprefix("torch."),
                           "calls": args.calls, "rounds": args.rounds, "results": rows})
        print(f"saved {out}")
    if torchrun:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
