"""The ``ep-moe`` console script: ``autotune`` (per-node warmup), ``cache`` housekeeping and
``train`` (the trainer, :func:`ep_moe.train.train.main`, which parses its own options).

Thin by design: parse, call public functions of :mod:`ep_moe.autotune`, print. Every
failure the user can fix ends in one line on stderr and a non-zero exit status (2: bad
arguments; 1: the machine or the cache directory), never a traceback.
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
from ep_moe.autotune.coordinate import MAX_WARMUP_TIMEOUT, target_buckets
from ep_moe.autotune.bench import Tuner
from ep_moe.autotune.cache import CacheDirError, default_cache, load_model_shape, printable, read_file
from ep_moe.autotune.space import ELEMENT_BYTES, GemmProblem
from ep_moe.configs import preset_names
from ep_moe.kernels.config import PASSES


DESCRIPTION = "Tune the grouped GEMM kernels of ep_moe on this node, manage their cache, and train."
EXAMPLES = """examples:
  ep-moe autotune --model mixtral-8x7b --ep-size 1 --tokens 8192
  ep-moe autotune --model qwen3-30b-a3b --ep-size 8 --dry-run
  torchrun --nproc-per-node 8 -m ep_moe.cli autotune --model deepseek-v3 --ep-size 8 --tokens 8192
  ep-moe cache list | show KEY | clear | path
  ep-moe train --steps 50     (several processes: torchrun --nproc-per-node 2 -m ep_moe.train)"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ep-moe", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log which source served each config")
    sub = parser.add_subparsers(dest="command", required=True)

    tune = sub.add_parser("autotune", help="tune (or load) kernel configs of a model's MoE layer and cache them "
                                           "(needs a CUDA GPU)")
    tune.add_argument("--model", required=True,
                      help=f"a model shape preset ({', '.join(preset_names('models'))}) or a JSON file")
    tune.add_argument("--ep-size", type=int, default=1, help="expert-parallel size (local experts = E / ep-size)")
    tune.add_argument("--tokens", type=int, nargs="+", default=None,
                      help="tokens per rank to tune for (default: the standard row buckets)")
    tune.add_argument("--dtype", default="bfloat16", choices=sorted(ELEMENT_BYTES))
    tune.add_argument("--force", action="store_true", help="retune even if cached")
    tune.add_argument("--timeout", type=float, default=3600.0,
                      help="seconds rank 0 may wait for cache locks and tuning shares (the other ranks: "
                           f"that plus a grace); > 0 and at most {MAX_WARMUP_TIMEOUT:.0f} (a week)")
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")
    tune.add_argument("--dry-run", action="store_true",
                      help="print the grouped GEMM problems and row buckets it would tune, and stop (no GPU needed)")

    cache = sub.add_parser("cache", help="inspect or clear the autotune cache")
    cache_sub = cache.add_subparsers(dest="action", required=True)
    cache_sub.add_parser("list", help="one line per file of the cache directory (invalid and foreign ones marked)")
    show = cache_sub.add_parser("show", help="print one cache file")
    show.add_argument("key", help="file name, digest, or a unique prefix of either")
    cache_sub.add_parser("clear", help="delete the files the cache wrote and their lock files (each under its "
                                       "lock); anything else is listed and left alone")
    cache_sub.add_parser("path", help="print the cache directory")

    sub.add_parser("train", add_help=False, help="train a MoE model in this process (ep-moe train --help lists the "
                                                 "trainer's options; several: torchrun -m ep_moe.train)")
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


NO_GPU = ("ep-moe autotune: tuning times the Triton kernels on a CUDA GPU, and torch sees none here "
          "(torch.cuda.is_available() is False); run it on a GPU node. Without tuning, the layer serves "
          "the shipped configs or the shape heuristic.")


def _can_tune() -> bool:
    """A CUDA GPU, or the Triton interpreter asked for (``TRITON_INTERPRET=1``: tests only)."""
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _dry_run(problems: list[GemmProblem], tokens: list[int] | None) -> str:
    """One line per problem: what ``autotune`` would tune, and for which row buckets."""
    lines = []
    for p in problems:
        buckets = ",".join(str(b) for b in target_buckets(p, tokens))
        lines.append(f"{p.projection} e{p.num_local_experts} n{p.n} k{p.k} top{p.top_k} {p.dtype}  rows {buckets}")
    return "\n".join(lines)


def _autotune(args: argparse.Namespace) -> int:
    problems = load_model_shape(args.model).problems(args.ep_size, args.dtype)
    if args.dry_run:
        print(_dry_run(problems, args.tokens))
        return 0
    if not _can_tune():
        print(NO_GPU, file=sys.stderr)
        return 1
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


def _say(line: str) -> None:
    """Print ``line`` as one printable line: names and contents of the cache directory may
    hold bytes that are not UTF-8, or control characters."""
    print(printable(line))


def _list(cache) -> int:
    entries = cache.entries()
    if not entries:
        where = "" if cache.directory.exists() else " (the directory does not exist yet)"
        _say(f"cache is empty: {cache.directory}{where}")
    for entry in entries:
        name = entry.path.name
        if entry.kind == "foreign":
            _say(f"{name}  FOREIGN: {entry.detail}; `ep-moe cache clear` leaves it alone")
        elif entry.kind == "invalid":
            _say(f"{name}  INVALID: {entry.detail}")
        else:
            data = entry.record
            buckets = ",".join(sorted(data["buckets"], key=int))
            _say(f"{name}  {data['key']['device_name']}  rows={buckets}  updated={data.get('updated', '?')}")
    return 0


def _clear(cache) -> int:
    report = cache.clear()
    _say(f"removed {len(report.removed)} cache files from {cache.directory}")
    for path, why in report.kept:
        _say(f"left {path.name}: {why}")
    if report.failed:
        path, error = report.failed[0]
        print(f"ep-moe: error: could not remove {len(report.failed)} cache file(s) of {cache.directory} "
              f"(first: {path.name}: {error}); check that this user may write to that directory",
              file=sys.stderr)
        return 1
    return 0


def _show(cache, key: str) -> int:
    cache.entries()  # a directory that cannot be listed is reported as such
    path = cache.find(key)
    if path is None:
        print(f"no single cache file matches {key!r} in {cache.directory}; see `ep-moe cache list`",
              file=sys.stderr)
        return 1
    data, why = read_file(path)
    if data is None:
        print(f"{path} is invalid: {why}", file=sys.stderr)
        return 1
    print(json.dumps(data, indent=1, sort_keys=True, allow_nan=False))  # a record holds no NaN
    return 0


def _cache(args: argparse.Namespace) -> int:
    cache = default_cache()
    if args.action == "path":
        print(cache.directory)
        return 0
    if args.action == "clear":
        return _clear(cache)
    if args.action == "list":
        return _list(cache)
    return _show(cache, args.key)


def _train(argv: list[str]) -> int:
    """``ep-moe train``: the trainer's own main, which parses ``argv`` and exits 2 on a
    user error. Imported here: the other commands do not load the trainer."""
    from ep_moe.train.train import main as train_main

    train_main(argv, prog="ep-moe train")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ep-moe``; returns the exit status."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "train":  # everything after ``train`` is the trainer's
        return _train(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return _autotune(args) if args.command == "autotune" else _cache(args)
    except ValueError as e:
        print(f"ep-moe: error: {e}", file=sys.stderr)
        return 2
    except (CacheDirError, OSError) as e:
        print(f"ep-moe: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
