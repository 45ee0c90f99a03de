"""A DeepSpeed engine trains a small GPT-style MoE model twice from the same weights, tokens
and seeds: once with DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``) and once with
ep_moe's drop-in (``ep_moe.integrations.deepspeed.MoE``, swapped in by
``replace_deepspeed_moe``), dropless and with ``drop_tokens`` (DeepSpeed's capacity
factor); loss curves and step times side by side (``--dispatch`` picks the drop-in's)::

    torchrun --nproc-per-node 4 benchmarks/bench_deepspeed_train.py \\
        --out benchmarks/results/deepspeed_train_<GPU>_x4.json          # 4 GPUs, ZeRO-2, bf16
    torchrun --nproc-per-node 2 benchmarks/bench_deepspeed_train.py --preset tiny --steps 2 --warmup 0 \\
        --out /tmp/ds_train.json                                       # CPU smoke run (gloo)

The model (``GPT``): token and position embeddings, ``--layers`` pre-LayerNorm blocks of
causal multi-head attention and an MoE layer whose experts are Megatron-DeepSpeed's GPT MoE
experts (``Linear(D, F)``, GELU, ``Linear(F, D)``, with biases; ``--expert swiglu`` for
gated bias-free experts), a final LayerNorm and an untied output head. Loss: next-token
cross entropy plus ``--aux-coef`` times the sum of the layers' ``l_aux``. Each global
expert starts from its own normal(0, 0.02) weights (the same at any ``ep_size``); the
drop-in copies them from DeepSpeed's layers. Data: each rank draws its own sequences from
one fixed random first-order Markov chain over ``--vocab`` tokens (``--branching`` likely
successors per token), so the loss falls from ln(vocab) towards the chain's entropy
(recorded as ``data_entropy``).

The engine: ``deepspeed.initialize`` with a client ``torch.optim.AdamW`` over DeepSpeed's
MoE parameter groups (no DeepSpeed C++ op is built), ZeRO stage ``--zero-stage`` (2),
``"bf16"`` on (``--dtype``), gradient clipping 1.0, ``"zero_allow_untested_optimizer"``.
``--ep-size`` defaults to the world size. NCCL on GPUs (one per rank, ``LOCAL_RANK``), gloo
on a CPU (DeepSpeed's CPU accelerator).

Timing: ``--warmup`` steps, then ``--steps`` - ``--warmup`` timed steps back to back (no
host sync between them beyond the layers' own); on CUDA an event is recorded before the
first step and after each, each step's time being the stream's time from one boundary to
the next; on a CPU ``perf_counter`` around each step. Per rank the median step; a run's
step time is the slowest rank's median. ``--profile-steps N``: N more steps under the
profiler, rank 0's top ops by self device time and its host syncs per step (printed and in
the results), which do not count in the times or the curves. The losses are the mean over ranks, gathered after
the run.

Agreement: per mode, the relative difference of the drop-in's task loss (cross entropy) to
DeepSpeed's at each step; the check passes when its maximum over the first 5 steps is at
most ``--tol-first`` and the mean of the last 10 steps' losses differ by at most
``--tol-last`` (bf16 rounding makes long curves drift apart slowly, as any two
implementations do). The script exits 1 when a mode fails the check (after writing
``--out``), unless ``--no-check``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Optional
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PRESETS = {
    # 4 GPUs: 16 experts (4 per GPU at EP=4), 4096 tokens per GPU and step
    "gpu": dict(vocab=8192, dim=512, layers=4, heads=8, experts=16, ffn=1024, seq=512, batch=8, steps=50, warmup=5,
                lr=1e-3),
    # CPU smoke run
    "tiny": dict(vocab=64, dim=32, layers=2, heads=4, experts=4, ffn=48, seq=16, batch=2, steps=2, warmup=0,
                 lr=3e-3),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if torch.cuda.is_available() else "tiny",
                   help="model, data and step defaults (gpu on CUDA, else tiny)")
    for name, kind in (("vocab", int), ("dim", int), ("layers", int), ("heads", int), ("experts", int), ("ffn", int),
                       ("seq", int), ("batch", int), ("steps", int), ("warmup", int), ("lr", float)):
        p.add_argument(f"--{name}", type=kind, default=None, help="override the preset")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert", choices=("gelu", "swiglu"), default="gelu")
    p.add_argument("--ep-size", type=int, default=0, help="default: the world size")
    p.add_argument("--modes", default="dropless,drop", help="comma-separated: dropless, drop (drop_tokens=True)")
    p.add_argument("--impls", default="deepspeed,ep_moe", help="comma-separated: deepspeed, ep_moe")
    p.add_argument("--dispatch", default="auto", help="the drop-in's dispatch (ep_moe.MoEConfig.dispatch)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="steps profiled after the timed ones: top ops and host syncs per step (rank 0's)")
    p.add_argument("--capacity-factor", type=float, default=1.0, help="drop mode: DeepSpeed's capacity_factor")
    p.add_argument("--min-capacity", type=int, default=4)
    p.add_argument("--second-expert-sampling", action="store_true",
                   help="DeepSpeed's top2_2nd_expert_sampling (random; off by default)")
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--branching", type=int, default=4, help="likely successors per token of the Markov data")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol-first", type=float, default=None,
                   help="max relative loss difference over the first 5 steps (default 0.02 bf16, 1e-4 fp32)")
    p.add_argument("--tol-last", type=float, default=0.05, help="relative difference of the last 10 steps' mean")
    p.add_argument("--no-check", action="store_true", help="exit 0 even when the curves disagree")
    p.add_argument("--out", type=Path, default=None, help="JSON results (rank 0 writes)")
    args = p.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.tol_first is None:
        args.tol_first = 0.02 if args.dtype == "bf16" else 1e-4
    args.modes = [m for m in args.modes.split(",") if m]
    args.impls = [m for m in args.impls.split(",") if m]
    if not set(args.modes) <= {"dropless", "drop"} or not set(args.impls) <= {"deepspeed", "ep_moe"}:
        p.error("--modes takes dropless,drop and --impls deepspeed,ep_moe")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup={args.warmup} must be in [0, --steps={args.steps})")
    return args


# --- the model ----------------------------------------------------------------------------


class SwiGLUExpert(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def make_expert(kind: str, dim: int, ffn: int) -> nn.Module:
    if kind == "swiglu":
        return SwiGLUExpert(dim, ffn)
    return nn.Sequential(nn.Linear(dim, ffn), nn.GELU(), nn.Linear(ffn, dim))  # Megatron-DeepSpeed's GPT MoE expert


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        B, L, D = x_BLD.shape
        q, k, v = self.qkv(x_BLD).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(B, L, D))


class Block(nn.Module):
    def __init__(self, args, moe: nn.Module) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(args.dim), nn.LayerNorm(args.dim)
        self.attn = Attention(args.dim, args.heads)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln1(x))
        y, l_aux, _exp_counts = self.moe(self.ln2(x))
        return x + y, l_aux


class GPT(nn.Module):
    """Token ids [B, L] -> (logits [B, L, V], sum of the MoE layers' l_aux)."""

    def __init__(self, args, moe_factory) -> None:
        super().__init__()
        self.tok = nn.Embedding(args.vocab, args.dim)
        self.pos = nn.Embedding(args.seq, args.dim)
        self.blocks = nn.ModuleList(Block(args, moe_factory()) for _ in range(args.layers))
        self.ln_f = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab, bias=False)

    def forward(self, tokens_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tok(tokens_BL) + self.pos(torch.arange(tokens_BL.shape[1], device=tokens_BL.device))
        l_aux = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, aux = block(x)
            l_aux = l_aux + aux
        return self.head(self.ln_f(x)), l_aux


def build_model(args, layer: str, drop: bool, ep_size: int) -> GPT:
    """The model with DeepSpeed's MoE layers, the same on every call with the same
    arguments (dense weights from ``args.seed``, global expert g of block i from its own
    generator); ``layer == "ep_moe"`` swaps in the drop-in with those weights."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from ep_moe.integrations.deepspeed import replace_deepspeed_moe

    torch.manual_seed(args.seed)
    moe_args = dict(num_experts=args.experts, ep_size=ep_size, k=args.top_k, capacity_factor=args.capacity_factor,
                    eval_capacity_factor=args.capacity_factor, min_capacity=args.min_capacity, drop_tokens=drop,
                    top2_2nd_expert_sampling=args.second_expert_sampling)
    model = GPT(args, lambda: DeepSpeedMoE(args.dim, make_expert(args.expert, args.dim, args.ffn), **moe_args))
    local = args.experts // ep_size
    ep_rank = dist.get_rank() % ep_size  # DeepSpeed's default expert-then-data layout
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            for j, expert in enumerate(block.moe.deepspeed_moe.experts.deepspeed_experts):
                gen = torch.Generator().manual_seed(args.seed * 100_003 + i * 1009 + ep_rank * local + j)
                for name, p in expert.named_parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02 if p.dim() > 1 else torch.zeros_like(p))
    if layer == "ep_moe":
        assert replace_deepspeed_moe(model, dispatch=args.dispatch) == args.layers
    return model


# --- data ----------------------------------------------------------------------------------


def markov_chain(vocab: int, branching: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A fixed chain: each token's ``branching`` distinct successors [V, b] and their
    probabilities [V, b]; and the chain's entropy rate in nats (under its stationary
    distribution, found by power iteration over the sparse transitions)."""
    gen = torch.Generator().manual_seed(seed + 7)
    base = torch.randint(vocab, (vocab, 1), generator=gen)
    successors = (base + torch.arange(branching) * max(1, vocab // branching)) % vocab  # distinct in a row
    probs = torch.softmax(torch.randn(vocab, branching, generator=gen) * 1.5, dim=1)
    stationary = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    for _ in range(500):
        stationary = torch.zeros_like(stationary).index_add_(
            0, successors.flatten(), (stationary[:, None] * probs.double()).flatten())
    row_entropy = -(probs.double() * probs.double().log()).sum(dim=1)
    return successors, probs, float((stationary * row_entropy).sum())


def make_batches(args, successors: torch.Tensor, probs: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's token ids of every step: [steps, batch, seq + 1] (inputs and targets)."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + 1 + rank)
    n = args.steps * args.batch
    tokens = torch.empty(n, args.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(args.vocab, (n,), generator=gen)
    for t in range(args.seq):
        choice = torch.multinomial(probs[tokens[:, t]], 1, generator=gen)[:, 0]
        tokens[:, t + 1] = successors[tokens[:, t], choice]
    return tokens.view(args.steps, args.batch, args.seq + 1)


# --- one run -------------------------------------------------------------------------------


def deepspeed_config(args) -> dict:
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": args.zero_stage},
            "zero_allow_untested_optimizer": True, "bf16": {"enabled": args.dtype == "bf16"},
            "steps_per_print": 10**9}


def run_one(args, deepspeed, layer: str, mode: str, ep_size: int, batches: torch.Tensor) -> dict:
    """Train ``args.steps`` steps; this rank's losses, step times and the layers' facts."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    model = build_model(args, layer, mode == "drop", ep_size)
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "params"})
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(args))
    device = next(engine.module.parameters()).device
    cuda = device.type == "cuda"
    torch.manual_seed(args.seed + 1)  # the gates' random draws (if any) start alike for both layers
    losses, aux_losses, marks, walls = [], [], [], []

    def train_step(step: int) -> None:
        tokens = batches[step % len(batches)].to(device, non_blocking=True)
        logits, l_aux = engine(tokens[:, :-1])
        task = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        engine.backward(task + args.aux_coef * l_aux)
        engine.step()
        losses.append(task.detach())
        aux_losses.append(l_aux.detach().float())

    if cuda:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    for step in range(args.steps):
        if step == args.warmup and cuda:
            marks.append(_event())
        start = time.perf_counter()
        train_step(step)
        if step >= args.warmup:
            if cuda:
                marks.append(_event())
            else:
                walls.append(time.perf_counter() - start)
    if cuda:
        torch.cuda.synchronize()
        step_ms = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    else:
        step_ms = [w * 1e3 for w in walls]
    profile = profile_steps(args, train_step, cuda)
    del losses[args.steps:], aux_losses[args.steps:]  # the profiled steps are not part of the curve
    moes = [block.moe for block in model.blocks]
    result = dict(losses=torch.stack(losses).float().cpu(), aux_losses=torch.stack(aux_losses).cpu(),
                  step_ms=step_ms, median_step_ms=statistics.median(step_ms),
                  peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                  optimizer=type(engine.optimizer).__name__,
                  dispatch=getattr(moes[0], "layer", None) and moes[0].layer.dispatch, profile=profile)
    del engine, optimizer, model, params, moes
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def _event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "cudaStreamSynchronize", "cudaDeviceSynchronize",
            "cudaMemcpy", "cudaEventSynchronize")
"""Profiler events that stop the host until the GPU catches up (or, on a CPU, would)."""


def profile_steps(args, train_step, cuda: bool) -> Optional[dict]:
    """``--profile-steps`` more steps under the profiler, after the timed ones: this rank's
    top ops by self device time (self CPU time on a CPU) and its host syncs, per step."""
    if not args.profile_steps:
        return None
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for step in range(args.profile_steps):
            train_step(args.steps + step)
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    time_of = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    top = sorted(events, key=time_of, reverse=True)[:25]
    per_step = args.profile_steps
    return dict(steps=per_step,
                top_ops=[dict(name=e.key, calls=e.count / per_step, self_ms=time_of(e) / 1e3 / per_step,
                              self_cpu_ms=e.self_cpu_time_total / 1e3 / per_step) for e in top],
                syncs={e.key: e.count / per_step for e in events if e.key in SYNC_OPS})


def gather_run(local: dict, world: int) -> dict:
    """Across ranks: the mean losses per step, every rank's median step, the slowest."""
    losses = torch.stack([local["losses"], local["aux_losses"]]).double()
    medians = torch.tensor([local["median_step_ms"]], dtype=torch.float64)
    peak = torch.tensor([local["peak_mem_gb"] or 0.0], dtype=torch.float64)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    losses, medians, peak = losses.to(device), medians.to(device), peak.to(device)
    dist.all_reduce(losses)
    all_medians = [torch.zeros_like(medians) for _ in range(world)]
    dist.all_gather(all_medians, medians)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    losses = (losses / world).cpu()
    per_rank = [float(m.item()) for m in all_medians]
    return dict(losses=losses[0].tolist(), aux_losses=losses[1].tolist(), step_ms_rank0=local["step_ms"],
                median_step_ms_per_rank=per_rank, step_ms=max(per_rank),
                peak_mem_gb=float(peak.item()) if local["peak_mem_gb"] is not None else None,
                optimizer=local["optimizer"], dispatch=local["dispatch"], profile_rank0=local["profile"])


def compare(ds: list[float], ours: list[float], args) -> dict:
    """The drop-in's loss curve against DeepSpeed's."""
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, ds)]
    tail = min(10, len(ds))
    last_ds, last_ours = sum(ds[-tail:]) / tail, sum(ours[-tail:]) / tail
    first = max(rel[:5])
    last = abs(last_ours - last_ds) / max(abs(last_ds), 1e-12)
    return dict(max_rel_diff_first5=first, max_rel_diff_all=max(rel), rel_diff_last10_mean=last,
                agree=first <= args.tol_first and last <= args.tol_last)


def environment() -> dict:
    import deepspeed

    info = {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "python": sys.version.split()[0]}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, cuda=torch.version.cuda, capability=f"{props.major}.{props.minor}")
    else:
        info["device"] = "cpu"
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                        timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def init(args):
    import deepspeed

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        # DeepSpeed's CPU accelerator compiles a shared-memory all-reduce op when it starts
        # (about a minute); gloo's collectives do the job for this benchmark.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    return deepspeed


def main(argv=None) -> int:
    args = parse_args(argv)
    deepspeed = init(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    ep_size = args.ep_size or world
    if world % ep_size or args.experts % ep_size:
        raise SystemExit(f"--ep-size={ep_size} must divide the world size ({world}) and --experts ({args.experts})")
    successors, probs, entropy = markov_chain(args.vocab, args.branching, args.seed)
    batches = make_batches(args, successors, probs, rank)
    if torch.cuda.is_available():
        batches = batches.pin_memory()
    runs = []
    for mode in args.modes:
        for layer in args.impls:
            t0 = time.perf_counter()
            run = gather_run(run_one(args, deepspeed, layer, mode, ep_size, batches), world)
            run.update(layer=layer, mode=mode, wall_s=time.perf_counter() - t0,
                       tokens_per_s_per_gpu=args.batch * args.seq / (run["step_ms"] / 1e3))
            runs.append(run)
            if rank == 0:
                print(f"[{mode:8s} {layer:9s}] loss {run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}, "
                      f"step {run['step_ms']:.2f} ms (slowest rank's median), "
                      f"{run['tokens_per_s_per_gpu'] / 1e3:.1f}k tokens/s per GPU, "
                      f"dispatch {run['dispatch']}, {run['wall_s']:.0f} s", flush=True)
                if run["profile_rank0"] is not None:
                    prof = run["profile_rank0"]
                    print(f"  host syncs per step: {prof['syncs']}; top ops by self time per step:\n" + "\n".join(
                        f"    {op['self_ms']:8.3f} ms {op['calls']:7.1f} calls  {op['name'][:80]}"
                        for op in prof["top_ops"][:12]), flush=True)
    comparisons = []
    for mode in args.modes:
        by_layer = {r["layer"]: r for r in runs if r["mode"] == mode}
        if {"deepspeed", "ep_moe"} <= by_layer.keys():
            ds, ours = by_layer["deepspeed"], by_layer["ep_moe"]
            comparisons.append(dict(mode=mode, **compare(ds["losses"], ours["losses"], args),
                                    step_ms_deepspeed=ds["step_ms"], step_ms_ep_moe=ours["step_ms"],
                                    speedup=ds["step_ms"] / ours["step_ms"]))
    ok = all(c["agree"] for c in comparisons)
    if rank == 0:
        for c in comparisons:
            print(f"[{c['mode']:8s} compare  ] loss max rel diff: first 5 steps {c['max_rel_diff_first5']:.2e}, "
                  f"all {c['max_rel_diff_all']:.2e}, last-10 mean {c['rel_diff_last10_mean']:.2e} -> "
                  f"{'agree' if c['agree'] else 'DISAGREE'}; step {c['step_ms_deepspeed']:.2f} ms (DeepSpeed) vs "
                  f"{c['step_ms_ep_moe']:.2f} ms (ep_moe): {c['speedup']:.2f}x", flush=True)
        if args.out is not None:
            payload = dict(environment=environment(), world_size=world, ep_size=ep_size, data_entropy=entropy,
                           args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           tokens_per_step_per_gpu=args.batch * args.seq, runs=runs, comparisons=comparisons,
                           agree=ok)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(payload, indent=2) + "\n")
            print(f"wrote {args.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok or args.no_check else 1


if __name__ == "__main__":
    sys.exit(main())
