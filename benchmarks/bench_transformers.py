"""Hugging Face transformers' MoE blocks with ``experts_implementation="ep_moe"`` against
transformers' own experts implementations, on one GPU, in one run on the same weights.

    python benchmarks/bench_transformers.py --out benchmarks/results/transformers_<device>.json
    python benchmarks/bench_transformers.py --sections block --shapes deepseek-v3 --tokens 16384
    python benchmarks/bench_transformers.py --smoke --out /tmp/transformers.json   # CPU, tiny, float32
    python benchmarks/bench_transformers.py --plot benchmarks/results/transformers_<device>.json

Importing ``ep_moe.integrations.transformers`` registers ``"ep_moe"`` in transformers'
ExpertsInterface; an experts module then runs through ep_moe when its config's
``_experts_implementation`` is ``"ep_moe"``. Each block is built once with weights drawn once
(N(0, 0.02)); the implementations take turns on those weights and the same tokens (so they
route alike) by switching the experts' ``config._experts_implementation``.

- ``block``: the family's MoE block (Qwen3MoeSparseMoeBlock, GptOssMLP, MixtralSparseMoeBlock,
  DeepseekV3MoE: router, experts, DeepSeek's shared expert) at the real widths of ``SHAPES``,
  forward+backward (dX and every parameter gradient) at ``--tokens`` tokens: transformers'
  ``grouped_mm`` against ``ep_moe``. Before timing, ep_moe's output, dX and every parameter
  gradient are checked against grouped_mm's (eager's if grouped_mm fails): ``max_rel`` =
  max|a-b| / max|b| and ``rel`` = ||a-b|| / ||b||; the output's max_rel or dX's rel above
  ``--warn-rel`` (2e-2), or a gradient's rel above 10x that (a router's gradient cancels, so
  bf16 leaves ~1e-2 there), prints a loud warning and lands in the results' ``warnings``.
  ``ep_moe_fp8`` in ``--block-impls`` adds ep_moe with FP8 experts
  (``expert_precision="fp8"``, a GPU with FP8 tensor cores, or the Triton interpreter) on the
  same parameters: its output and dX against the reference within ``FP8_BOUND`` (the FP8
  layer's bound) in ``numerics_fp8``, its speedup over the fastest of transformers' own in
  ``speedup_fp8``. Its weights' e4m3 copies are made once (the parameters do not change between
  calls), so its time leaves out the weight quantization that training pays once per step.
- ``small``: the block's forward without grad (``torch.no_grad``, as ``generate`` runs it) at
  ``--small-tokens`` tokens: ``grouped_mm``, ``batched_mm``, ``eager`` and ``ep_moe``, the
  speedup against the fastest of transformers' own, each output checked against grouped_mm's.
  batched_mm gathers every routed slot's expert weights (T*k of them) and is skipped where
  those exceed ``--batched-mm-max-gb``.
- ``step``: a training step (forward, backward, fused AdamW step, zero_grad) of a
  Qwen3-30B-A3B-shaped ``Qwen3MoeForCausalLM`` (``--layers`` layers at full width, vocab 32000,
  bf16 parameters, sdpa attention, ``--batch`` x ``--seq`` tokens): ms/step and tokens/s. Each
  implementation starts from the same initial weights (restored from a copy), a fresh
  optimizer and the same batches, so the losses agree step by step (reported).

Time: CUDA events (wall clock on the CPU); blocks: the median of ``--rounds`` rounds of
``--iters`` calls after ``--warmup`` untimed ones, the implementations taking turns round by
round in a rotated order; step: the median of ``--steps`` steps after ``--step-warmup``.
ep_moe runs on its cached, shipped or heuristic kernel configs (no autotuning), as a user's
first call does. An implementation that raises (grouped_mm without its kernel, out of memory)
is recorded as unavailable with its error, and the run goes on.

GPU memory at the real widths (bf16): deepseek-v3's block is 11.3 G parameters (22.5 GB); with
its gradients and the reference gradients kept for the check about 70 GB at the peak. Mixtral
2.8 GB, gpt-oss 1.6 GB, qwen3 1.2 GB. The step model (4 layers) is 2.6 G parameters: weights,
initial copy, gradients and AdamW states about 26 GB, plus activations (~10 GB at 8x1024).

Results: ``benchmarks/results/transformers_<device>.json`` (``--out``): every number (each
round's median too), the device and the torch / triton / transformers versions; per block
implementation ``extra_peak_gb``, the GPU memory its checked forward+backward took above what
was resident (its gradients included), and per step implementation ``peak_gb``.
``--plot JSON`` draws one such file (``plot.py``'s helpers).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import importlib
import json
import statistics
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import transformers  # noqa: E402
from common import call_times, environment, save_results  # noqa: E402

import ep_moe.integrations.transformers as ep_hf  # noqa: E402  (registers "ep_moe")

OURS = "ep_moe"
OURS_FP8 = "ep_moe_fp8"
"""ep_moe with FP8 experts (block section only)."""
HF_IMPLS = ("grouped_mm", "batched_mm", "eager")
FP8_BOUND = 1e-1
"""FP8 experts against bf16 ones: the recipe's 3.5-4.5e-2 per GEMM, two in a row."""


@dataclasses.dataclass(frozen=True)
class Family:
    """Where a model family's block lives and how its config names the expert sizes."""

    config: str
    module: str
    block: str
    intermediate_key: str
    experts_key: str


FAMILIES = {
    "qwen3_moe": Family("Qwen3MoeConfig", "qwen3_moe", "Qwen3MoeSparseMoeBlock", "moe_intermediate_size",
                        "num_experts"),
    "gpt_oss": Family("GptOssConfig", "gpt_oss", "GptOssMLP", "intermediate_size", "num_local_experts"),
    "mixtral": Family("MixtralConfig", "mixtral", "MixtralSparseMoeBlock", "intermediate_size", "num_local_experts"),
    "deepseek_v3": Family("DeepseekV3Config", "deepseek_v3", "DeepseekV3MoE", "moe_intermediate_size",
                          "n_routed_experts"),
}


@dataclasses.dataclass(frozen=True)
class BlockShape:
    name: str
    family: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    extra: tuple = ()
    """Further config keywords, (key, value) pairs."""

    def config(self):
        fam = FAMILIES[self.family]
        return getattr(transformers, fam.config)(hidden_size=self.hidden, num_experts_per_tok=self.top_k, **{
            fam.intermediate_key: self.intermediate, fam.experts_key: self.experts}, **dict(self.extra))


SHAPES = {s.name: s for s in (
    BlockShape("qwen3-30b-a3b", "qwen3_moe", 2048, 768, 128, 8, (("norm_topk_prob", True),)),
    BlockShape("gpt-oss-20b", "gpt_oss", 2880, 2880, 32, 4),
    BlockShape("mixtral-8x7b", "mixtral", 4096, 14336, 8, 2),
    BlockShape("deepseek-v3", "deepseek_v3", 7168, 2048, 256, 8,
               (("n_shared_experts", 1), ("n_group", 8), ("topk_group", 4))),
)}
SMOKE_SHAPES = {name: dataclasses.replace(
    s, hidden=64, intermediate=32, experts=8, top_k=2,
    extra=tuple((k, {"n_group": 4, "topk_group": 2}.get(k, v)) for k, v in s.extra)) for name, s in SHAPES.items()}

# Qwen3-30B-A3B's decoder at full width (vocab cut to 32000 to bound the logits' memory).
STEP_MODEL = dict(vocab_size=32000, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
SMOKE_STEP_MODEL = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)

DEFAULTS = dict(device="cuda", dtype="bfloat16", tokens=8192, small_tokens="1,4,16,64", layers=4, batch=8,
                seq=1024, steps=10, step_warmup=3, iters=10, rounds=3, warmup=3)
SMOKE_DEFAULTS = dict(device="cpu", dtype="float32", tokens=64, small_tokens="1,4", layers=2, batch=2, seq=32,
                      steps=2, step_warmup=1, iters=2, rounds=1, warmup=1)


# --- helpers -------------------------------------------------------------------------------

def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def on_device(device: torch.device, dtype: torch.dtype, make: Callable):
    """``make()`` with new tensors created on ``device`` in ``dtype`` (no float32 copy first)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return make()
    finally:
        torch.set_default_dtype(previous)


def build_block(shape: BlockShape, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    fam = FAMILIES[shape.family]
    cls = getattr(importlib.import_module(f"transformers.models.{fam.module}.modeling_{fam.module}"), fam.block)
    config = shape.config()
    block = on_device(device, dtype, lambda: cls(config))
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    return block


def use(experts: list[torch.nn.Module], impl: str) -> None:
    for m in experts:
        m.config._experts_implementation = OURS if impl == OURS_FP8 else impl


def fp8_twin(block: torch.nn.Module) -> torch.nn.Module:
    """``block`` with FP8 experts on the same parameters: a shallow copy whose experts modules
    (direct children) are shallow copies set to ``expert_precision="fp8"``."""
    twin = copy.copy(block)
    twin._modules = dict(block._modules)  # its own children; the parameters stay shared
    for name, module in ep_hf.experts_modules(block):
        if "." in name:
            raise ValueError(f"{type(block).__name__}: experts module {name!r} is not a direct child")
        twin._modules[name] = copy.copy(module)
    ep_hf.expert_parallel(torch.nn.ModuleList(m for _, m in ep_hf.experts_modules(twin)), None,
                          expert_precision="fp8")
    return twin


def block_out(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = block(x)
    return y[0] if isinstance(y, tuple) else y  # GptOssMLP returns (out, router_scores)


def attempt(fn: Callable, device: torch.device):
    """(fn(), None), or (None, why) where it raises: an implementation this GPU or this
    transformers lacks, or memory; the benchmark records it and goes on."""
    try:
        return fn(), None
    except Exception as err:  # noqa: BLE001 - recorded in the results
        free_memory(device)
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
        return None, f"{type(err).__name__}: {first}"


def peak_gb(device: torch.device, start: bool = False) -> Optional[float]:
    """GB allocated at the peak since the last ``start=True`` call (None on the CPU)."""
    if device.type != "cuda":
        return None
    if start:
        torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.max_memory_allocated(device) / 2**30


def resident_gb(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def billions(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def measure(fns: dict[str, Callable], setup: Optional[Callable], args, device: torch.device) -> dict[str, dict]:
    """Per name: the median ms over ``args.rounds`` rounds of ``args.iters`` calls (after
    ``args.warmup`` untimed ones), each round's median; the functions take turns round by round
    in a rotated order, so a drift of the machine spreads over all of them."""
    names = list(fns)
    if not names:
        return {}
    for name in names:
        call_times(fns[name], setup, args.warmup, device)
    times: dict[str, list[float]] = {n: [] for n in names}
    rounds: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = call_times(fns[name], setup, args.iters, device)
            times[name] += t
            rounds[name].append(statistics.median(t))
    return {n: {"available": True, "ms": statistics.median(times[n]), "ms_rounds": rounds[n]} for n in names}


def errors(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """``a`` against the reference ``b``: rel = ||a-b|| / ||b||, max_rel = max|a-b| / max|b|, in
    float32, chunk by chunk (one gradient of deepseek-v3 is 7.5 G elements)."""
    zero = torch.zeros((), device=b.device)
    d2, r2, dmax, rmax = zero, zero.clone(), zero.clone(), zero.clone()
    for ca, cb in zip(a.reshape(-1).split(1 << 26), b.reshape(-1).split(1 << 26)):
        d, r = ca.float() - cb.float(), cb.float()
        d2, r2 = d2 + d.square().sum(), r2 + r.square().sum()
        dmax, rmax = torch.maximum(dmax, d.abs().max()), torch.maximum(rmax, r.abs().max())
    return {"rel": (d2.sqrt() / r2.sqrt().clamp_min(1e-30)).item(), "max_rel": (dmax / rmax.clamp_min(1e-30)).item()}


def warn(warnings: list[str], message: str) -> None:
    warnings.append(message)
    banner = "!" * 100
    print(f"{banner}\nWARNING: {message}\n{banner}", flush=True)
    print(f"WARNING: {message}", file=sys.stderr, flush=True)


# --- the sections --------------------------------------------------------------------------

def bench_block(block, shape: BlockShape, args, device, dtype, warnings: list[str]) -> dict:
    """Forward+backward of the whole block at ``args.tokens`` tokens, each implementation."""
    blocks = {}  # impl -> the block it runs, where not ``block`` itself: ep_moe_fp8's twin
    if OURS_FP8 in args.block_impls:
        try:
            blocks[OURS_FP8] = fp8_twin(block)
        except ValueError as err:  # no FP8 tensor cores here: one_pass raises it, recorded as unavailable
            blocks[OURS_FP8], fp8_error = None, err
    experts = {id(b): [module for _, module in ep_hf.experts_modules(b)] for b in (block, *blocks.values()) if b}
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, args.tokens, shape.hidden, device=device, dtype=dtype, generator=gen).requires_grad_()
    dy = torch.randn(1, args.tokens, shape.hidden, device=device, dtype=dtype, generator=gen)

    def setup():
        x.grad = None
        block.zero_grad(set_to_none=True)

    def run(impl):
        def fn():
            b = blocks.get(impl, block)
            use(experts[id(b)], impl)
            block_out(b, x).backward(dy)
        return fn

    def one_pass(impl):
        b = blocks.get(impl, block)
        if b is None:
            raise fp8_error
        use(experts[id(b)], impl)
        y = block_out(b, x)
        y.backward(dy)
        return y.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}

    impls = sorted(args.block_impls, key=lambda i: i in (OURS, OURS_FP8))  # the reference (HF) before ep_moe
    row = {"tokens": args.tokens, "impls": {}, "numerics": None}
    passes = {}  # the first HF implementation's (output, dX, gradients) and ep_moe's (bf16, FP8)
    for impl in impls:
        setup()
        before = resident_gb(device)
        peak_gb(device, start=True)
        result, error = attempt(lambda: one_pass(impl), device)
        extra = None if device.type != "cuda" else peak_gb(device) - before
        setup()
        row["impls"][impl] = {"available": False, "error": error} if error else {"extra_peak_gb": extra}
        if error:
            print(f"  {shape.name}: {impl} unavailable: {error}", flush=True)
        elif impl in (OURS, OURS_FP8) or len(passes) == 0:
            passes[impl] = result if impl != OURS_FP8 else (*result[:2], None)  # FP8: output and dX checked
        result = None
    reference = next((i for i in passes if i not in (OURS, OURS_FP8)), None)
    if reference is None and passes:  # grouped_mm failed: transformers' loop as the reference
        result, error = attempt(lambda: one_pass("eager"), device)
        setup()
        if result is not None:
            reference, passes["eager"] = "eager", result
        result = None
    if reference is not None and OURS in passes:
        row["numerics"] = check_block({reference: passes[reference], OURS: passes[OURS]}, shape, args, warnings)
    if reference is not None and OURS_FP8 in passes:
        row["numerics_fp8"] = check_fp8_block(passes[reference], passes[OURS_FP8], reference, shape, warnings)
    passes.clear()
    free_memory(device)
    timed = measure({i: run(i) for i in impls if row["impls"][i].get("available", True)}, setup, args, device)
    for impl, t in timed.items():
        row["impls"][impl].update(t)
    setup()
    row["speedup"] = speedup(row["impls"])
    if OURS_FP8 in row["impls"]:
        row["speedup_fp8"] = speedup(row["impls"], OURS_FP8)
    return row


def check_block(passes: dict, shape: BlockShape, args, warnings: list[str]) -> dict:
    """ep_moe's output, dX and gradients against the reference's (``passes``: reference, ours)."""
    name = next(iter(passes))
    (y_ref, dx_ref, grads_ref), (y, dx, grads) = passes[name], passes[OURS]
    grad_errors = {n: errors(grads[n], g) for n, g in grads_ref.items() if g is not None and grads[n] is not None}
    numerics = {"reference": name, "out": errors(y, y_ref), "dx": errors(dx, dx_ref), "grads": grad_errors,
                "worst_grad": max(grad_errors, key=lambda n: grad_errors[n]["rel"]) if grad_errors else None}
    bad = [f"out max_rel {numerics['out']['max_rel']:.2e}"] if numerics["out"]["max_rel"] > args.warn_rel else []
    bad += [f"dx rel {numerics['dx']['rel']:.2e}"] if numerics["dx"]["rel"] > args.warn_rel else []
    # A router's gradient sums per-token terms that cancel (softmax): 1e-2 of bf16 noise is usual there,
    # so gradients warn at 10x the bound: a wrong or missing gradient is off by ~1.
    bad += [f"{n} rel {e['rel']:.2e}" for n, e in grad_errors.items() if e["rel"] > 10 * args.warn_rel]
    if bad:
        warn(warnings, f"block {shape.name}: ep_moe against {name} beyond {args.warn_rel:g}: {', '.join(bad)}")
    return numerics


def check_fp8_block(ref_pass: tuple, fp8_pass: tuple, reference: str, shape: BlockShape,
                    warnings: list[str]) -> dict:
    """The FP8 experts' output and dX against the reference's, warned beyond ``FP8_BOUND``."""
    (y_ref, dx_ref, _), (y, dx, _) = ref_pass, fp8_pass
    numerics = {"reference": reference, "out": errors(y, y_ref), "dx": errors(dx, dx_ref)}
    bad = [f"{what} rel {numerics[what]['rel']:.2e}" for what in ("out", "dx") if numerics[what]["rel"] > FP8_BOUND]
    if bad:
        warn(warnings, f"block {shape.name}: ep_moe's FP8 experts against {reference} beyond {FP8_BOUND:g}: "
                       + ", ".join(bad))
    return numerics


def speedup(impls: dict, ours: str = OURS) -> Optional[float]:
    """The fastest timed transformers implementation's ms over ``ours``' (None without both)."""
    hf = [r["ms"] for i, r in impls.items() if i not in (OURS, OURS_FP8) and "ms" in r]
    return min(hf) / impls[ours]["ms"] if hf and "ms" in impls.get(ours, {}) else None


def bench_small(block, shape: BlockShape, args, device, dtype, warnings: list[str]) -> list[dict]:
    """Forward without grad at few tokens, each implementation."""
    experts = [module for _, module in ep_hf.experts_modules(block)]
    per_expert = sum(p.numel() * p.element_size() for m in experts for p in m.parameters()) / shape.experts
    rows = []
    for tokens in args.small_tokens:
        x = torch.randn(1, tokens, shape.hidden, device=device, dtype=dtype,
                        generator=torch.Generator(device=device).manual_seed(2))

        def run(impl):
            def fn():
                use(experts, impl)
                with torch.no_grad():
                    return block_out(block, x)
            return fn

        row = {"tokens": tokens, "impls": {}}
        outs = {}
        for impl in args.small_impls:
            gathered_gb = tokens * shape.top_k * per_expert / 2**30
            if impl == "batched_mm" and gathered_gb > args.batched_mm_max_gb:
                row["impls"][impl] = {"available": False, "error": f"skipped: would gather {gathered_gb:.1f} "
                                                                   "GB of expert weights (--batched-mm-max-gb)"}
                continue
            out, error = attempt(run(impl), device)
            row["impls"][impl] = {"available": False, "error": error} if error else {}
            if out is not None:
                outs[impl] = out
        ref = next((i for i in ("grouped_mm", "eager", "batched_mm") if i in outs), None)
        for impl, out in outs.items():
            if ref is not None and impl != ref:
                row["impls"][impl]["vs_" + ref] = errors(out, outs[ref])
        if OURS in outs and ref is not None and row["impls"][OURS]["vs_" + ref]["max_rel"] > args.warn_rel:
            warn(warnings, f"small {shape.name} at {tokens} tokens: ep_moe against {ref} max_rel "
                           f"{row['impls'][OURS]['vs_' + ref]['max_rel']:.2e} > {args.warn_rel:g}")
        del outs
        for impl, t in measure({i: run(i) for i in row["impls"] if row["impls"][i].get("available", True)},
                               None, args, device).items():
            row["impls"][impl].update(t)
        hf = {i: r["ms"] for i, r in row["impls"].items() if i != OURS and "ms" in r}
        row["best_hf"] = min(hf, key=hf.get) if hf else None
        row["speedup"] = speedup(row["impls"])
        rows.append(row)
    return rows


def bench_step(args, device, dtype, warnings: list[str]) -> dict:
    """Training steps of a Qwen3-MoE causal LM, each implementation from the same start."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(SMOKE_STEP_MODEL if args.smoke else STEP_MODEL, num_hidden_layers=args.layers, use_cache=False,
                 tie_word_embeddings=False)
    config = Qwen3MoeConfig(**shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = on_device(device, dtype, lambda: Qwen3MoeForCausalLM(config))
    model.train()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(3)
    batches = [torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device, generator=gen)
               for _ in range(args.step_warmup + args.steps)]
    tokens = args.batch * args.seq
    out = {"model": "Qwen3MoeForCausalLM", "config": shape, "attention": model.config._attn_implementation,
           "batch": args.batch, "seq": args.seq,
           "tokens_per_step": tokens, "params": sum(p.numel() for p in model.parameters()),
           "optimizer": "AdamW(fused)" if device.type == "cuda" else "AdamW", "warmup": args.step_warmup,
           "steps": args.steps, "impls": {}}
    for impl in args.step_impls:
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.copy_(initial[k])
        peak_gb(device, start=True)

        def steps():
            model.set_experts_implementation(impl)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
            losses, marks = [], []

            def step(ids):
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach())
            for ids in batches:
                marks += call_times(lambda: step(ids), None, 1, device)
            return [float(v) for v in losses], marks[args.step_warmup:]

        result, error = attempt(steps, device)
        model.zero_grad(set_to_none=True)
        free_memory(device)
        if error:
            out["impls"][impl] = {"available": False, "error": error}
            print(f"  step: {impl} unavailable: {error}", flush=True)
            continue
        losses, times = result
        ms = statistics.median(times)
        out["impls"][impl] = {"available": True, "ms": ms, "tokens_per_s": tokens / (ms / 1e3), "step_ms": times,
                              "losses": losses, "peak_gb": peak_gb(device)}
    ok = {i: r for i, r in out["impls"].items() if r["available"]}
    out["speedup"] = speedup(ok)
    if {"grouped_mm", OURS} <= ok.keys():
        a, b = ok[OURS]["losses"], ok["grouped_mm"]["losses"]
        out["first_loss_rel_diff"] = abs(a[0] - b[0]) / abs(b[0])
        out["max_loss_abs_diff"] = max(abs(x - y) for x, y in zip(a, b))
        if out["first_loss_rel_diff"] > args.warn_rel:
            warn(warnings, f"step: ep_moe's first loss {a[0]:.5f} against grouped_mm's {b[0]:.5f}")
    del model, initial, batches
    free_memory(device)
    return out


# --- output --------------------------------------------------------------------------------

def _ms(entry: dict) -> str:
    return f"{entry['ms']:10.3f}" if "ms" in entry else f"{'n/a':>10s}"


def print_tables(results: dict) -> None:
    if "block" in results:
        impls = list(dict.fromkeys(i for r in results["block"]["results"] for i in r["impls"]))
        print(f"\nblock forward+backward, {results['block']['tokens']} tokens, {results['dtype']} (ms)")
        print(f"{'shape':16s}" + "".join(f"{i:>11s}" for i in impls) + f"{'speedup':>9s}  ep_moe against the reference")
        for r in results["block"]["results"]:
            n = r["numerics"]
            check = (f"out max_rel {n['out']['max_rel']:.1e}, dx rel {n['dx']['rel']:.1e}, worst grad "
                     f"{n['worst_grad']} rel {n['grads'][n['worst_grad']]['rel']:.1e} ({n['reference']})"
                     if n and n["worst_grad"] else "-")
            speedup = f"{r['speedup']:8.2f}x" if r["speedup"] else f"{'-':>9s}"
            print(f"{r['shape']:16s}" + "".join(f" {_ms(r['impls'][i])}" for i in impls) + f"{speedup}  {check}")
            if r.get("numerics_fp8"):
                n8, s8 = r["numerics_fp8"], r.get("speedup_fp8")
                print(f"{'':16s} {OURS_FP8}: " + (f"{s8:.2f}x, " if s8 else "") +
                      f"out rel {n8['out']['rel']:.1e}, dx rel {n8['dx']['rel']:.1e} ({n8['reference']})")
    if "small" in results:
        impls = list(dict.fromkeys(i for r in results["small"]["results"] for i in r["impls"]))
        print(f"\nblock forward, no grad, few tokens ({results['dtype']}, ms); speedup against the fastest of "
              "transformers' own")
        print(f"{'shape':16s}{'tokens':>7s}" + "".join(f"{i:>11s}" for i in impls) + f"{'speedup':>9s}  ep_moe max_rel")
        for r in results["small"]["results"]:
            errs = [v["max_rel"] for k, v in r["impls"].get(OURS, {}).items() if k.startswith("vs_")]
            speedup = f"{r['speedup']:8.2f}x" if r["speedup"] else f"{'-':>9s}"
            print(f"{r['shape']:16s}{r['tokens']:7d}" + "".join(f" {_ms(r['impls'][i])}" for i in impls)
                  + f"{speedup}  " + (f"{errs[0]:.1e}" if errs else "-"))
    if "step" in results:
        s = results["step"]
        print(f"\ntraining step: {s['model']}, {s['config']['num_hidden_layers']} layers, {billions(s['params'])} "
              f"params, {s['batch']}x{s['seq']} tokens, {s['optimizer']}, median of {s['steps']} after {s['warmup']}")
        for impl, r in s["impls"].items():
            if r["available"]:
                print(f"  {impl:11s} {r['ms']:10.2f} ms/step {r['tokens_per_s']:12,.0f} tokens/s  "
                      f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
            else:
                print(f"  {impl:11s} unavailable: {r['error']}")
        if s.get("speedup"):
            print(f"  speedup {s['speedup']:.2f}x; loss max |diff| {s['max_loss_abs_diff']:.2e}")
    for w in results.get("warnings", []):
        print(f"WARNING: {w}")


def plot_results(path: Path, out: Optional[Path] = None) -> Path:
    """One figure of a results file: block forward+backward and the training step (bars),
    and per shape the no-grad forward against tokens (a line per implementation)."""
    from plot import _pyplot, _save, device_name

    data = json.loads(Path(path).read_text())
    device = device_name(data.get("environment", {}).get("device", "unknown"))
    plt = _pyplot()
    small = data.get("small", {}).get("results", [])
    shapes = list(dict.fromkeys(r["shape"] for r in small))
    cols = max(2, len(shapes))
    fig, axes = plt.subplots(2, cols, figsize=(4.3 * cols, 8.5), squeeze=False)
    colors = {"grouped_mm": "tab:gray", "batched_mm": "tab:orange", "eager": "tab:green", OURS: "tab:blue",
              OURS_FP8: "tab:purple"}
    bars = ((axes[0][0], "block", "block forward+backward", data.get("block", {}).get("results", [])),
            (axes[0][1], "step", "training step", [dict(data["step"], shape=data["step"]["model"])]
             if data.get("step") else []))
    for ax, key, title, rows in bars:
        impls = list(dict.fromkeys(i for r in rows for i in r["impls"]))
        width = 0.8 / max(1, len(impls))
        for j, impl in enumerate(impls):
            xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(rows))]
            ax.bar(xs, [r["impls"][impl].get("ms", 0.0) for r in rows], width, label=impl, color=colors.get(impl))
        for i, r in enumerate(rows):
            if r.get("speedup"):
                ax.annotate(f"{r['speedup']:.2f}x", (i, max(v.get("ms", 0.0) for v in r["impls"].values())),
                            ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), [r["shape"] for r in rows], fontsize=8)
        ax.set_ylabel("ms")
        detail = (f", {data['block']['tokens']} tokens" if key == "block" and rows else
                  f", {rows[0]['batch']}x{rows[0]['seq']} tokens" if rows else ": not run")
        ax.set_title(title + detail, fontsize=10)
        ax.legend(fontsize=7)
    for ax in axes[0][2:]:
        ax.axis("off")
    for col, shape in enumerate(shapes):
        ax = axes[1][col]
        rows = [r for r in small if r["shape"] == shape]
        for impl in dict.fromkeys(i for r in rows for i in r["impls"]):
            points = [(r["tokens"], r["impls"][impl]["ms"]) for r in rows if "ms" in r["impls"].get(impl, {})]
            if points:
                ax.plot(*zip(*points), marker="o", label=impl, color=colors.get(impl),
                        ls="-" if impl == OURS else "--")
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["tokens"] for r in rows], [str(r["tokens"]) for r in rows])
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("forward, no grad (ms)")
        ax.set_title(shape, fontsize=10)
        ax.legend(fontsize=7)
    for ax in axes[1][len(shapes):]:
        ax.axis("off")
    env = data.get("environment", {})
    fig.suptitle(f"transformers MoE blocks, ep_moe against transformers' experts implementations: {device}, "
                 f"torch {env.get('torch')}, triton {env.get('triton')}, transformers {data.get('transformers')} "
                 f"({Path(path).name})", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    out = out or REPO / "benchmarks" / "results" / "plots" / f"transformers_{device.replace(' ', '_')}.png"
    return _save(fig, Path(out))


# --- command line --------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="block,small,step", help="of block, small, step (default: %(default)s)")
    p.add_argument("--shapes", default="all", help=f"comma-separated, of {', '.join(SHAPES)} (default: all)")
    p.add_argument("--tokens", type=int, help="block section's tokens (default: 8192; smoke 64)")
    p.add_argument("--small-tokens", help="small section's token counts (default: 1,4,16,64; smoke 1,4)")
    p.add_argument("--block-impls", default=f"grouped_mm,{OURS}", help="default: %(default)s")
    p.add_argument("--small-impls", default=f"grouped_mm,batched_mm,eager,{OURS}", help="default: %(default)s")
    p.add_argument("--step-impls", default=f"grouped_mm,{OURS}", help="default: %(default)s")
    p.add_argument("--layers", type=int, help="step model's decoder layers (default: 4)")
    p.add_argument("--batch", type=int, help="step's sequences (default: 8)")
    p.add_argument("--seq", type=int, help="step's sequence length (default: 1024)")
    p.add_argument("--steps", type=int, help="timed training steps (default: 10)")
    p.add_argument("--step-warmup", type=int, help="untimed training steps first (default: 3)")
    p.add_argument("--iters", type=int, help="timed block calls per round (default: 10)")
    p.add_argument("--rounds", type=int, help="rounds of --iters calls per implementation (default: 3)")
    p.add_argument("--warmup", type=int, help="untimed block calls first (default: 3)")
    p.add_argument("--device", help="cuda or cpu (default: cuda; smoke cpu)")
    p.add_argument("--dtype", help="default: bfloat16; smoke float32")
    p.add_argument("--batched-mm-max-gb", type=float, default=40.0,
                   help="skip batched_mm where it would gather more expert weights than this (default: %(default)s)")
    p.add_argument("--warn-rel", type=float, default=2e-2, help="numerics warning bound (default: %(default)s)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, float32, CPU: the whole script in seconds")
    p.add_argument("--out", type=Path, help="results JSON (default: benchmarks/results/transformers_<device>.json)")
    p.add_argument("--plot", type=Path, metavar="JSON", help="no run: draw this results file (and exit)")
    p.add_argument("--plot-out", type=Path,
                   help="with --plot: the PNG (default: benchmarks/results/plots/transformers_<device>.png)")
    args = p.parse_args(argv)
    for key, value in (SMOKE_DEFAULTS if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.sections = [s for s in args.sections.split(",") if s]
    args.small_tokens = [int(t) for t in str(args.small_tokens).split(",")]
    for key in ("block_impls", "small_impls", "step_impls"):
        setattr(args, key, [i for i in getattr(args, key).split(",") if i])
        if unknown := set(getattr(args, key)) - {*HF_IMPLS, OURS, *((OURS_FP8,) if key == "block_impls" else ())}:
            p.error(f"--{key.replace('_', '-')}: unknown {sorted(unknown)}" +
                    (f" ({OURS_FP8} runs in the block section only)" if OURS_FP8 in unknown else ""))
    if unknown := set(args.sections) - {"block", "small", "step"}:
        p.error(f"--sections: unknown {sorted(unknown)}")
    names = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    if unknown := set(names) - set(SHAPES):
        p.error(f"--shapes: unknown {sorted(unknown)}; choose from {', '.join(SHAPES)}")
    args.shapes = [(SMOKE_SHAPES if args.smoke else SHAPES)[n] for n in names]
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    """Run the sections (or draw ``--plot``); returns the results as saved."""
    args = parse_args(argv)
    if args.plot:
        plot_results(args.plot, args.plot_out)
        return {}
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or --smoke (or --device cpu) on the CPU")
    threads = torch.get_num_threads()
    if args.smoke:
        torch.set_num_threads(1)  # tiny tensors: threads only add noise (and seconds on a busy CPU)
    try:
        return run(args, device, getattr(torch, args.dtype))
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    env = environment()
    print(f"device {env['device']}, torch {env['torch']}, triton {env['triton']}, transformers "
          f"{transformers.__version__}, {args.dtype}; sections {','.join(args.sections)}", flush=True)
    results = {"benchmark": "transformers", "transformers": transformers.__version__, "dtype": args.dtype,
               "smoke": args.smoke, "iters": args.iters, "rounds": args.rounds, "warmup": args.warmup,
               "warn_rel": args.warn_rel, "warnings": []}
    if "block" in args.sections:
        results["block"] = {"tokens": args.tokens, "impls": args.block_impls, "results": []}
    if "small" in args.sections:
        results["small"] = {"tokens": args.small_tokens, "impls": args.small_impls, "results": []}
    for shape in args.shapes if {"block", "small"} & set(args.sections) else []:
        block = build_block(shape, device, dtype)
        info = {"shape": shape.name, "block_class": type(block).__name__, "hidden": shape.hidden,
                "intermediate": shape.intermediate, "experts": shape.experts, "top_k": shape.top_k,
                "config_extra": dict(shape.extra), "params": sum(p.numel() for p in block.parameters())}
        print(f"{shape.name}: {info['block_class']}, {billions(info['params'])} params", flush=True)
        if "block" in args.sections:
            results["block"]["results"].append({**info, **bench_block(block, shape, args, device, dtype,
                                                                      results["warnings"])})
        if "small" in args.sections:
            results["small"]["results"] += [{**info, **row} for row in bench_small(block, shape, args, device, dtype,
                                                                                   results["warnings"])]
        del block
        free_memory(device)
    if "step" in args.sections:
        results["step"] = bench_step(args, device, dtype, results["warnings"])
    print_tables(results)
    out = args.out or REPO / "benchmarks" / "results" / f"transformers_{env['device'].replace(' ', '_')}.json"
    save_results(out, results)
    print(json.dumps({"saved": str(out)}), flush=True)
    return results


if __name__ == "__main__":
    main()
