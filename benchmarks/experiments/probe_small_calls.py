"""Small calls (1-64 tokens), one GPU: the forward rows kernel with the shape heuristic's config
(what an untuned small call runs) against other tiles (narrow N tiles fill the GPU with more
programs, long K steps keep more bytes in flight) and ``torch._grouped_mm``, each projection of
the HF block shapes (DeepSeek-V3 with all 256 experts, as transformers' block holds them, not the benchmarks'
EP=8 slice), uniform top-k routing; beside each, the
weight bytes of the experts the call touches over the GPU's measured copy rate (a reference
for a memory-bound call, not a hard floor: reads alone run a little faster than a copy).

    python benchmarks/experiments/probe_small_calls.py [--out small_calls.json]
"""
import argparse
import json

import torch
import triton

from ep_moe.kernels import grouped_gemm as gg
from ep_moe.kernels.config import KernelConfig
from ep_moe.autotune.space import GemmProblem, heuristic_config, bucket_for
from ep_moe.autotune.bench import device_limits

SHAPES = {"qwen3": (128, 2048, 768, 8), "gpt-oss": (32, 2880, 2880, 4), "mixtral": (8, 4096, 14336, 2),
          "deepseek-v3": (256, 7168, 2048, 8)}

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="small_calls.json")
    args = parser.parse_args()
    dev = device_limits(torch.device("cuda"))
    src_bytes = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst_bytes = torch.empty_like(src_bytes)
    copy_ms = triton.testing.do_bench(lambda: dst_bytes.copy_(src_bytes), return_mode="median")
    bytes_per_us = 2 * src_bytes.numel() / (copy_ms * 1e3)  # read + write traffic of the copy
    print(f"copy {bytes_per_us / 1e6:.2f} TB/s", flush=True)
    out = {"copy_tb_per_s": bytes_per_us / 1e6}
    candidates = [(32, 64, 128, 4, 4), (32, 64, 256, 4, 3), (32, 128, 128, 4, 4), (32, 128, 256, 4, 3), (32, 32, 256, 4, 4),
             (32, 256, 128, 8, 3)]
    for name, (E, H, I, k) in SHAPES.items():
        for proj in ("gate_up", "down"):
            n, kk = (2 * I, H) if proj == "gate_up" else (H, I)
            w = torch.randn(E, n, kk, device="cuda", dtype=torch.bfloat16) / kk ** 0.5
            problem = GemmProblem(projection=proj, num_local_experts=E, n=n, k=kk, top_k=k, dtype="bfloat16")
            for tokens in (1, 4, 16, 64):
                g = torch.Generator(device="cuda").manual_seed(tokens)
                ids = torch.rand(tokens, E, device="cuda", generator=g).topk(k, dim=1).indices.flatten()
                m_sizes = torch.bincount(ids, minlength=E).to(torch.int32)
                rows = tokens * k
                touched = int((m_sizes > 0).sum())
                floor_us = touched * n * kk * 2 / bytes_per_us  # the touched weights' bytes at the copy's rate
                x = torch.randn(rows, kk, device="cuda", dtype=torch.bfloat16)
                y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
                offs = torch.cumsum(m_sizes, 0, dtype=torch.int32)
                ref = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
                res = {"touched": touched, "floor_us": floor_us}
                res["grouped_mm"] = triton.testing.do_bench(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
                                                            return_mode="median") * 1e3
                heur = heuristic_config(problem, "forward", bucket_for(rows), dev)
                cfgs = {"heuristic " + heur.short(): heur}
                for bm, bn, bk, wa, st in candidates:
                    c = KernelConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=wa, num_stages=st)
                    cfgs[c.short()] = c
                for label, c in cfgs.items():
                    try:
                        gg.launch_rows(x, w, y, m_sizes, c, transpose_w=True)
                        torch.cuda.synchronize()
                        err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                        res[label] = triton.testing.do_bench(lambda: gg.launch_rows(x, w, y, m_sizes, c, transpose_w=True),
                                                             return_mode="median") * 1e3
                        if err > 2e-2:
                            res[label + " err"] = err
                    except Exception as exc:  # noqa: BLE001 - a tile that fails to compile is a result
                        res[label] = f"failed: {type(exc).__name__}"
                out[f"{name} {proj} {tokens}"] = res
                best = min((v, kq) for kq, v in res.items()
                           if isinstance(v, float) and kq in cfgs and not kq.startswith("heuristic"))
                h = [v for kq, v in res.items() if kq.startswith("heuristic")][0]
                print(f"{name:11s} {proj:7s} {tokens:3d} tok touched {touched:3d} floor {floor_us:7.1f} us | gmm "
                      f"{res['grouped_mm']:7.1f} | heur {h if isinstance(h, str) else round(h, 1)} ({heur.short()}) | best "
                      f"{best[0]:7.1f} {best[1]}", flush=True)
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
