"""``benchmarks/bench_train.py``: the trainer benchmark.

- pure functions: model FLOPs and MFU on a hand-computed example; the analytic parameter
  count against real ``MoETransformer``s (GQA, head_dim, tied embeddings, shared experts,
  GELU); the ``qwen3_ep`` preset parses into the shape it documents; kernel names
  to categories; the trace breakdown (interval arithmetic, launch-to-phase attribution,
  exposed communication, idle) on a synthetic GPU trace whose answer is worked out below;
- the CPU smoke run: the benchmark under torchrun with 2 gloo ranks on the ``tiny`` preset
  (EP=2), 1 warm-up + 2 timed + 1 profiled step, and its JSON checked (about 6 s);
- ``--experts hf_ep`` (transformers' own EP; needs transformers 5.21+ and ``accelerate``, else
  skipped): 2 gloo ranks on a tiny saved Qwen3-MoE, its first steps' losses against the EP=1
  run's (ep_moe's experts, DP=2), and its refusals;
- the scaling plot from result files (needs matplotlib, else skipped).

The trainer runs as a subprocess without ``TRITON_INTERPRET`` (its CPU path is torch's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_train  # noqa: E402
from bench_train import analyze_trace, exclusive_times, kernel_category, model_flops, union_length  # noqa: E402

from ep_moe import MoEConfig  # noqa: E402


@pytest.fixture
def train_modules():
    from ep_moe.train import config, model

    return config, model


# --- FLOPs and MFU --------------------------------------------------------------------------

def test_model_flops_hand_computed(train_modules):
    """tiny.toml's model: D=128, 2 layers, 4 heads of 32 (MHA), V=256 untied, 8 experts,
    top-2, SwiGLU I=128, L=64."""
    _, model = train_modules
    cfg = model.ModelConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4)
    moe = MoEConfig(hidden_size=128, num_experts=8, top_k=2, intermediate_size=128)
    f = model_flops(cfg, moe, seq_len=64)
    attn = 4 * 128 * 128                   # wq, wk, wv, wo: 65536
    router = 128 * 8                       # 1024
    expert = 2 * 128 * 128 + 128 * 128     # gate_up [2I, D] + down [D, I]: 49152
    active = 2 * (attn + router + 2 * expert) + 128 * 256
    assert active == 362_496 and f["active_params"] == active
    assert f["dense_flops_per_token"] == 6 * 362_496 == 2_174_976
    # causal QK^T and AV, fwd+bwd: 6 * layers * heads * head_dim * (L + 1) = 6 * 2 * 4 * 32 * 65
    assert f["attention_flops_per_token"] == 99_840
    assert f["flops_per_token"] == 2_274_816
    # every parameter: embedding + head + 2 * (attention, q/k norms, 2 norms, router, 8 experts) + final norm
    assert f["total_params"] == 256 * 128 * 2 + 2 * (attn + 2 * 32 + 2 * 128 + router + 8 * expert) + 128 == 985_856
    # 1000 tokens/s per GPU at a 1 TFLOP/s peak: 2.274816 GFLOP/s of 1000
    assert bench_train.mfu(1000.0, f["flops_per_token"], 1.0) == pytest.approx(2.274816e-3, rel=1e-12)
    assert bench_train.mfu(2000.0, 1e9, 4.0) == pytest.approx(0.5)


@pytest.mark.parametrize("shape", [
    dict(model=dict(vocab_size=256, dim=128, n_layers=2, n_heads=4), moe=dict(num_experts=8, top_k=2)),
    dict(model=dict(vocab_size=300, dim=64, n_layers=3, n_heads=8, n_kv_heads=2, head_dim=16, tie_embeddings=True,
                    qk_norm=False),
         moe=dict(num_experts=6, top_k=3, num_shared_experts=2, activation="gelu")),
    dict(model=dict(vocab_size=512, dim=96, n_layers=1, n_heads=6, n_kv_heads=3, head_dim=8),
         moe=dict(num_experts=4, top_k=1, num_shared_experts=1, shared_intermediate_size=40)),
])
def test_total_params_match_the_model(train_modules, shape):
    _, model = train_modules
    cfg = model.ModelConfig(**shape["model"])
    moe = MoEConfig(hidden_size=cfg.dim, intermediate_size=24, **shape["moe"])
    torch.manual_seed(0)
    net = model.MoETransformer(cfg, moe)
    assert model_flops(cfg, moe, 32)["total_params"] == sum(p.numel() for p in net.parameters())


def test_qwen3_ep_config(train_modules, monkeypatch):
    config, _ = train_modules
    monkeypatch.setattr(config, "host_memory_bytes", lambda: None)  # a GPU preset: not this host's to fit
    job = config.parse_args(["--config", "qwen3_ep"])
    m, moe, t = job.model, job.moe_config(), job.training
    assert (m.dim, m.n_layers, m.vocab_size, m.n_heads, m.kv_heads, m.head_size) == (2048, 4, 32768, 32, 4, 128)
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (128, 8, 768)
    assert (t.batch_size, t.seq_len, t.dtype) == (8, 1024, "bfloat16") and job.logging.sample_prompt == ""
    f = model_flops(m, moe, t.seq_len)  # the numbers the file's header states
    assert round(f["total_params"] / 1e9, 2) == 2.63 and round(f["expert_params"] / 1e9, 2) == 2.42
    assert round(f["active_params"] / 1e9, 2) == 0.29 and round(f["flops_per_token"] / 1e9, 2) == 1.87


# --- classification and interval arithmetic -----------------------------------------------

@pytest.mark.parametrize("name,cat,phase,stream,want", [
    ("_grouped_rows_kernel", "kernel", "forward", 7, "expert_gemm"),
    ("_grouped_dw_kernel", "kernel", "backward", 7, "expert_gemm"),
    ("_swiglu_kernel", "kernel", "backward", 7, "expert_elementwise"),
    ("_sum_slot_rows_kernel", "kernel", "forward", 7, "expert_elementwise"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "kernel", "forward", 7, "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80", "kernel", "backward", 7, "attention"),
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT", "kernel", "forward", 7, "dense_gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "kernel", "backward", 7, "dense_gemm"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "kernel", "forward", 7, "other_compute"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "kernel", "forward", 20, "exchange"),
    ("Memcpy PtoP (Device -> Device)", "gpu_memcpy", "forward", 30, "exchange"),
    ("Memcpy DtoD (Device -> Device)", "gpu_memcpy", "forward", 30, "exchange"),  # side stream: copy engines
    ("Memcpy DtoD (Device -> Device)", "gpu_memcpy", "forward", 7, "other_compute"),  # a local copy
    ("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", "forward", 7, "host_copy"),
    ("Memset (Device)", "gpu_memset", "backward", 7, "other_compute"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", "grad_sync", 20, "grad_sync"),
    ("CatArrayBatchedCopy", "kernel", "grad_sync", 7, "grad_sync"),
    ("multi_tensor_apply_kernel<FusedAdamMathFunctor>", "kernel", "optimizer", 7, "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", "clip", 20, "optimizer"),
])
def test_kernel_category(name, cat, phase, stream, want):
    assert kernel_category(name, cat, phase, stream, compute_stream=7) == want


def test_interval_arithmetic():
    assert union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    got = exclusive_times([(0, 4, "b"), (1, 2, "a"), (3, 6, "c"), (8, 9, "a")], ["a", "b", "c"], 0, 10)
    assert got == {"b": 3, "a": 2, "c": 2, "idle": 3}


def _synthetic_trace() -> list[dict]:
    """Four steps (lead-in, two measured, trailing) of one GPU, times in us. Host
    annotations and launches; every kernel runs after its launch. One all-reduce has no
    launch event (its own start time places it in the grad_sync phase)."""
    events = []

    def mark(name, start, end):
        events.append({"ph": "X", "cat": "user_annotation", "name": f"bench::{name}", "ts": start, "dur": end - start})

    def gpu(name, launch, start, end, stream=7, cat="kernel", correlation=None):
        correlation = correlation if correlation is not None else len(events) + 1000
        if launch is not None:
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launch, "dur": 1,
                           "args": {"correlation": correlation}})
        events.append({"ph": "X", "cat": cat, "name": name, "ts": start, "dur": end - start,
                       "args": {"correlation": correlation, "stream": stream}})

    mark("step", 0, 100)
    gpu("void at::native::elementwise_kernel", 50, 60, 90)
    mark("step", 100, 300)
    mark("forward", 110, 150)
    mark("grad_sync", 200, 220)
    mark("clip", 230, 240)
    gpu("Memcpy HtoD (Pageable -> Device)", 110, 120, 122, cat="gpu_memcpy")
    gpu("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", 112, 125, 135)
    gpu("void pytorch_flash::flash_fwd_kernel", 114, 135, 145)
    gpu("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 116, 140, 160, stream=20)
    gpu("_grouped_rows_kernel", 118, 160, 180)
    gpu("_swiglu_kernel", 119, 180, 185)
    gpu("_grouped_dw_kernel", 160, 190, 210)
    gpu("void at::native::vectorized_elementwise_kernel", 170, 210, 215)
    gpu("CatArrayBatchedCopy", 205, 215, 218)
    gpu("ncclDevKernel_AllReduce_Sum_f32_RING_LL", None, 218, 238, stream=20, correlation=999)
    gpu("multi_tensor_apply_kernel<LpNormFunctor>", 235, 240, 245)
    gpu("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 250, 245, 260)
    mark("step", 300, 500)
    mark("forward", 305, 330)
    mark("grad_sync", 400, 410)
    mark("clip", 420, 425)
    gpu("_grouped_rows_kernel", 310, 320, 400)
    gpu("Memcpy DtoD (Device -> Device)", 320, 390, 420, stream=30, cat="gpu_memcpy")
    mark("step", 500, 600)
    gpu("void at::native::elementwise_kernel", 510, 520, 530)
    return events


def test_analyze_trace_synthetic():
    """Window: step 1's first GPU activity (120) to step 3's (520), 2 steps of 200 us.
    Exclusive us over it: host_copy 2, dense_gemm 10, attention 10, exchange 15 + 20
    (145-160 uncovered; the side-stream DtoD copy 400-420), expert_gemm 20 + 20 + 80,
    expert_elementwise 5, other_compute 5, grad_sync 3 + 20, optimizer 5 + 15, idle 3 + 5
    + 2 + 60 + 100 = 170; halved per step."""
    b = analyze_trace(_synthetic_trace())
    assert b["available"] and b["steps_profiled"] == 2
    assert b["step_ms"] == pytest.approx(0.2) and b["step_ms_each"] == pytest.approx([0.2, 0.2])
    want = {"host_copy": 2, "dense_gemm": 10, "attention": 10, "exchange": 35, "expert_gemm": 120,
            "expert_elementwise": 5, "other_compute": 5, "grad_sync": 23, "optimizer": 20}
    for c, us in want.items():
        assert b["categories"][c]["exclusive_ms"] == pytest.approx(us / 2e3), c
    assert b["idle_ms"] == pytest.approx(170 / 2e3)
    assert b["categories"]["exchange"]["busy_ms"] == pytest.approx(50 / 2e3)
    assert b["categories"]["exchange"]["count"] == 1  # two activities over two steps
    assert b["exposed_comm_ms"] == pytest.approx({"exchange": 35 / 2e3, "grad_sync": 20 / 2e3})
    s = b["summary_ms"]
    assert s["experts"] == pytest.approx(125 / 2e3) and s["dense_attention"] == pytest.approx(25 / 2e3)
    assert s["exchange_exposed"] == pytest.approx(35 / 2e3) and s["grad_sync"] == pytest.approx(23 / 2e3)
    assert sum(s.values()) == pytest.approx(b["step_ms"])
    assert sum(b["fractions"].values()) == pytest.approx(1.0)
    assert b["compute_stream"] == 7 and b["launches_matched"] == pytest.approx(15 / 16)
    assert b["top_kernels"][0] == {"name": "_grouped_rows_kernel", "category": "expert_gemm", "ms": 0.05, "count": 1}
    # host phases, mean of the two measured steps (us): data (10, 5), forward (40, 25),
    # backward (50, 70), grad_sync (20, 10), clip (10, 5), optimizer (80, 90)
    want_host = {"step": 200, "data": 7.5, "forward": 32.5, "backward": 60, "grad_sync": 15, "clip": 7.5,
                 "optimizer": 85}
    assert b["host_phases_ms"] == pytest.approx({k: v / 1e3 for k, v in want_host.items()})


def test_analyze_trace_without_gpu_activity():
    events = [e for e in _synthetic_trace() if e["cat"] == "user_annotation"]
    b = analyze_trace(events)
    assert not b["available"] and "CPU" in b["reason"] and b["host_phases_ms"]["backward"] == pytest.approx(0.06)
    assert not analyze_trace([])["available"]


# --- the CPU smoke run ----------------------------------------------------------------------

@pytest.mark.distributed
def test_bench_train_cpu_two_ranks(tmp_path):
    out = tmp_path / "train.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "benchmarks" / "bench_train.py"), "--config", "tiny",
           "--device", "cpu", "--warmup", "1", "--steps", "2", "--profile-steps", "1",
           "--set", "training.batch_size=8", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert any(line.startswith("train tiny EP=2 ") for line in proc.stdout.splitlines()), proc.stdout[-2000:]
    r = json.loads(out.read_text())
    assert r["benchmark"] == "train" and r["device"] == "cpu" and r["torch"] == torch.__version__
    assert (r["world_size"], r["ep_size"], r["configuration"], r["model"]) == (2, 2, "EP=2", "tiny")
    assert r["tokens_per_step"] == 2 * 8 * 64 and r["timed_steps"] == 2 and len(r["step_ms_per_rank"]) == 2
    assert r["step_ms"] == max(r["step_ms_per_rank"]) > 0 and len(r["step_ms_rank0"]) == 2
    assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / (r["step_ms"] / 1e3))
    assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 2) and r["tokens_per_s"] > 0
    f = r["flops"]
    assert f["param_count_matches"] and f["flops_per_token"] == 2_274_816
    assert r["peak_source"] == "measured" and r["peak_tflops"] == r["measured_peak_tflops"] > 0
    assert r["mfu"] == pytest.approx(r["tokens_per_s_per_gpu"] * f["flops_per_token"] / (r["peak_tflops"] * 1e12))
    assert 0 < r["mfu"] < 1.5  # the CPU's own small-matmul rate as the peak
    assert r["losses_finite"] and 4.0 < r["loss_first"] < 7.0
    b = r["breakdown"]
    assert b["steps_profiled"] == 1 and not b["available"]  # CPU: host phases only
    phases = b["host_phases_ms"]
    assert {"forward", "backward", "grad_sync", "optimizer", "clip"} <= set(phases)
    assert all(v >= 0 for v in phases.values()) and phases["forward"] > 0 and phases["backward"] > 0
    assert [p["rank"] for p in r["breakdown_per_rank"]] == [0, 1]


def _bench(tmp_path: Path, name: str, hf_dir: Path, corpus: Path, *extra: str) -> tuple[dict, str]:
    """bench_train.py under torchrun, 2 gloo ranks, on an HF folder: 2 timed steps from step 1
    (no warm-up: the first loss is the initial weights'), fp32; (its JSON, its stdout)."""
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "benchmarks" / "bench_train.py"), "--hf-model", str(hf_dir), "--data", str(corpus),
           "--device", "cpu", "--warmup", "0", "--steps", "2", "--profile-steps", "0",
           "--set", "training.batch_size=2", "--set", "training.seq_len=16", "--set", "training.lr=1e-2",
           "--set", "training.warmup_steps=1", "--out", str(out), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def _hf_ep_available():
    """Skip unless transformers has its own EP layout (5.21+) and ``accelerate`` (which its
    distributed loading imports) is installed."""
    pytest.importorskip("accelerate")
    distributed = pytest.importorskip("transformers.distributed")
    if "ep_size" not in distributed.DistributedConfig.__dataclass_fields__:
        pytest.skip("transformers before 5.21: no DistributedConfig(ep_size=...)")


@pytest.mark.distributed
def test_bench_train_hf_ep_matches_ep1(tmp_path):
    """``--experts hf_ep --ep-size 2``: each rank holds 4 of the 8 experts through
    transformers' own plan, and rank 0's losses are those of the EP=1 run of the same
    folder and batches. fp32 and the same weights: step 1's loss differs only by the order in
    which the expert outputs are summed (transformers' grouped_mm after its all-to-all,
    against ep_moe's torch path), ~1e-7, so rel 1e-5; a rank running the wrong experts moves
    it (or step 2's, after one AdamW step at lr 1e-2) by far more than 1e-4. (AdamW's first
    step does not see a gradient's scale, so this does not check the gradients' averaging.)"""
    _hf_ep_available()
    from hf_models import tiny_model
    from text_data import sample_documents, train_tokenizer, write_jsonl

    hf_dir, corpus = tmp_path / "qwen3_moe", tmp_path / "docs.jsonl"
    model = tiny_model("qwen3_moe", vocab=320, std=0.05)  # 8 experts, top-2
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.01
    model.save_pretrained(hf_dir)
    train_tokenizer(hf_dir, sample_documents(60, seed=1))
    write_jsonl(corpus, sample_documents(200, seed=2))

    r, stdout = _bench(tmp_path, "hf_ep", hf_dir, corpus, "--ep-size", "2", "--experts", "hf_ep")
    ep1, _ = _bench(tmp_path, "ep1", hf_dir, corpus, "--ep-size", "1")
    assert any(line.startswith("train qwen3_moe EP=2 (world 2, EP 2, FSDP, transformers' own EP: grouped_mm")
               for line in stdout.splitlines()), stdout[-2000:]
    assert (r["experts"], r["configuration"], r["ep_size"], r["fsdp"]) == ("hf_ep", "EP=2", 2, True)
    h = r["hf_ep"]
    assert (h["ep_size"], h["fsdp_size"], h["efsdp_size"], h["experts_per_rank"]) == (2, 2, 1, 4)
    assert (h["ep_implementation_run"], h["experts_implementation"], h["weights"]) == \
        ("all_to_all", "grouped_mm", "the folder's")
    assert r["dispatch"] == "transformers all_to_all" and ep1["hf_ep"] is None
    assert r["tokens_per_step"] == ep1["tokens_per_step"] == 2 * 2 * 16
    assert r["flops"]["param_count_matches"] and r["flops"] == ep1["flops"]
    assert r["losses_finite"] and len(r["losses"]) == 2
    assert r["loss_first"] == pytest.approx(ep1["loss_first"], rel=1e-5)
    assert r["losses"][1] == pytest.approx(ep1["losses"][1], rel=1e-4)


def test_hf_ep_refusals():
    """``load_hf_ep`` refuses, before loading anything, the built-in model and EP=1."""
    _hf_ep_available()
    from types import SimpleNamespace

    training = SimpleNamespace(compile=False)
    built_in = SimpleNamespace(hf_spec=None, ranks=SimpleNamespace(ep_size=2), job=SimpleNamespace(training=training))
    with pytest.raises(ValueError, match="pass --hf-model"):
        bench_train.load_hf_ep(built_in)
    ep1 = SimpleNamespace(hf_spec=object(), ranks=SimpleNamespace(ep_size=1), job=SimpleNamespace(training=training))
    with pytest.raises(ValueError, match="--ep-size 2 or more"):
        bench_train.load_hf_ep(ep1)


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    files = []
    for model, scale in (("qwen3_ep", 1.0), ("gpu", 2.0)):
        for world, ep in ((1, 1), (4, 1), (4, 2), (4, 4)):
            step = 100.0 * (1 + 0.1 * (world > 1))
            per_gpu = scale * 8192 / (step / 1e3)
            r = {"benchmark": "train", "model": model, "device": "NVIDIA H100 80GB HBM3", "world_size": world,
                 "ep_size": ep, "configuration": bench_train.configuration_name(world, ep), "step_ms": step,
                 "tokens_per_s_per_gpu": per_gpu, "mfu": 0.3, "flops": {"active_params": 3e8, "total_params": 2.6e9},
                 "breakdown": {"available": True, "summary_ms": {"experts": 40.0, "idle": 10.0},
                               "fractions": {"experts": 0.8, "idle": 0.2}}}
            files.append(tmp_path / f"{model}_{world}_{ep}.json")
            files[-1].write_text(json.dumps(r))
    files.append(tmp_path / "other.json")
    files[-1].write_text(json.dumps({"benchmark": "ep"}))  # ignored
    png = bench_train.plot_results(files, tmp_path / "plot.png", tmp_path / "all.json")
    assert png.stat().st_size > 10_000
    assert len(json.loads((tmp_path / "all.json").read_text())) == 8
    assert [bench_train.configuration_name(w, e) for w, e in ((1, 1), (4, 1), (4, 2), (4, 4))] == \
        ["1 GPU", "DP=4", "EP=2xDP=2", "EP=4"]
