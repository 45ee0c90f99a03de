"""Expert-parallel MoE layer benchmark: ep_moe against the layers users build today, in one run.

    torchrun --nproc-per-node P benchmarks/bench_ep.py [--shapes all] [--tokens 8192]
    torchrun --nproc-per-node 2 benchmarks/bench_ep.py --device cpu --shapes tiny   # smoke test
    torchrun --nproc-per-node 4 benchmarks/bench_ep.py --ep-size 1   # EP=1 on every GPU at once
    torchrun --nproc-per-node 2 benchmarks/bench_ep.py --fp8 --variants nccl,ag   # and FP8 experts (Hopper+)

``--ep-size S`` (default: every rank, S = P) splits the P ranks into P/S groups of S
(the expert-then-data layout of ``ep_moe.parallel``), each running its own layer at the
same time: data-parallel replicas, every rank timed, the slowest reported. EP=1 compared
with EP=P is fairest that way: under the GEMMs each GPU runs at the clock its power cap
allows, which differs from chip to chip (4x H200, mixtral: GPU 0 alone 1440 to 1515 MHz,
GPU 3 with all four busy 1245 MHz), and an EP=P step waits for the slowest of its GPUs.

For each shape of ANCHORS.md (benchmarks/common.py SHAPES; global expert count fixed, so
E/P experts per rank) and ``--tokens`` tokens per rank, one forward+backward of the whole
layer (router to combine, dX and every weight gradient) of:

- ``ep_moe``: :class:`ep_moe.MoELayer` (Triton grouped GEMM on CUDA, reference on CPU);
  at EP>1 one layer per ``--variants`` entry, a ``MoEConfig.dispatch`` by its short name
  (``VARIANTS``: ``nccl`` the all-to-all, ``ag`` the all-gather, ``agce`` the all-gather on
  the copy engines) or its full one, named ``ep_moe`` for the all-to-all and
  ``ep_moe_<short name>`` otherwise; with ``--compile`` each once more under
  ``torch.compile`` (``<name>+compile``); with ``--fp8`` each once more with FP8 experts
  (``MoEConfig(expert_precision="fp8")``, the same weights: ``<name>+fp8``; a dispatch that
  FP8 or the device refuses is skipped and said so), validated against the plain bf16 layer
  within the FP8 layer's bound (``FP8_MAX_REL_ERR``); the weights' e4m3 copies are made once
  (no optimizer steps here), so its time leaves out the weight quantization that training
  pays once per step;
- ``plain``: the torchtitan-style layer of ``baselines.py`` (argsort permute, uneven
  ``all_to_all_single``, ``torch._grouped_mm`` SwiGLU experts);
- ``deepspeed``: ``deepspeed.moe.layer.MoE`` (dropless, SwiGLU experts) when deepspeed
  imports; skipped otherwise.

All three hold the same weights (SwiGLU, softmax top-k renormalised, no aux loss) and see
the same tokens, so they route alike. Before timing, each layer's output and input
gradient are checked against the plain layer's (relative error, largest over ranks; a
layer above 2e-2 is not timed). Time: median over ``--iters`` CUDA-event-timed iterations
after ``--warmup``, per rank; the table shows the slowest rank's median (every rank's is
recorded). ``a2a`` is the forward dispatch and combine ``all_to_all_single`` alone, on the
split sizes of the same routing with rows as the layer sends them (ep_moe: one per token
and destination rank; the others: one per token and expert), and its share of the time.
FLOPs per rank: 3 * (2*T*k*H*2I + 2*T*k*I*H) = 18*T*k*H*I (T tokens per rank).

Routing (``--routing``): ``uniform`` (default) draws the tokens from N(0, 1), so the
random router spreads them about evenly. ``zipf`` skews it as training does (the
most-loaded expert at 1.5-2x the mean after warm-up, up to 8x in the first steps; with EP
the slowest rank sets the step time): expert popularity follows a Zipf law,
p_e ~ r(e)^-s (``--zipf-s`` s, default 1.0) over a random permutation r of the experts
(fixed seed, the same on every rank, so the hot experts fall on any rank). The method
shifts the inputs, not the layers, so that ep_moe, the plain layer and DeepSpeed, which
hold the same router weight W [E, H], see the same skewed routing and still validate
against each other: every token gets the same added vector v, the least-norm solution of
W v = beta * (log p - mean log p), so every token's router logits gain beta * log p_e
(+ a constant, which softmax ignores). The per-token logit noise x W^T is Gaussian with
std ||w_e|| (about init_std * sqrt(H)); beta = sqrt(6)/pi * rms_e ||w_e|| makes that
noise match a Gumbel of the same variance, for which the top-1 choice would be exactly
p_e (Gaussian noise gives roughly that; top-k spreads it: an expert holds at most every
token, E/k times the mean). Needs H >= E (every shape here). The load actually produced
is measured from the routing (top-k of the router on the tokens, the EP group's counts
summed) and reported for both modes: ``expert_load_max_mean`` (most-loaded expert over
the mean), ``rank_load_max_mean`` (the most-loaded rank's tokens-slots over the mean; 1.0
at EP=1), each the largest over EP groups, with ``routing`` and ``zipf_s`` in every row and
in the printed lines; ``ms`` stays the slowest rank's time. Measured max/mean expert
load (and rank load at EP=2/4/8), 16384 tokens, the layer's init (router std 0.02):

    s     mixtral (8, k2)       qwen3 (128, k8)       gpt-oss (32, k4)      deepseek (32, k8)
    0.2   1.28 (1.05/1.20/1.28) 2.72 (1.02/1.09/1.13) 1.76 (1.07/1.08/1.25) 1.54 (1.06/1.07/1.19)
    0.3   1.43 (1.08/1.30/1.43) 4.11 (1.03/1.14/1.21) 2.27 (1.11/1.12/1.41) 1.86 (1.09/1.10/1.29)
    0.5   1.75 (1.14/1.52/1.75) 7.22 (1.07/1.25/1.37) 3.32 (1.20/1.20/1.74) 2.46 (1.14/1.16/1.50)
    1.0   2.52 (1.29/2.05/2.52) 13.7 (1.16/1.46/1.68) 5.90 (1.39/1.44/2.54) 3.55 (1.26/1.31/1.90)
    1.5   3.15 (1.43/2.50/3.15) 15.7 (1.21/1.55/1.76) 7.33 (1.51/1.60/3.03) 3.93 (1.33/1.42/2.10)

and tiny (8 experts, top-2, 256 tokens on 2 ranks, the CPU test) 2.38 (1.27 at EP=2) at
s = 1. The Zipf law's own top-1 max/mean is E / H_E(s) (2.9x for 8 experts, 23x for 128 at
s = 1); top-k caps an expert at E/k times the mean. So s = 1.0 (the default) is the
early-training end (up to 8x; beyond it with 128 experts), s of 0.2-0.5 the 1.5-2x after
warm-up with 8 to 32 experts (128 experts: below 0.2). A ``zipf`` run saves to
``..._zipf<s>.json`` beside the uniform one.

Results: ``benchmarks/results/ep_<device>_ep<S>.json`` (``_dp<P/S>`` added with replicas,
``_fp8`` with ``--fp8``; ``--out`` to change), with the
device, torch, triton and deepspeed versions. Exit status 1 when ep_moe fails validation.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import PlainEPMoE, deepspeed_moe_like  # noqa: E402
from common import REPO, SHAPES, MoEShape, call_times, environment, save_results, synchronize  # noqa: E402

from ep_moe import MoEConfig, MoELayer  # noqa: E402
from ep_moe.experts import check_fp8_device  # noqa: E402
from ep_moe.ep.all_to_all import gather_counts, rank_splits, start_combine, start_dispatch  # noqa: E402
from ep_moe.parallel import build_ep_groups  # noqa: E402
from ep_moe.routing import rank_counts, route  # noqa: E402

# A shape small enough for the CPU smoke test (dims keep torch._grouped_mm's 16-byte strides).
TINY = MoEShape("tiny", 8, 64, 32, 2)
MAX_REL_ERR = 2e-2
FP8_MAX_REL_ERR = 1e-1
"""The FP8 layer against bf16 experts: 3.5-4.5e-2 per GEMM, two in a row (the bound of
``tests/gpu/test_fp8_layer_cuda.py``)."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="all", help=f"comma-separated names of {list(SHAPES)} or 'tiny', "
                                                        "or 'all'")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    parser.add_argument("--ep-size", type=int, default=0,
                        help="ranks per EP group (default: all); fewer runs world/ep-size data-parallel replicas "
                             "at once, e.g. 1 for EP=1 on every GPU")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per layer")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations per layer first")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every layer this many times, in rotated order; report the median round")
    parser.add_argument("--impls", default="ep_moe,plain,deepspeed", help="which layers to time")
    parser.add_argument("--variants", default="nccl",
                        help="ep_moe variants at EP>1, comma-separated MoEConfig.dispatch values by short "
                             "name, 'nccl' (all_to_all), 'ag' (all_gather), 'agce' (all_gather_copy_engine), "
                             "or full name; EP=1 runs the all-to-all only")
    parser.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                        help="also time each ep_moe layer under torch.compile (named <layer>+compile), "
                             "optionally with a torch.compile mode such as reduce-overhead (CUDA graphs; "
                             "named <layer>+compile-<mode>)")
    parser.add_argument("--graph", action="store_true",
                        help="also time each host-sync-free ep_moe layer (EP=1, or the 'ag' and 'agce' variants) "
                             "captured whole, forward and backward, in CUDA graphs (torch.cuda.make_graphed_callables; "
                             "named <layer>+graph)")
    parser.add_argument("--fp8", action="store_true",
                        help="also time each ep_moe variant with FP8 experts (expert_precision='fp8', same weights)")
    parser.add_argument("--routing", choices=("uniform", "zipf"), default="uniform",
                        help="expert popularity: uniform (random router on N(0,1) tokens) or zipf (tokens shifted "
                             "so that expert e's selection probability ~ rank(e)^-s over a random expert "
                             "permutation; see the module docstring)")
    parser.add_argument("--zipf-s", type=float, default=1.0,
                        help="Zipf exponent s of --routing zipf (0: uniform; 1.0: 8 experts top-2 about 2.4x "
                             "max/mean expert load)")
    parser.add_argument("--autotune", action="store_true",
                        help="run ep_moe.autotune.warmup for each shape first (may tune on rank 0)")
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default: benchmarks/results/)")
    return parser.parse_args()


def init(device_kind: str) -> torch.device:
    """Default process group from torchrun's environment (nccl on CUDA, gloo on CPU)."""
    if device_kind == "cpu":
        dist.init_process_group("gloo")
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device


def import_deepspeed(device: torch.device):
    """deepspeed, initialised on the default group, or None (with the reason printed)."""
    os.environ.setdefault("DS_ACCELERATOR", device.type)  # "cuda" or "cpu", not auto-detected
    try:
        import deepspeed
    except ImportError:
        print0("deepspeed: not installed")
        return None
    except Exception as exc:  # a broken install (missing dependency, accelerator detection)
        print0(f"deepspeed: import failed ({type(exc).__name__}: {exc}); skipped")
        return None
    if dist.get_world_size() > 1:
        deepspeed.init_distributed(dist_backend=dist.get_backend())
    return deepspeed


def print0(*args) -> None:
    """Print on rank 0 only."""
    if dist.get_rank() == 0:
        print(*args, flush=True)


def median_ms(run, setup, iters: int, warmup: int, device: torch.device) -> float:
    """Median time of ``run()`` in ms (CUDA events on GPU, wall clock on CPU); ``setup()``
    runs before each iteration, outside the timed region."""
    for _ in range(warmup):
        setup()
        run()
    synchronize(device)
    dist.barrier()
    times = call_times(run, setup, iters, device)
    return statistics.median(times)


def across_ranks(value: float, device: torch.device) -> list[float]:
    """``value`` of every rank, in rank order."""
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.item() for t in every]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against ``b``."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def forward_backward(forward, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, input gradient) of one forward and backward."""
    x = x.detach().requires_grad_()
    y = forward(x)
    y.backward(dy)
    return y.detach(), x.grad


def time_layer(forward, params: list[torch.Tensor], x: torch.Tensor, dy: torch.Tensor, args,
               device: torch.device) -> float:
    """Median ms of forward+backward of ``forward`` on this rank."""
    x = x.detach().requires_grad_()

    def setup():
        x.grad = None
        for p in params:
            p.grad = None

    def run():
        forward(x).backward(dy)

    ms = median_ms(run, setup, args.iters, args.warmup, device)
    setup()  # free the gradients before the next layer
    return ms


def time_all_to_all(layer: MoELayer, x: torch.Tensor, per_slot: bool, args, device: torch.device) -> float:
    """Median ms of the forward dispatch + combine all-to-alls of this routing: one row per
    (token, destination rank) as ep_moe sends, or with ``per_slot`` one row per (token,
    expert) as the plain and DeepSpeed layers send."""
    cfg, group = layer.config, layer.ep_group
    with torch.no_grad():
        router = route(x, layer.router.weight, top_k=cfg.top_k)
        _, counts_P2 = rank_counts(router.topk_ids_TK, None, layer.num_local_experts, layer.ep_size)
        counts_PX = counts_P2[:, 1 if per_slot else 0, None]
        splits = rank_splits(gather_counts(counts_PX, group), layer.ep_rank)
        send_UH = torch.empty(sum(splits.send), cfg.hidden_size, device=device, dtype=x.dtype)

        def run():
            recv_SH = start_dispatch(send_UH, splits, group).wait()
            start_combine(recv_SH, splits, group).wait()

        return median_ms(run, lambda: None, args.iters, args.warmup, device)


ZIPF_PERMUTATION_SEED = 1234


def zipf_logit_bias(num_experts: int, s: float) -> torch.Tensor:
    """[E] float64: log p_e - mean, p_e ~ r(e)^-s over a fixed random permutation r (rank 1
    the most popular expert), the same on every rank."""
    ranks = torch.randperm(num_experts, generator=torch.Generator().manual_seed(ZIPF_PERMUTATION_SEED)) + 1
    log_p = -s * ranks.double().log()
    return log_p - log_p.mean()


def zipf_shift(weight_EH: torch.Tensor, s: float) -> torch.Tensor:
    """[H] float32: the vector v added to every token so that its router logits gain
    beta * (log p_e - mean) (the least-norm solution of W v = that; beta matches the
    tokens' logit noise to a Gumbel, see the module docstring)."""
    w = weight_EH.detach().double().cpu()
    num_experts, hidden = w.shape
    if hidden < num_experts:
        raise SystemExit(f"--routing zipf needs hidden >= experts ({hidden} < {num_experts})")
    beta = (6 ** 0.5 / torch.pi) * w.norm(dim=1).pow(2).mean().sqrt()
    target_E = beta * zipf_logit_bias(num_experts, s)
    v = torch.linalg.lstsq(w, target_E.unsqueeze(1), driver="gelsd").solution.squeeze(1)
    return v.float().to(weight_EH.device)


def routing_load(layer: MoELayer, x: torch.Tensor, group, ep_size: int, device: torch.device) -> tuple[float, float]:
    """(most-loaded expert, most-loaded rank) over the mean of the routing of ``x``: top-k
    of ``layer``'s router, counts summed over the EP group; each the largest over groups."""
    cfg = layer.config
    with torch.no_grad():
        ids = route(x, layer.router.weight, top_k=cfg.top_k, score_func=cfg.score_func,
                    router_dtype=cfg.router_dtype).topk_ids_TK
        counts_E = torch.bincount(ids.flatten(), minlength=cfg.num_experts).to(torch.float64)
        if ep_size > 1:
            dist.all_reduce(counts_E, group=group)
        expert = (counts_E.max() / counts_E.mean()).item()
        per_rank = counts_E.view(ep_size, -1).sum(1)
        rank = (per_rank.max() / per_rank.mean()).item()
    return max(across_ranks(expert, device)), max(across_ranks(rank, device))


VARIANTS = {"nccl": "all_to_all", "ag": "all_gather", "agce": "all_gather_copy_engine"}
"""``--variants`` short names and the ``MoEConfig.dispatch`` each stands for. The all-gather
variants never sync with the host: ``--graph`` captures them. (Before the EP slice was
simplified, the old bench_ep took ``nccl:1``, ``ag:1`` and ``agce:1`` for these and named
them ``ep_moe``, ``ep_moe_ag_c1`` and ``ep_moe_agce_c1``.)"""


def parse_variants(spec: str) -> list[str]:
    """``--variants`` as ``MoEConfig.dispatch`` values, in order, each once."""
    variants = []
    for item in spec.split(","):
        dispatch = VARIANTS.get(item, item)
        if dispatch not in VARIANTS.values():
            hint = (" (the ':CHUNKS' and ':own' suffixes are gone with MoEConfig.overlap_chunks and "
                    "own_rows_first, and the copy-engine all-to-all 'ce' with MoEConfig.transport)"
                    if ":" in item or item == "ce" else "")
            raise SystemExit(f"--variants {item!r}: use one of {list(VARIANTS)} or {list(VARIANTS.values())}{hint}")
        if dispatch not in variants:
            variants.append(dispatch)
    return variants


def variant_name(dispatch: str) -> str:
    """The result name of the ep_moe layer with ``dispatch``."""
    if dispatch == "all_to_all":
        return "ep_moe"
    return "ep_moe_" + next(short for short, full in VARIANTS.items() if full == dispatch)


def sharing_modules(layer: MoELayer, dispatch: str, fp8: bool = False) -> MoELayer:
    """A layer with another dispatch that shares ``layer``'s modules (same parameters);
    ``fp8``: its experts in FP8 (a copy of the experts module holding the same parameters
    under the FP8 config, on the Triton kernels). Raises ValueError where the config refuses
    the combination."""
    precision = dict(expert_precision="fp8", backend="auto") if fp8 else {}
    config = dataclasses.replace(layer.config, dispatch=dispatch, **precision)
    variant = MoELayer(config, layer.ep_group, device="meta")
    experts = layer.experts
    if fp8:
        check_fp8_device(layer.experts.first_weight.device)  # built on meta: the check the layer skipped
        experts = copy.copy(layer.experts)  # shares the parameter dict: the same weights
        experts.config = config
    variant.router, variant.experts, variant.shared_experts = layer.router, experts, layer.shared_experts
    return variant


def build_layers(shape: MoEShape, group, device: torch.device, dtype: torch.dtype, impls: list[str],
                 variants: list[str], deepspeed, compile_mode: Optional[str] = None,
                 fp8: bool = False) -> tuple[MoELayer, dict]:
    """ep_moe's layer, and {name: (forward, params)} of the plain layer and of the other
    layers in ``impls`` (ep_moe once per variant, with ``fp8`` once more with FP8 experts,
    and with ``compile_mode`` each once more under ``torch.compile`` in that mode), all with
    ep_moe's weights."""
    torch.manual_seed(0)  # same router on every rank; expert weights depend on global ids only
    config = MoEConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_experts=shape.num_experts, top_k=shape.top_k, aux_loss_coef=0.0,
                       backend="triton" if device.type == "cuda" else "torch")
    ours = MoELayer(config, group, device=device, dtype=dtype)
    layers = {"plain": PlainEPMoE.like(ours)}
    if "ep_moe" in impls:
        for variant in variants:
            name = variant_name(variant)
            layers[name] = ours if variant == ours.config.dispatch else sharing_modules(ours, variant)
        for variant in variants if fp8 else ():
            try:
                layers[variant_name(variant) + "+fp8"] = sharing_modules(ours, variant, fp8=True)
            except ValueError as refused:
                print0(f"  {variant_name(variant)}+fp8 skipped: {refused}")
    if "deepspeed" in impls and deepspeed is not None:
        layers["deepspeed"] = deepspeed_moe_like(ours)
    forwards = {name: (lambda x, m=m: m(x)[0]) if name == "deepspeed" else m for name, m in layers.items()}
    if compile_mode is not None:
        torch._dynamo.reset()  # each shape compiles afresh, far from Dynamo's recompile limit
        suffix = "+compile" if compile_mode == "default" else f"+compile-{compile_mode}"
        for name in [n for n in layers if n.startswith("ep_moe")]:
            layers[name + suffix] = layers[name]
            forwards[name + suffix] = torch.compile(layers[name], mode=compile_mode)
    return ours, {name: (forwards[name], list(m.parameters())) for name, m in layers.items()}


def graphed_layers(ours: MoELayer, variants: list[str], x: torch.Tensor) -> dict:
    """{name+graph: (forward, params)}: the variants that never sync with the host (every
    one at EP=1, the all-gather variants at EP>1), each a layer sharing ``ours``'s modules
    captured forward and backward in CUDA graphs, for inputs like ``x``."""
    graphed = {}
    for variant in variants:
        if ours.ep_size > 1 and variant == "all_to_all":
            continue
        layer = sharing_modules(ours, variant)
        sample = x.detach().clone().requires_grad_()
        graphed[variant_name(variant) + "+graph"] = (torch.cuda.make_graphed_callables(layer, (sample,)),
                                                     list(layer.parameters()))
    return graphed


def bench_shape(shape: MoEShape, args, group, ep_size: int, device: torch.device, dtype: torch.dtype,
                deepspeed) -> list[dict]:
    """Validate and time every layer on one shape (EP ``group`` of ``ep_size`` ranks, None
    at EP=1); one result row per timed layer, times the slowest of every rank."""
    impls = args.impls.split(",")
    variants = parse_variants(args.variants) if ep_size > 1 else ["all_to_all"]
    ours, layers = build_layers(shape, group, device, dtype, impls, variants, deepspeed, args.compile, args.fp8)
    if args.autotune:
        from ep_moe.autotune import warmup

        sources = warmup(ours, num_tokens=args.tokens)
        print0(f"  autotune: {sorted({r.source for r in sources.values()})}")
    gen = torch.Generator(device=device).manual_seed(1000 + dist.get_rank())  # each rank its own tokens
    x = torch.randn(args.tokens, shape.hidden, device=device, dtype=dtype, generator=gen)
    dy = torch.randn(args.tokens, shape.hidden, device=device, dtype=dtype, generator=gen)
    if args.routing == "zipf":
        x = (x.float() + zipf_shift(ours.router.weight, args.zipf_s)).to(dtype)
    expert_load, rank_load = routing_load(ours, x, group, ep_size, device)
    routing = args.routing if args.routing == "uniform" else f"zipf(s={args.zipf_s:g})"
    print0(f"  routing {routing}: expert load max/mean {expert_load:.2f}, rank load max/mean {rank_load:.2f}")
    if args.graph and device.type == "cuda":
        layers.update(graphed_layers(ours, variants, x))

    # Validate before timing: every layer against the plain one, largest error over ranks.
    errors = {"plain": (0.0, 0.0)}
    ref_y, ref_dx = forward_backward(layers["plain"][0], x, dy)
    for name, (forward, params) in layers.items():
        if name != "plain":
            y, dx = forward_backward(forward, x, dy)
            errors[name] = (max(across_ranks(rel_err(y, ref_y), device)),
                            max(across_ranks(rel_err(dx, ref_dx), device)))
            del y, dx
    del ref_y, ref_dx
    for _, params in layers.values():
        for p in params:
            p.grad = None

    # The all-to-alls as each layer sends: ep_moe one row per (token, rank), the others one per slot.
    a2a = {per_slot: max(across_ranks(time_all_to_all(ours, x, per_slot, args, device), device))
           if ep_size > 1 else 0.0 for per_slot in (False, True)}
    flops = 18 * args.tokens * shape.top_k * shape.hidden * shape.intermediate
    # Timed in rounds, the order rotated each round, so that no layer always runs right after
    # the same other one (a layer timed after the plain one measured slower at EP=4 on H200,
    # as the performance log records); each round's time is the slowest rank's median, a
    # layer's time the median over rounds.
    timed = [n for n in layers if ("ep_moe" if n.startswith("ep_moe") else n) in impls]
    valid = {name: max(errors[name]) < (FP8_MAX_REL_ERR if "+fp8" in name else MAX_REL_ERR) for name in timed}
    rounds = {name: [] for name in timed}  # per round, every rank's median
    for r in range(args.rounds):
        for name in timed[r % len(timed):] + timed[:r % len(timed)]:
            if valid[name]:
                forward, params = layers[name]
                rounds[name].append(across_ranks(time_layer(forward, params, x, dy, args, device), device))
    rows = []
    for name in timed:
        err_y, err_dx = errors[name]
        ms_rounds = [max(per_rank) for per_rank in rounds[name]]
        ms = statistics.median(ms_rounds) if ms_rounds else float("nan")
        a2a_ms = a2a[not name.startswith("ep_moe")]
        rows.append(dict(shape=shape.name, num_experts=shape.num_experts, local_experts=shape.num_experts // ep_size,
                         hidden=shape.hidden, intermediate=shape.intermediate, top_k=shape.top_k, impl=name,
                         ms=ms, ms_rounds=ms_rounds, ms_per_rank=[statistics.median(t) for t in zip(*rounds[name])],
                         tflops=flops / ms / 1e9, a2a_ms=a2a_ms, a2a_share=a2a_ms / ms, rel_err_y=err_y,
                         rel_err_dx=err_dx, valid=valid[name], routing=args.routing,
                         zipf_s=args.zipf_s if args.routing == "zipf" else None, expert_load_max_mean=expert_load,
                         rank_load_max_mean=rank_load))
        spread = f"  rounds {min(ms_rounds):.2f}-{max(ms_rounds):.2f}" if len(ms_rounds) > 1 else ""
        print0(f"{shape.name:16s} {name:17s} EP={ep_size} fwd+bwd {ms:8.2f} ms {flops / ms / 1e9:6.0f} TFLOP/s"
               f"  a2a {a2a_ms:6.2f} ms ({100 * a2a_ms / ms:4.1f}%)  err y {err_y:.1e} dx {err_dx:.1e}"
               + f"  {routing} load expert {expert_load:.2f}x rank {rank_load:.2f}x"
               + ("" if valid[name] else "  INVALID: not timed") + spread)
    return rows


def ep_group_of(ep_size: int):
    """This rank's EP group of ``ep_size`` ranks (None at EP=1), the expert-then-data layout."""
    world_size = dist.get_world_size()
    if ep_size < 1 or world_size % ep_size:
        raise SystemExit(f"--ep-size {ep_size}: must divide the {world_size} ranks; use a divisor of "
                         "--nproc-per-node, or leave it out (every rank in one EP group)")
    if ep_size == 1:
        return None
    return dist.group.WORLD if ep_size == world_size else build_ep_groups(ep_size).ep_group


def main() -> int:
    args = parse_args()
    device = init(args.device)
    try:
        world_size = dist.get_world_size()
        ep_size = args.ep_size or world_size
        parse_variants(args.variants)  # a bad --variants fails before any shape runs
        group = ep_group_of(ep_size)
        replicas = world_size // ep_size
        names = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
        shapes = [TINY if name == TINY.name else SHAPES[name] for name in names]
        deepspeed = import_deepspeed(device) if "deepspeed" in args.impls.split(",") else None
        dtype = getattr(torch, args.dtype)
        env = environment()
        at_once = f" (EP={ep_size}, {replicas} replicas at once)" if replicas > 1 else ""
        print0(f"device {env['device']} x{world_size}{at_once}, torch {env['torch']}, triton {env['triton']}, "
               f"deepspeed {deepspeed.__version__ if deepspeed else '-'}; {args.tokens} tokens per rank, "
               f"{args.dtype}, median of {args.iters} after {args.warmup}, routing {args.routing}"
               + (f" s={args.zipf_s:g}" if args.routing == "zipf" else ""))
        rows = []
        for shape in shapes:
            if shape.num_experts % ep_size:
                print0(f"{shape.name}: {shape.num_experts} experts do not divide over EP={ep_size}; skipped")
                continue
            rows += bench_shape(shape, args, group, ep_size, device, dtype, deepspeed)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if dist.get_rank() == 0:
            out = args.out or REPO / "benchmarks" / "results" / (
                f"ep_{env['device'].replace(' ', '_')}_ep{ep_size}" + (f"_dp{replicas}" if replicas > 1 else "")
                + (f"_zipf{args.zipf_s:g}" if args.routing == "zipf" else "") + ("_fp8" if args.fp8 else "") + ".json")
            save_results(out, {"ep_size": ep_size, "world_size": world_size, "tokens_per_rank": args.tokens, "dtype": args.dtype,
                               "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds, "autotune": args.autotune,
                               "routing": args.routing, "zipf_s": args.zipf_s if args.routing == "zipf" else None,
                               "fp8": args.fp8, "deepspeed": deepspeed.__version__ if deepspeed else None, "results": rows})
            print(json.dumps({"saved": str(out)}), flush=True)
        return 0 if all(r["valid"] for r in rows if r["impl"].startswith("ep_moe")) else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
