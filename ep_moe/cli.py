"""The ``ep-moe`` console script: ``autotune`` (per-node warmup) and ``cache`` housekeeping.

Thin by design: parse, call public functions of :mod:`ep_moe.autotune`, print.

    ep-moe autotune --model mixtral-8x7b --ep-size 1 --tokens 8192
    torchrun --nproc-per-node 8 -m ep_moe.cli autotune --model deepseek-v3 --ep-size 8 --tokens 8192
    ep-moe cache list | show KEY | clear | path
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch
import torch.distributed as dist

from ep_moe.autotune import ResolvedConfigs, warmup
from ep_moe.autotune.coordinate import target_buckets
from ep_moe.autotune.bench import Tuner
from ep_moe.autotune.cache import default_cache, load_model_shape, read_file
from ep_moe.autotune.space import ELEMENT_BYTES, GemmProblem
from ep_moe.kernels.config import PASSES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ep-moe", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log which source served each config")
    sub = parser.add_subparsers(dest="command", required=True)

    tune = sub.add_parser("autotune", help="tune (or load) kernel configs of a model's MoE layer and cache them")
    tune.add_argument("--model", required=True, help="preset name in configs/models/ or a JSON file")
    tune.add_argument("--ep-size", type=int, default=1, help="expert-parallel size (local experts = E / ep-size)")
    tune.add_argument("--tokens", type=int, nargs="+", default=None,
                      help="tokens per rank to tune for (default: the standard row buckets)")
    tune.add_argument("--dtype", default="bfloat16", choices=sorted(ELEMENT_BYTES))
    tune.add_argument("--force", action="store_true", help="retune even if cached")
    tune.add_argument("--timeout", type=float, default=3600.0,
                      help="seconds rank 0 may wait for cache locks and tuning shares (the other ranks: "
                           "that plus a grace)")
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")

    cache = sub.add_parser("cache", help="inspect or clear the autotune cache")
    cache_sub = cache.add_subparsers(dest="action", required=True)
    cache_sub.add_parser("list", help="one line per cache file")
    show = cache_sub.add_parser("show", help="print one cache file")
    show.add_argument("key", help="file name, digest, or a unique prefix of either")
    cache_sub.add_parser("clear", help="delete every cache file (each under its lock; lock files stay)")
    cache_sub.add_parser("path", help="print the cache directory")
    return parser


def _summary(results: dict[GemmProblem, ResolvedConfigs], tokens: list[int] | None) -> str:
    """One line per problem, served bucket and pass."""
    header = ("problem", "rows", "pass", "source", "chosen", "ms", "default ms", "speedup")
    lines = [header]
    for p, r in results.items():
        name = f"{p.projection} e{p.num_local_experts} n{p.n} k{p.k} top{p.top_k} {p.dtype}"
        for bucket in sorted({r.bucket(rows) for rows in target_buckets(p, tokens)}):
            entry = r.table[bucket]
            for which in PASSES:
                best, default = entry.best_ms(which), entry.default_ms.get(which)
                speedup = f"{default / best:.2f}x" if best and default else "-"
                lines.append((name, str(bucket), which, r.source, entry.configs.for_pass(which).short(),
                              f"{best:.3f}" if best else "-", f"{default:.3f}" if default else "-", speedup))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in lines)


def _autotune(args: argparse.Namespace) -> int:
    problems = load_model_shape(args.model).problems(args.ep_size, args.dtype)
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched:  # under torchrun: the node's GPUs warm up together, rank 0 tunes
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    try:
        results = warmup(problems, timeout=args.timeout, num_tokens=args.tokens, force=args.force,
                         tuner=Tuner(progress=not args.no_progress))
        if not launched or dist.get_rank() == 0:
            print(_summary(results, args.tokens))
            print(f"cache: {default_cache().directory}")
    finally:
        if launched:
            dist.destroy_process_group()
    return 0


def _cache(args: argparse.Namespace) -> int:
    cache = default_cache()
    if args.action == "path":
        print(cache.directory)
    elif args.action == "clear":
        print(f"removed {cache.clear()} files from {cache.directory}")
    elif args.action == "list":
        for path in cache.files():
            data, why = read_file(path)
            if data is None:
                print(f"{path.name}  INVALID: {why}")
                continue
            key = data["key"]
            buckets = ",".join(sorted(data["buckets"], key=int))
            print(f"{path.name}  {key['device_name']}  rows={buckets}  updated={data.get('updated', '?')}")
    else:
        path = cache.find(args.key)
        if path is None:
            print(f"no single cache file matches {args.key!r} in {cache.directory}; see `ep-moe cache list`",
                  file=sys.stderr)
            return 1
        data, why = read_file(path)
        if data is None:
            print(f"{path} is invalid: {why}", file=sys.stderr)
            return 1
        print(json.dumps(data, indent=1, sort_keys=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ep-moe``; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return _autotune(args) if args.command == "autotune" else _cache(args)
    except ValueError as e:
        print(f"ep-moe: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
