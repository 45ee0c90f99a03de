"""Trainer throughput: tokens/s per GPU, MFU and a per-step time breakdown of the trainer's
(``ep_moe.train``) training step, for ONE parallel configuration per run (a driver runs the matrix:
``benchmarks/run_train_gpu.sh``)::

    torchrun --nproc-per-node 1 benchmarks/bench_train.py --config qwen3_ep
    torchrun --nproc-per-node 4 benchmarks/bench_train.py --config qwen3_ep --ep-size 1  # DP=4
    torchrun --nproc-per-node 4 benchmarks/bench_train.py --config qwen3_ep --ep-size 2  # EP=2 x DP=2
    torchrun --nproc-per-node 4 benchmarks/bench_train.py --config qwen3_ep --ep-size 4  # EP=4
    torchrun --nproc-per-node 4 benchmarks/bench_train.py --config qwen3_ep --ep-size 4 \
        --set parallel.fsdp=true                                                   # EP=4, FSDP2
    python benchmarks/bench_train.py --plot benchmarks/results/train_*.json   # the scaling plot
    torchrun --nproc-per-node 2 benchmarks/bench_train.py --device cpu --steps 2   # CPU smoke run (tiny preset)
    torchrun --nproc-per-node 1 benchmarks/bench_train.py --hf-model DIR --data FILES \
        --set training.dtype=\'bfloat16\' --set training.param_dtype=\'bfloat16\'  # an HF model (hf preset)
    ... the same with --experts grouped_mm       # transformers' own experts: the baseline, same loop
    ... the same with --ep-size N --experts hf_ep  # transformers' own EP (its DistributedConfig), same loop

What runs is the trainer itself: ``ep_moe.train.trainer.Trainer`` built from the config (a
preset or a file, with ``--set``/``--ep-size`` overrides as for the trainer), its process groups, model,
AdamW, data and kernel warmup, and its ``train_step`` (forward, backward,
``ep_moe.parallel.sync_gradients``, gradient clipping, AdamW). The benchmark only switches
off evaluation, checkpoints, metrics and the sample, and sets ``training.steps`` to the
steps it runs (which changes the LR schedule, not the work).

Timing. ``--warmup`` steps, then ``--steps`` timed steps back to back (no host sync
between them, as in training): on CUDA an event is recorded on the current stream before
the first step and after each step, so each step's time is what the stream took from
one step boundary to the next, idle gaps included; on CPU, ``perf_counter`` around each
step. Per rank the median step; the run's step time is the slowest rank's median. Tokens/s
= global tokens per step (``batch_size * seq_len * world``) / step time; per GPU = / world.
The mean wall time of the timed steps (synchronize + ``perf_counter`` around them all) is
recorded too.

``--experts hf_ep`` (transformers 5.21+, and ``accelerate``, which its distributed loading
imports): the trainer is built as for ep_moe at ``--ep-size N``, then its model is replaced by
the same weights loaded through transformers' own parallelism, ``from_pretrained(DIR,
distributed_config=DistributedConfig(ep_size=N, fsdp_size=world))`` (a folder without weights:
the trainer's seeded init, exported to a temporary folder first): each rank keeps
``E / N`` experts (its ``base_model_ep_plan``: ``grouped_gemm`` shards, ``ep_dispatch_experts``
hooks; ``ep_implementation='auto'`` runs its all-to-all in training), its experts run
transformers' ``grouped_mm``, and the rest of the model is FSDP2-sharded over all ranks by
transformers (``fsdp_size`` = world is the layout in which its EP ranks hold different
batches). So every rank trains on its own batch, as under ep_moe's EP, and tokens/s counts the
same tokens; its peer in ep_moe is ``--set parallel.fsdp=true`` at the same ``--ep-size``.
The step is the trainer's FSDP step (no ``sync_gradients``: transformers' reduce-scatters
average the gradients; its mixed precision under ``training.dtype='bfloat16'`` with fp32
parameters). ``hf_ep`` in the JSON records the layout; the line says which EP ran.

MFU = tokens/s per GPU * model FLOPs per token / peak FLOP/s of one GPU. Model FLOPs per
token (:func:`model_flops`; forward + backward, no recomputation, no elementwise work):

- ``6 * N_active``: 2 FLOPs per multiply-add in the forward, 4 in the backward (the input
  and the weight gradients), for every weight a token multiplies. ``N_active`` counts per
  layer the attention projections ``D*(Hq + 2*Hkv)*Dh + Hq*Dh*D``, the router ``D*E``, the
  ``top_k`` routed experts a token visits ``top_k * (G*D + D*I)`` (``G`` = 2I for SwiGLU,
  else I) and the shared experts (same form, their intermediate size), plus the output
  head ``D*V`` (also when tied to the embedding). Not counted: the embedding lookup (no
  matmul), the norms, and the E - top_k experts a token does not visit.
- attention scores and values, which have no weights: per layer and query head, causal
  attention over a sequence of L tokens computes L(L+1)/2 (query, key) pairs; each costs
  2*Dh FLOPs in QK^T and 2*Dh in AV, so the forward is 2*Hq*Dh*L(L+1) per sequence; the
  backward is twice that (dQ and dK from the scores' gradient; dP and dV from the AV
  product), so fwd+bwd = 6*Hq*Dh*L(L+1) per sequence, per token
  ``6 * n_layers * Hq * Dh * (L + 1)`` (~ 6 * n_layers * L * dim when Hq*Dh = dim). What
  FlashAttention recomputes in its backward is hardware work, not model FLOPs.

The peak is ``--peak-tflops`` when given; in any case each rank times a large
``torch.matmul`` once (CUDA: 8192^3 in bf16, the mean of 10 after 3 warm-ups; CPU: 512^3
in fp32, only for the smoke run) and the slowest rank's rate is recorded as the measured
peak, with the MFU against it (``mfu_vs_measured_peak``) beside the MFU against the peak
used (``mfu``).

Breakdown (``--profile-steps`` P > 0): after the timed steps, P + 2 steps run under
``torch.profiler`` (CPU + CUDA activities; the first and the last only delimit the
others), with ``record_function`` ranges put around the trainer's pieces for those steps
only: the whole ``train_step`` (``bench::step``), ``Trainer._loss`` (``bench::forward``:
the forward and the loss), ``sync_gradients`` as called by the trainer module
(``bench::grad_sync``) and ``Trainer._clip_gradients`` (``bench::clip``). Host phases of
a step: forward, backward (from the end of the forward to the gradient sync), grad_sync,
optimizer (after the gradient sync: clipping, AdamW, zero_grad; clip also on its own).

Every GPU activity of the trace (``kernel``, ``gpu_memcpy``, ``gpu_memset`` events) is
tied to the host call that launched it (the ``correlation`` id of its ``cuda_runtime`` /
``cuda_driver`` launch; where none is found, its own start time stands in) and so to a
step and a phase, then classified (:func:`kernel_category`):

- launched in the grad_sync phase: ``grad_sync`` (NCCL all-reduces and the flatten /
  copy-back / divide kernels of ``sync_gradients``);
- launched in the optimizer phase: ``optimizer`` (clip norms and their EP all-reduce,
  fused AdamW);
- otherwise (forward and backward) by name, first match wins:
  ``exchange``: kernels whose name contains ``nccl`` (the EP all-to-all / all-gather /
  reduce-scatter), memcpys named ``PtoP``, and device-to-device memcpys on a stream other
  than the compute stream (the copy-engine dispatch's peer copies; the compute stream is
  the one with the most non-NCCL kernel time);
  ``host_copy``: HtoD / DtoH memcpys (batch upload, split-size reads);
  ``expert_gemm``: ``_grouped_rows_kernel``, ``_grouped_dw_kernel``, ``_segment_sum_kernel``
  or any name containing ``grouped`` (ep_moe's Triton grouped GEMMs: forward, dX, dW);
  ``expert_elementwise``: ``_swiglu_kernel``, ``_gather_rows_kernel``, ``_sum_slot_rows_kernel``
  (ep_moe's fused SwiGLU, row gather and slot sum);
  ``attention``: names containing ``flash``, ``fmha``, ``attention``, ``sdpa`` or ``attn``
  (SDPA's flash / memory-efficient / cuDNN kernels);
  ``dense_gemm``: ``gemm``, ``nvjet``, ``xmma``, ``cutlass``, ``cublas``, ``splitk``,
  ``matmul``, ``wgmma`` (cuBLAS: projections, router, output head);
  ``other_compute``: everything else (norms, RoPE, softmax / top-k / sort of the routing,
  cross-entropy, casts, memsets, local DtoD copies).

The CPU path of ep_moe (torch reference experts) has no Triton kernels, so on CPU there
is no device timeline at all: the breakdown then holds the host phases only
(``available: false``).

Interval arithmetic, over the window from the first GPU activity launched by the first
measured step to the first launched by the step after the last (so each step counts from
its first kernel to the next step's first kernel, idle gaps included; activities are
clipped to the window), per step = total / P:

- ``exclusive_ms``: each instant of the window goes to the highest-priority category
  active then, in the order expert_gemm, expert_elementwise, attention, dense_gemm,
  other_compute, optimizer, grad_sync, exchange, host_copy; an instant with nothing
  active is ``idle`` (host-bound: the GPU waits for launches, host syncs, the data).
  These sum to the step. So ``exchange``'s exclusive time is the exchange that no
  compute hides (the exposed exchange), including waiting for the slowest peer inside
  the NCCL kernel.
- ``busy_ms``: the union of the category's own intervals (overlap with others included);
  ``kernel_ms``: the sum of its durations (streams may overlap).
- ``exposed_comm_ms``: per category, the union of its communication activities (NCCL,
  peer / side-stream copies) minus the union of all compute activities (everything that
  is neither communication nor a host copy, whatever the phase).
- ``summary_ms``: dense_attention (attention + dense_gemm + other_compute), experts
  (expert_gemm + expert_elementwise), exchange_exposed, grad_sync, optimizer, host_copy,
  idle: exclusive times, summing to the profiled step.

The profiled step is slower than the timed one (profiler overhead); the fractions are
what to compare. ``top_kernels`` lists the largest kernels with the category given to
each, to check the classification on a new device or PyTorch version.

Under ``--set parallel.fsdp=true`` (FSDP2: ``ep_moe/train/trainer.py``) the gradients are
reduce-scattered inside the backward, so the ``grad_sync`` phase is empty (the backward
ends where the clip starts) and that time shows up in the backward's ``exchange`` (NCCL,
with FSDP's all-gathers) and idle time.

Memory: ``max_memory_gb`` is the largest ``torch.cuda.max_memory_allocated`` of any rank
over the whole run (building included: the model is built whole on each GPU before FSDP
shards it); ``max_memory_steps_gb`` the same over the training steps alone (peak stats
reset after the setup), the number to compare between replicated and FSDP runs.

Output: one JSON (rank 0; ``--out``, default
``benchmarks/results/train_<device>_<model>_w<world>_ep<ep>[_fsdp][_<experts>].json``) with the
environment, world / EP / DP sizes, whether FSDP shards the model (``fsdp``), tokens/s
(global and per GPU), step times of every rank, memory, FLOPs and parameter counts, peak
and MFU, the breakdown (rank 0's, and a summary of every rank's); and one line on stdout
starting ``train ``.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import gc
import gzip
import json
import logging
import math
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
DEFAULT_CONFIG = "tiny"
DEFAULT_HF_CONFIG = "hf"
"""The trainer's presets (``ep_moe/configs/train/``) without ``--config``."""

# --- kernel classification ------------------------------------------------------------

GPU_EVENT_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
EXPERT_GEMM_KEYS = ("_grouped_rows_kernel", "_grouped_dw_kernel", "_segment_sum_kernel", "grouped")
EXPERT_ELEMENTWISE_KEYS = ("_swiglu_kernel", "_gather_rows_kernel", "_sum_slot_rows_kernel")
ATTENTION_KEYS = ("flash", "fmha", "attention", "sdpa", "attn")
DENSE_GEMM_KEYS = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk", "matmul", "wgmma")
PRIORITY = ("expert_gemm", "expert_elementwise", "attention", "dense_gemm", "other_compute",
            "optimizer", "grad_sync", "exchange", "host_copy")
"""Exclusive-time order: an instant goes to the first of these active then."""
SUMMARY = {
    "dense_attention": ("attention", "dense_gemm", "other_compute"),
    "experts": ("expert_gemm", "expert_elementwise"),
    "exchange_exposed": ("exchange",),
    "grad_sync": ("grad_sync",),
    "optimizer": ("optimizer",),
    "host_copy": ("host_copy",),
    "idle": ("idle",),
}


def is_comm(name: str, cat: str, stream: Any, compute_stream: Any) -> bool:
    """Whether a GPU activity moves data between GPUs: an NCCL kernel, a peer memcpy, or a
    device-to-device memcpy on a stream other than the compute stream (copy engines)."""
    low = name.lower()
    if cat == "gpu_memcpy":
        return "ptop" in low or ("dtod" in low and stream != compute_stream)
    return "nccl" in low


def kernel_category(name: str, cat: str, phase: str, stream: Any = None, compute_stream: Any = None) -> str:
    """The breakdown category of one GPU activity (see the module docstring): by the phase
    that launched it for the gradient sync and the optimizer, else by name."""
    if phase == "grad_sync":
        return "grad_sync"
    if phase in ("optimizer", "clip"):
        return "optimizer"
    if is_comm(name, cat, stream, compute_stream):
        return "exchange"
    low = name.lower()
    if cat == "gpu_memcpy":
        return "host_copy" if ("htod" in low or "dtoh" in low) else "other_compute"
    if cat == "gpu_memset":
        return "other_compute"
    if any(k in low for k in EXPERT_GEMM_KEYS):
        return "expert_gemm"
    if any(k in low for k in EXPERT_ELEMENTWISE_KEYS):
        return "expert_elementwise"
    if any(k in low for k in ATTENTION_KEYS):
        return "attention"
    if any(k in low for k in DENSE_GEMM_KEYS):
        return "dense_gemm"
    return "other_compute"


# --- interval arithmetic ----------------------------------------------------------------

def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals."""
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def exclusive_times(intervals: Iterable[tuple[float, float, str]], priority: Sequence[str],
                    lo: float, hi: float) -> dict[str, float]:
    """Split [lo, hi] among categories: each instant goes to the highest-priority category
    (earliest in ``priority``; unknown ones after all of them) with an interval active then,
    or to ``"idle"``. Intervals are clipped to [lo, hi]; the values sum to hi - lo."""
    rank = {c: i for i, c in enumerate(priority)}
    points = []
    for s, e, c in intervals:
        s, e = max(s, lo), min(e, hi)
        if e > s:
            points.append((s, 1, c))
            points.append((e, -1, c))
    points.sort(key=lambda p: (p[0], p[1]))
    active: dict[str, int] = defaultdict(int)
    out: dict[str, float] = defaultdict(float)
    prev = lo
    for t, delta, c in points:
        if t > prev:
            live = [k for k, n in active.items() if n > 0]
            out[min(live, key=lambda k: (rank.get(k, len(rank)), k)) if live else "idle"] += t - prev
            prev = t
        active[c] += delta
    if hi > prev:
        out["idle"] += hi - prev
    return dict(out)


# --- the trace --------------------------------------------------------------------------

def _sync_range(step: dict[str, tuple[float, float]]) -> Optional[tuple[float, float]]:
    """The gradient sync's range of one step; under FSDP (no ``sync_gradients`` call: the
    backward reduce-scatters) an empty one where the clip starts, which ends the backward."""
    if "grad_sync" in step:
        return step["grad_sync"]
    clip = step.get("clip")
    return (clip[0], clip[0]) if clip else None


def _phase_of(t: float, step: dict[str, tuple[float, float]]) -> str:
    """The phase of host time ``t`` inside one step's annotated ranges."""
    for name in ("forward", "grad_sync", "clip"):
        rng = step.get(name)
        if rng and rng[0] <= t <= rng[1]:
            return name
    fwd, sync = step.get("forward"), _sync_range(step)
    if fwd and t < fwd[0]:
        return "data"
    if sync and t > sync[1]:
        return "optimizer"
    if fwd and t > fwd[1] and (sync is None or t < sync[0]):
        return "backward"
    return "step"


def _host_phases(step: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Host time (us) of each phase of one step, from its annotated ranges."""
    s0, s1 = step["step"]
    fwd, sync, clip = step.get("forward"), _sync_range(step), step.get("clip")
    out = {"step": s1 - s0}
    if fwd:
        out.update(data=fwd[0] - s0, forward=fwd[1] - fwd[0])
    if fwd and sync:
        out["backward"] = sync[0] - fwd[1]
    if sync:
        out.update(grad_sync=sync[1] - sync[0], optimizer=s1 - sync[1])
    if clip:
        out["clip"] = clip[1] - clip[0]
    return out


def analyze_trace(events: list[dict], top: int = 15) -> dict:
    """The breakdown of a chrome trace of P + 2 steps annotated as :func:`profile_steps`
    does (first and last steps only delimit); see the module docstring. Times in ms per
    measured step."""
    spans = [e for e in events if e.get("ph") == "X"]
    marks = sorted((e for e in spans if e.get("cat") == "user_annotation"
                    and str(e.get("name", "")).startswith("bench::")), key=lambda e: e["ts"])
    step_marks = [e for e in marks if e["name"] == "bench::step"]
    if not step_marks:
        return {"available": False, "reason": "no bench::step ranges in the trace"}
    steps = [{"step": (e["ts"], e["ts"] + e["dur"])} for e in step_marks]
    starts = [s["step"][0] for s in steps]

    def step_index(t: float) -> Optional[int]:
        i = bisect.bisect_right(starts, t) - 1
        return i if i >= 0 and t <= steps[i]["step"][1] else None

    for e in marks:
        if e["name"] == "bench::step":
            continue
        i = step_index(e["ts"])
        if i is not None:
            steps[i].setdefault(e["name"].removeprefix("bench::"), (e["ts"], e["ts"] + e["dur"]))
    measured = list(range(1, len(steps) - 1)) if len(steps) >= 3 else list(range(len(steps)))
    phases_us = defaultdict(list)
    for i in measured:
        for name, us in _host_phases(steps[i]).items():
            phases_us[name].append(us)
    host_phases_ms = {k: statistics.fmean(v) / 1e3 for k, v in phases_us.items()}
    result: dict[str, Any] = {"steps_profiled": len(measured), "host_phases_ms": host_phases_ms}

    gpu = [e for e in spans if e.get("cat") in GPU_EVENT_CATS]
    if not gpu:
        result.update(available=False, reason="no GPU activity in the trace (a CPU run: ep_moe's torch path "
                                              "launches no kernels); host phase times only")
        return result
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in spans
                 if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    stream_time: dict[Any, float] = defaultdict(float)
    for e in gpu:
        if e["cat"] == "kernel" and "nccl" not in e["name"].lower():
            stream_time[e.get("args", {}).get("stream")] += e["dur"]
    compute_stream = max(stream_time, key=stream_time.get) if stream_time else None

    acts = []  # (start, end, category, comm, step index, name)
    matched = 0
    for e in gpu:
        args = e.get("args", {})
        t = launch_ts.get(args.get("correlation"))
        matched += t is not None
        t = e["ts"] if t is None else t
        i = step_index(t)
        phase = _phase_of(t, steps[i]) if i is not None else "outside"
        stream = args.get("stream")
        acts.append((e["ts"], e["ts"] + e["dur"], kernel_category(e["name"], e["cat"], phase, stream, compute_stream),
                     is_comm(e["name"], e["cat"], stream, compute_stream), i, e["name"]))

    first = {}
    for s, _, _, _, i, _ in acts:
        if i is not None:
            first[i] = min(first.get(i, math.inf), s)
    if len(steps) >= 3 and all(i in first for i in range(1, len(steps))):
        bounds = [first[i] for i in range(1, len(steps))]  # one per measured step, and the next step's
        window = "first GPU activity of each measured step to that of the next step"
        n, step_ms_each = len(bounds) - 1, [(b - a) / 1e3 for a, b in zip(bounds, bounds[1:])]
    else:
        bounds = [min(a[0] for a in acts), max(a[1] for a in acts)]
        window = "first to last GPU activity of all steps (the steps' first activities were not all found)"
        n, step_ms_each = len(steps), []
    lo, hi = bounds[0], bounds[-1]
    clipped = [(max(s, lo), min(e, hi), c, comm, name) for s, e, c, comm, _, name in acts if min(e, hi) > max(s, lo)]

    exclusive = exclusive_times(((s, e, c) for s, e, c, _, _ in clipped), PRIORITY, lo, hi)
    by_cat: dict[str, list] = defaultdict(list)
    for s, e, c, _, _ in clipped:
        by_cat[c].append((s, e))
    categories = {}
    for c in list(PRIORITY) + sorted(set(by_cat) - set(PRIORITY)):
        ivs = by_cat.get(c, [])
        categories[c] = {"exclusive_ms": exclusive.get(c, 0.0) / n / 1e3, "busy_ms": union_length(ivs) / n / 1e3,
                         "kernel_ms": sum(e - s for s, e in ivs) / n / 1e3, "count": len(ivs) / n}
    compute = [(s, e) for s, e, c, comm, _ in clipped if not comm and c != "host_copy"]
    compute_union = union_length(compute)
    exposed = {}
    for c in sorted({c for _, _, c, comm, _ in clipped if comm}):
        comm_ivs = [(s, e) for s, e, cc, comm, _ in clipped if comm and cc == c]
        exposed[c] = (union_length(comm_ivs + compute) - compute_union) / n / 1e3
    idle = exclusive.get("idle", 0.0) / n / 1e3
    step_ms = (hi - lo) / n / 1e3
    summary = {k: (idle if k == "idle" else sum(categories[c]["exclusive_ms"] for c in cs))
               for k, cs in SUMMARY.items()}
    totals: dict[tuple[str, str], list] = {}
    for s, e, c, _, name in clipped:
        entry = totals.setdefault((name, c), [0.0, 0])
        entry[0] += e - s
        entry[1] += 1
    top_kernels = [{"name": name[:160], "category": c, "ms": us / n / 1e3, "count": cnt / n}
                   for (name, c), (us, cnt) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]]
    result.update(
        available=True, step_ms=step_ms, window=window,
        step_ms_each=step_ms_each,
        summary_ms=summary, fractions={k: v / step_ms if step_ms > 0 else 0.0 for k, v in summary.items()},
        categories=categories, exposed_comm_ms=exposed, idle_ms=idle, compute_stream=compute_stream,
        launches_matched=matched / len(gpu), top_kernels=top_kernels)
    return result


# --- FLOPs and MFU ----------------------------------------------------------------------

def model_flops(model_cfg: Any, moe_cfg: Any, seq_len: int) -> dict[str, Any]:
    """Parameter counts and model FLOPs per token (forward + backward) of ``ep_moe/train/model.py``'s
    ``MoETransformer`` (duck-typed: ``ModelConfig`` and ``MoEConfig`` fields); formulas in
    the module docstring. ``total_params`` counts every parameter as ``model.parameters()``
    would over all EP ranks (each expert once)."""
    D, V, n_layers = model_cfg.dim, model_cfg.vocab_size, model_cfg.n_layers
    Hq = model_cfg.n_heads
    Hkv = model_cfg.n_kv_heads or Hq
    Dh = model_cfg.head_dim or D // Hq
    E, k, I = moe_cfg.num_experts, moe_cfg.top_k, moe_cfg.intermediate_size
    swiglu = moe_cfg.activation == "swiglu"
    expert = (2 * I if swiglu else I) * D + D * I
    shared_i = (moe_cfg.shared_intermediate_size or moe_cfg.num_shared_experts * I) if moe_cfg.num_shared_experts else 0
    shared = ((2 * shared_i if swiglu else shared_i) * D + D * shared_i) if shared_i else 0
    attn = D * (Hq + 2 * Hkv) * Dh + Hq * Dh * D
    router = D * E
    norms = 2 * D + (2 * Dh if model_cfg.qk_norm else 0)
    embedding, head = V * D, D * V
    per_layer_total = attn + router + E * expert + shared + norms
    per_layer_active = attn + router + k * expert + shared
    total = embedding + (0 if model_cfg.tie_embeddings else head) + n_layers * per_layer_total + D
    active = n_layers * per_layer_active + head
    attention_flops = 6 * n_layers * Hq * Dh * (seq_len + 1)
    return {
        "total_params": total,
        "expert_params": n_layers * E * expert,
        "active_params": active,
        "active_params_by_part": {"attention": n_layers * attn, "router": n_layers * router,
                                  "routed_experts": n_layers * k * expert, "shared_experts": n_layers * shared,
                                  "output_head": head},
        "dense_flops_per_token": 6 * active,
        "attention_flops_per_token": attention_flops,
        "flops_per_token": 6 * active + attention_flops,
        "formula": "6 * active_params + 6 * n_layers * n_heads * head_dim * (seq_len + 1)",
    }


def hf_model_flops(hf_model: Any, seq_len: int, ep_size: int) -> dict[str, Any]:
    """:func:`model_flops` of a Hugging Face MoE model (``model.hf``), from its parameters:
    every matrix a token multiplies counts (the ``[e, ., .]`` expert tensors at ``top_k / E``
    of the model's experts, this rank holding ``e = E / ep_size``), vectors (norms, biases)
    and the input embedding do not; the attention scores as in the module docstring, over
    every layer (sliding-window layers are counted as full ones)."""
    from ep_moe.integrations.transformers import experts_modules

    config = hf_model.config.get_text_config()
    embedding = hf_model.get_input_embeddings().weight
    expert_names = {f"{name}.{t}" for name, m in experts_modules(hf_model) for t, _ in m.named_parameters()}
    dense_matrices = sum(p.numel() for n, p in hf_model.named_parameters()
                         if p.dim() >= 2 and n not in expert_names and p is not embedding)
    experts_local = sum(p.numel() for n, p in hf_model.named_parameters() if n in expert_names)
    experts_total = experts_local * ep_size
    first = experts_modules(hf_model)[0][1]
    # ep_moe's experts record the global count; transformers' own EP (DTensors) has the global shape
    E = getattr(first, "num_global_experts", None) or next(first.parameters()).shape[0]
    routed = experts_total * config.num_experts_per_tok // E
    active = dense_matrices + routed
    if config.tie_word_embeddings:
        active += embedding.numel()  # the output head multiplies it
    Hq = config.num_attention_heads
    Dh = getattr(config, "head_dim", None) or config.hidden_size // Hq
    attention_flops = 6 * config.num_hidden_layers * Hq * Dh * (seq_len + 1)
    total = sum(p.numel() for n, p in hf_model.named_parameters() if n not in expert_names) + experts_total
    return {
        "total_params": total,
        "expert_params": experts_total,
        "active_params": active,
        "active_params_by_part": {"dense_matrices": dense_matrices, "routed_experts": routed},
        "dense_flops_per_token": 6 * active,
        "attention_flops_per_token": attention_flops,
        "flops_per_token": 6 * active + attention_flops,
        "formula": "6 * active_params + 6 * n_layers * n_heads * head_dim * (seq_len + 1)",
    }


def mfu(tokens_per_s_per_gpu: float, flops_per_token: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s of one GPU over its peak."""
    return tokens_per_s_per_gpu * flops_per_token / (peak_tflops * 1e12)


def measure_peak_tflops(device: torch.device, n: Optional[int] = None, iters: int = 10, warmup: int = 3
                        ) -> tuple[float, str, int]:
    """Achieved matmul TFLOP/s on ``device``: (rate, dtype, size). CUDA: n^3 bf16 (n=8192),
    the mean over ``iters`` back-to-back products after ``warmup``; CPU: fp32 (n=512)."""
    if device.type == "cuda":
        n, dtype = n or 8192, torch.bfloat16
    else:
        n, dtype, iters, warmup = n or 512, torch.float32, min(iters, 5), 1
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    for _ in range(warmup):
        c = a @ b
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(iters):
            c = a @ b
        end.record()
        torch.cuda.synchronize(device)
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            c = a @ b
        seconds = time.perf_counter() - t0
    del a, b, c
    return 2 * n ** 3 * iters / seconds / 1e12, str(dtype).removeprefix("torch."), n


# --- names ------------------------------------------------------------------------------

def configuration_name(world: int, ep: int) -> str:
    """``1 GPU``, ``DP=4``, ``EP=4`` or ``EP=2xDP=2``."""
    if world == 1:
        return "1 GPU"
    if ep == 1:
        return f"DP={world}"
    if ep == world:
        return f"EP={ep}"
    return f"EP={ep}xDP={world // ep}"


def device_tag(name: str) -> str:
    """A device name as a file-name part (as ``ep_moe/autotune/shipped/`` names its folders)."""
    return re.sub(r"[^A-Za-z0-9.]+", "_", name).strip("_") or "unknown"


def _environment(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node()}
    for name in ("triton", "transformers"):
        module = sys.modules.get(name)  # transformers only where an HF model was trained
        info[name] = getattr(module, "__version__", None)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=props.name, sm_count=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                    gpu_memory_gb=props.total_memory / 2**30)
    else:
        info["device"] = "cpu"
    return info


# --- running the trainer ----------------------------------------------------------------

def _trainer_modules():
    """The trainer's config and trainer modules (imported when a run needs them: ``--plot``
    does not)."""
    from ep_moe.train import config as train_config, trainer as trainer_module

    return train_config, trainer_module


def build_job(args: argparse.Namespace, total_steps: int):
    """The trainer's ``JobConfig``: the config and the overrides as the trainer reads them,
    then what the benchmark needs (no evaluation, checkpoints, metrics, sample)."""
    train_config, _ = _trainer_modules()
    argv = ["--config", str(args.config)]
    if args.hf_model:
        argv += ["--hf-model", args.hf_model, "--data", args.data]
    for assignment in args.overrides:
        argv += ["--set", assignment]
    if args.ep_size is not None:
        argv += ["--ep-size", str(args.ep_size)]
    if args.device:
        argv += ["--set", f"training.device='{args.device}'"]
    argv += ["--steps", str(total_steps),
             "--set", "logging.eval_interval=0", "--set", "logging.progress_bar=false",
             "--set", "logging.sample_prompt=''", "--set", "logging.metrics_file=''",
             "--set", "checkpoint.interval=-1", "--set", "checkpoint.resume=''"]
    return train_config.parse_args(argv)


def time_steps(trainer, first_step: int, n: int) -> dict:
    """Run ``n`` training steps back to back; per-step times (ms), the mean wall time and
    the losses."""
    import torch.distributed as dist

    cuda = trainer.ranks.device.type == "cuda"
    losses = []
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        t0 = time.perf_counter()
        marks[0].record()
        for i in range(n):
            losses.append(trainer.train_step(first_step + i)[0])
            marks[i + 1].record()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        step_ms = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    else:
        step_ms = []
        t0 = time.perf_counter()
        for i in range(n):
            t = time.perf_counter()
            losses.append(trainer.train_step(first_step + i)[0])
            step_ms.append((time.perf_counter() - t) * 1e3)
        wall = time.perf_counter() - t0
    return {"step_ms": step_ms, "median_ms": statistics.median(step_ms), "wall_mean_ms": wall / n * 1e3,
            "losses": [float(x) for x in losses]}


@contextmanager
def _annotated(trainer, trainer_module):
    """``record_function`` ranges around the trainer's forward+loss, gradient sync and
    clipping (instance / module attributes, restored on exit)."""
    from torch.profiler import record_function

    def wrap(fn, name):
        def wrapped(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)
        return wrapped

    sync = trainer_module.sync_gradients
    trainer_module.sync_gradients = wrap(sync, "bench::grad_sync")
    trainer._loss = wrap(trainer._loss, "bench::forward")
    trainer._clip_gradients = wrap(trainer._clip_gradients, "bench::clip")
    try:
        yield
    finally:
        trainer_module.sync_gradients = sync
        del trainer._loss, trainer._clip_gradients


def profile_steps(trainer, trainer_module, first_step: int, n: int, trace_path: Optional[Path] = None) -> dict:
    """Run ``n + 2`` annotated steps under ``torch.profiler`` and return
    :func:`analyze_trace` of them (the first and last only delimit the ``n``)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = trainer.ranks.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with _annotated(trainer, trainer_module):
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for i in range(n + 2):
                with record_function("bench::step"):
                    trainer.train_step(first_step + i)
            if cuda:
                torch.cuda.synchronize()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            raw = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(raw)
            if trace_path is not None:
                trace_path.parent.mkdir(parents=True, exist_ok=True)
                with open(raw, "rb") as src, gzip.open(trace_path, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            with open(raw) as f:
                events = json.load(f)["traceEvents"]
        return analyze_trace(events)
    except Exception as exc:  # the numbers above stand without it
        return {"available": False, "reason": f"trace analysis failed: {type(exc).__name__}: {exc}"}


def _count_params(model) -> tuple[int, int]:
    """(replicated, this rank's expert) parameter counts."""
    from ep_moe.parallel import is_expert_param

    dense = sum(p.numel() for p in model.parameters() if not is_expert_param(p))
    experts = sum(p.numel() for p in model.parameters() if is_expert_param(p))
    return dense, experts


class _Capture(logging.Handler):
    """Keeps the trainer's log line about where the kernel configs came from."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("kernel configs"):
            self.lines.append(message)


def run(args: argparse.Namespace) -> Optional[dict]:
    """Build the trainer, time it, profile it; rank 0 returns (and writes) the result."""
    import torch.distributed as dist

    profiled = args.profile_steps + 2 if args.profile_steps > 0 else 0
    job = build_job(args, args.warmup + args.steps + profiled)
    _, trainer_module = _trainer_modules()
    capture = _Capture()
    logging.getLogger("ep_moe.train").addHandler(capture)
    t_build = time.perf_counter()
    trainer = trainer_module.Trainer(job)
    try:
        hf_ep = None
        if args.experts == "hf_ep":
            hf_ep = load_hf_ep(trainer)
        elif args.experts != "ep_moe":
            if trainer.ranks.ep_size > 1:
                raise ValueError(f"--experts {args.experts}: transformers' own experts run at EP=1 only; "
                                 "pass --ep-size 1, or --experts hf_ep for transformers' own EP")
            trainer.model.hf.set_experts_implementation(args.experts)
        build_s = time.perf_counter() - t_build
        ranks, device = trainer.ranks, trainer.ranks.device
        cuda = device.type == "cuda"
        measured_peak, peak_dtype, peak_n = measure_peak_tflops(device)
        setup_memory = None
        if cuda:  # the setup's peak (the whole model before FSDP shards it, the peak matmul) apart
            setup_memory = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
        step = 1
        for _ in range(args.warmup):
            trainer.train_step(step)
            step += 1
        timing = time_steps(trainer, step, args.steps)
        step += args.steps
        breakdown = None
        if args.profile_steps > 0:
            trace = None
            if args.trace_dir:
                name = f"{Path(args.config).stem}_w{ranks.world_size}_ep{ranks.ep_size}_rank{ranks.rank}"
                trace = Path(args.trace_dir) / f"trace_{name}.json.gz"
            breakdown = profile_steps(trainer, trainer_module, step, args.profile_steps, trace)
        dense, experts = _count_params(trainer.model)
        mine = {"rank": ranks.rank, "median_ms": timing["median_ms"], "wall_mean_ms": timing["wall_mean_ms"],
                "step_ms": timing["step_ms"], "losses": timing["losses"], "measured_peak_tflops": measured_peak,
                "max_memory_steps_gb": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
                "max_memory_setup_gb": setup_memory,
                "breakdown": breakdown, "params": (dense, experts)}
        every = [None] * ranks.world_size
        dist.all_gather_object(every, mine)
        if ranks.rank != 0:
            return None
        return _result(args, job, trainer, every, build_s, peak_dtype, peak_n, capture.lines, hf_ep)
    finally:
        logging.getLogger("ep_moe.train").removeHandler(capture)
        trainer.close()


def load_hf_ep(trainer) -> dict:
    """``--experts hf_ep``: replace the trainer's model (an HF model split by ep_moe) with the
    same weights loaded through transformers' own expert parallelism (module docstring), a new
    AdamW over them, and the trainer's FSDP step; returns the layout for the result. Call on
    every rank."""
    import torch.distributed as dist
    import transformers
    from transformers.distributed import DistributedConfig

    from ep_moe.integrations.transformers import experts_modules
    from ep_moe.train.hf_model import HFCausalLM

    _, trainer_module = _trainer_modules()
    spec, ranks, tcfg = trainer.hf_spec, trainer.ranks, trainer.job.training
    if spec is None:
        raise ValueError("--experts hf_ep: transformers' own EP runs an HF model; pass --hf-model")
    if ranks.ep_size < 2:
        raise ValueError("--experts hf_ep: pass --ep-size 2 or more (transformers' own experts at EP=1: "
                         "--experts grouped_mm)")
    if "ep_size" not in DistributedConfig.__dataclass_fields__:
        raise ValueError(f"--experts hf_ep: transformers {transformers.__version__} has no "
                         "DistributedConfig(ep_size=...) (5.21+); its EP before that (enable_expert_parallel with "
                         "tp_size=world) runs every rank on the same batch")
    if tcfg.compile:
        raise ValueError("--experts hf_ep: training.compile compiles the trainer's model, not the one "
                         "transformers loads; set training.compile=false")
    if trainer.job.moe.get("expert_precision", "bf16") != "bf16":
        raise ValueError("--experts hf_ep: moe.expert_precision is ep_moe's; transformers' own experts run in the "
                         "compute dtype, so leave it at 'bf16'")
    path, tmp = spec.path, [None]
    if not spec.has_weights:  # a config only: the trainer's seeded init, as an HF folder (rank 0's /tmp: one host)
        tmp = [tempfile.mkdtemp(prefix="bench_hf_ep_") if ranks.rank == 0 else None]
        dist.broadcast_object_list(tmp)
    config = DistributedConfig(ep_size=ranks.ep_size, fsdp_size=ranks.world_size,
                               fsdp_mixed_precision=tcfg.dtype == "bfloat16" and tcfg.param_dtype == "float32")
    try:
        if tmp[0] is not None:
            trainer.model.export(tmp[0])
            path = tmp[0]
        trainer.model = trainer.optimizer = None
        gc.collect()
        if ranks.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(ranks.device)  # the memory figures leave out the dropped model
        hf = spec.model_class.from_pretrained(
            path, distributed_config=config, experts_implementation="grouped_mm",
            dtype=torch.bfloat16 if tcfg.param_dtype == "bfloat16" else torch.float32)
    finally:
        if tmp[0] is not None:  # every rank has read it
            dist.barrier()
            if ranks.rank == 0:
                shutil.rmtree(tmp[0], ignore_errors=True)
    hf.config.use_cache = False
    model = HFCausalLM(hf)
    if tcfg.activation_checkpointing:
        model.enable_activation_checkpointing()
    model.train()
    trainer.model = model
    trainer.optimizer = trainer_module.build_optimizer(model, tcfg, ranks.device)
    trainer.ranks = dataclasses.replace(ranks, fsdp=True)  # the step of a sharded model: no sync_gradients
    return {"transformers": transformers.__version__, "ep_size": config.ep_size, "fsdp_size": config.fsdp_size,
            "efsdp_size": config.efsdp_size, "ep_implementation": config.ep_implementation,
            # 'auto' (AutoEP) all-reduces only where an EP group shares one batch (ep_size == tp_size), at inference
            "ep_implementation_run": "all_to_all" if config.ep_implementation == "auto" else config.ep_implementation,
            "experts_per_rank": experts_modules(hf)[0][1].num_experts,
            "fsdp_mixed_precision": config.fsdp_mixed_precision,
            "experts_implementation": hf.config._experts_implementation,
            "weights": "the folder's" if tmp[0] is None else "the trainer's init, exported",
            "batches": "one per rank (as ep_moe's EP)"}


def _dispatch_run(trainer) -> str:
    """The dispatch the model's MoE layers run (``"auto"`` resolved; ``"local"`` at EP=1;
    an HF model's experts pick theirs per call, so the config's)."""
    from ep_moe.layer import moe_layers

    layers = moe_layers(trainer.model)
    return layers[0].dispatch if layers else trainer.job.moe.get("dispatch", "auto")


def _result(args, job, trainer, every: list[dict], build_s: float, peak_dtype: str, peak_n: int,
            kernel_log: list[str], hf_ep: Optional[dict] = None) -> dict:
    ranks, tcfg = trainer.ranks, job.training
    world, ep = ranks.world_size, ranks.ep_size
    step_ms = max(r["median_ms"] for r in every)
    tokens_per_s = trainer.tokens_per_step / (step_ms / 1e3)
    per_gpu = tokens_per_s / world
    hf = job.model.hf
    flops = (hf_model_flops(trainer.model.hf, tcfg.seq_len, 1 if hf_ep else ep) if hf  # hf_ep: DTensors, global
             else model_flops(job.model, job.moe_config(), tcfg.seq_len))
    dense, experts = every[0]["params"]
    counted = dense + experts * ep
    flops["counted_params"] = counted
    flops["param_count_matches"] = counted == flops["total_params"]
    measured = min(r["measured_peak_tflops"] for r in every)
    peak = args.peak_tflops if args.peak_tflops else measured
    breakdown = every[0]["breakdown"]
    env = _environment(ranks.device)
    losses = every[0]["losses"]
    return {
        "benchmark": "train",
        "environment": env,
        "device": env["device"], "torch": env["torch"], "triton": env["triton"],
        "model": args.label or Path(args.hf_model or args.config).name.removesuffix(".toml"), "config": str(args.config), "overrides": args.overrides,
        "configuration": configuration_name(world, ep), "fsdp": job.parallel.fsdp or hf_ep is not None,
        "world_size": world, "ep_size": ep, "dp_size": world, "edp_size": world // ep,
        "dispatch": f"transformers {hf_ep['ep_implementation_run']}" if hf_ep else _dispatch_run(trainer),
        "dispatch_config": job.moe.get("dispatch", "auto"),
        "experts": args.experts if hf else "ep_moe", "hf_ep": hf_ep, "param_dtype": tcfg.param_dtype,
        "cuda_graphs": "on" if trainer.graphs_off is None else f"off: {trainer.graphs_off}", "dtype": tcfg.dtype,
        "batch_size": tcfg.batch_size, "seq_len": tcfg.seq_len,
        "tokens_per_step": trainer.tokens_per_step, "tokens_per_step_per_gpu": trainer.tokens_per_step // world,
        "warmup_steps": args.warmup, "timed_steps": args.steps, "profiled_steps": args.profile_steps,
        "step_ms": step_ms, "step_ms_per_rank": [r["median_ms"] for r in every],
        "step_ms_wall_mean": max(r["wall_mean_ms"] for r in every), "step_ms_rank0": every[0]["step_ms"],
        "tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": per_gpu,
        "flops": flops,
        "peak_tflops": peak, "peak_source": "--peak-tflops" if args.peak_tflops else "measured",
        "measured_peak_tflops": measured, "measured_peak_per_rank": [r["measured_peak_tflops"] for r in every],
        "measured_peak_matmul": f"{peak_n}^3 {peak_dtype}",
        "mfu": mfu(per_gpu, flops["flops_per_token"], peak),
        "mfu_vs_measured_peak": mfu(per_gpu, flops["flops_per_token"], measured),
        "model_tflops_per_gpu": per_gpu * flops["flops_per_token"] / 1e12,
        "losses": losses, "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "losses_finite": all(math.isfinite(r_loss) for r in every for r_loss in r["losses"]),
        "max_memory_gb": max(max(r["max_memory_steps_gb"], r["max_memory_setup_gb"]) for r in every)
        if ranks.device.type == "cuda" else None,
        "max_memory_steps_gb": max(r["max_memory_steps_gb"] for r in every) if ranks.device.type == "cuda" else None,
        "setup_s": build_s, "kernel_configs": kernel_log,
        "breakdown": breakdown,
        "breakdown_per_rank": [{"rank": r["rank"], **{k: (r["breakdown"] or {}).get(k) for k in
                                                      ("step_ms", "summary_ms", "exposed_comm_ms", "host_phases_ms")}}
                               for r in every] if breakdown is not None else None,
    }


def summary_line(result: dict) -> str:
    """The one-line stdout summary of a result."""
    fsdp = ", FSDP" if result.get("fsdp") else ""
    experts = "" if result.get("experts", "ep_moe") == "ep_moe" else f", experts {result['experts']}"
    if result.get("hf_ep"):
        experts = f", transformers' own EP: {result['hf_ep']['experts_implementation']} experts, {result['dispatch']}"
    line = (f"train {result['model']} {result['configuration']} (world {result['world_size']}, "
            f"EP {result['ep_size']}{fsdp}{experts}) on {result['device']}: {result['step_ms']:.1f} ms/step | {result['tokens_per_s']:,.0f} tok/s | "
            f"{result['tokens_per_s_per_gpu']:,.0f} tok/s/GPU | MFU {100 * result['mfu']:.1f}% of "
            f"{result['peak_tflops']:.4g} TFLOP/s ({result['peak_source']}; "
            f"{100 * result['mfu_vs_measured_peak']:.1f}% of measured {result['measured_peak_tflops']:.4g})")
    if result.get("max_memory_steps_gb") is not None:
        line += (f" | max memory {result['max_memory_steps_gb']:.1f} GB in steps "
                 f"({result['max_memory_gb']:.1f} GB in all)")
    b = result.get("breakdown") or {}
    if b.get("available"):
        line += " | " + " ".join(f"{k} {100 * v:.0f}%" for k, v in b["fractions"].items())
    elif b.get("host_phases_ms"):
        line += " | host ms: " + " ".join(f"{k} {v:.1f}" for k, v in b["host_phases_ms"].items() if k != "step")
    return line


# --- the plot ---------------------------------------------------------------------------

def plot_results(paths: Sequence[str | Path], out: Optional[str | Path] = None,
                 combined_out: Optional[str | Path] = None) -> Path:
    """The scaling figure of these result files (:func:`plot.plot_train`: per-GPU tokens/s
    by configuration, one panel per model, MFU on each bar, the one-GPU rate as the ceiling;
    below, each profiled step's breakdown). Writes ``out`` (default
    ``benchmarks/results/train_scaling_<device>.png``) and, if given, all runs as one JSON
    list in ``combined_out``; prints a table. Returns the PNG path."""
    from plot import plot_train, train_runs

    runs = train_runs(paths)
    if not runs:
        raise SystemExit(f"--plot: no bench_train results in {list(map(str, paths))}")
    devices = sorted({r["device"] for r in runs})
    out = Path(out) if out else RESULTS / f"train_scaling_{device_tag('+'.join(devices))}.png"
    names = [Path(p).name for p in paths]
    plot_train(runs, out, ", ".join(names) if len(names) <= 3 else f"{len(names)} files in {Path(paths[0]).parent}")
    if combined_out:
        Path(combined_out).parent.mkdir(parents=True, exist_ok=True)
        Path(combined_out).write_text(json.dumps(runs, indent=1) + "\n")
    return out


# --- command line -----------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None,
                        help=f"the trainer's config, a preset or a TOML file (default: {DEFAULT_CONFIG}, with "
                             f"--hf-model {DEFAULT_HF_CONFIG})")
    parser.add_argument("--hf-model", default="", help="train this HF model folder (the trainer's --hf-model)")
    parser.add_argument("--data", default="", help="with --hf-model: the data (the trainer's --data)")
    parser.add_argument("--experts", default="ep_moe", choices=("ep_moe", "grouped_mm", "batched_mm", "eager", "hf_ep"),
                        help="with --hf-model at EP=1: the experts implementation; anything but ep_moe is "
                             "transformers' own, the baseline; hf_ep (--ep-size N > 1): transformers' own expert "
                             "parallelism, see above (default: %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value, as the trainer's --set; repeatable")
    parser.add_argument("--ep-size", type=int, default=None,
                        help="expert-parallel size (1: pure data parallel; default: the config's, 0 = world)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                        help="training.device (default: the config's)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default: %(default)s)")
    parser.add_argument("--profile-steps", type=int, default=3,
                        help="steps of the profiled breakdown (plus one before and one after; 0: none; "
                             "default: %(default)s)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak bf16 TFLOP/s of one GPU for the MFU (default: the measured matmul rate)")
    parser.add_argument("--label", default="", help="model name in the results (default: the config's file stem)")
    parser.add_argument("--out", type=Path, default=None,
                        help="result JSON (default: benchmarks/results/train_<device>_<model>_w<world>_ep<ep>.json)")
    parser.add_argument("--trace-dir", default="", help="also keep each rank's gzipped chrome trace here")
    parser.add_argument("--plot", nargs="+", metavar="JSON", default=None,
                        help="no run: plot these result files (and exit)")
    parser.add_argument("--plot-out", type=Path, default=None,
                        help="with --plot: the PNG (default: benchmarks/results/train_scaling_<device>.png)")
    parser.add_argument("--combined-out", type=Path, default=None,
                        help="with --plot: also write every run as one JSON list here")
    args = parser.parse_args(argv)
    if args.config is None:
        args.config = DEFAULT_HF_CONFIG if args.hf_model else DEFAULT_CONFIG
    if args.plot is None and (args.warmup < 0 or args.steps < 1 or args.profile_steps < 0):
        parser.error("--warmup and --profile-steps must be >= 0, --steps >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.plot is not None:
        plot_results(args.plot, args.plot_out, args.combined_out)
        return
    import torch.distributed as dist

    rank0 = int(os.environ.get("RANK", "0")) == 0
    logging.basicConfig(level=logging.INFO if rank0 else logging.WARNING, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        result = run(args)
        if result is not None:
            out = args.out or RESULTS / (f"train_{device_tag(result['device'])}_{result['model']}_"
                                         f"w{result['world_size']}_ep{result['ep_size']}"
                                         f"{'_fsdp' if result['fsdp'] else ''}"
                                         f"{'' if result['experts'] == 'ep_moe' else '_' + result['experts']}.json")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1) + "\n")
            print(summary_line(result), flush=True)
            print(f"result: {out}", flush=True)
    finally:
        if dist.is_initialized():
            _, trainer_module = _trainer_modules()
            trainer_module.destroy_distributed()


if __name__ == "__main__":
    main()
