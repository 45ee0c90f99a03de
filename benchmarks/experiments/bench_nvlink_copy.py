"""How fast can rows cross NVLink between the GPUs of one node, and what does each way
cost a matmul running beside it? NCCL against the copy engines and against SM loads/stores.

    torchrun --nproc-per-node 4 benchmarks/experiments/bench_nvlink_copy.py [--rows 2048,8192] [--hidden 7168]

Every rank sends ``rows`` rows of ``hidden`` bf16 to every rank (itself included), as an
EP dispatch with even splits does; GB/s counts the bytes that leave a GPU. The ways:

- ``nccl``: ``all_to_all_single`` (NCCL's kernels);
- ``ce_serial`` / ``ce_streams``: every receiver pulls its rows out of the senders'
  symmetric-memory buffers with ``copy_`` (cudaMemcpy over NVLink, the copy engines, no
  SM), all on one stream or one stream per peer;
- ``sm_push<N>`` / ``sm_pull<N>``: a Triton kernel on N programs stores the rows into the
  receivers' buffers, or loads them from the senders', through the peers' pointers.

Each is timed alone, then beside a bf16 matmul of [8192, H] x [H, H] on another stream
(``mm+<way>``, the pair's time; compare with ``mm`` and the way alone). The rows that
arrive are checked. CUDA-event medians of ``--iters``, slowest rank. Needs CUDA, NCCL and
``torch.distributed._symmetric_memory``; the GPUs must reach each other's memory.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import fixed_median_ms, save_results  # noqa: E402


# Programs stride over blocks of BLOCK_R rows; a row's peer and its place there follow from
# its index (rows grouped by peer, ``rows_per_peer`` each, landing at ``me * rows_per_peer``
# on the peer). The peer's buffer comes from a table of base addresses; columns go in
# BLOCK_C steps. PUSH loads local rows and stores them remotely; pull the reverse.
@triton.jit
def _move_rows_kernel(local_ptr, peer_bases, num_rows, hidden, rows_per_peer, me, PUSH: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, NUM_PROGS: tl.constexpr):
    for block in range(tl.program_id(0), tl.cdiv(num_rows, BLOCK_R), NUM_PROGS):
        rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
        in_range = rows < num_rows
        peer_row = me * rows_per_peer + rows % rows_per_peer
        base = tl.load(peer_bases + rows // rows_per_peer, mask=in_range, other=0)
        peer_ptr = base.to(tl.pointer_type(local_ptr.dtype.element_ty))
        for c in range(0, hidden, BLOCK_C):
            cols = c + tl.arange(0, BLOCK_C)
            mask = in_range[:, None] & (cols[None, :] < hidden)
            local = local_ptr + rows[:, None] * hidden + cols[None, :]
            remote = peer_ptr[:, None] + peer_row[:, None] * hidden + cols[None, :]
            if PUSH:
                tl.store(remote, tl.load(local, mask=mask), mask=mask)
            else:
                tl.store(local, tl.load(remote, mask=mask), mask=mask)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="2048,8192", help="rows per (sender, receiver) pair")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--programs", default="16,32,64,132", help="program counts of the SM ways")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import torch.distributed._symmetric_memory as symm_mem

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    me, ranks, hidden = dist.get_rank(), dist.get_world_size(), args.hidden
    side = torch.cuda.Stream(device)
    a = torch.randn(8192, hidden, device=device, dtype=torch.bfloat16)
    b = torch.randn(hidden, hidden, device=device, dtype=torch.bfloat16)
    programs = [int(p) for p in args.programs.split(",")]
    results = []

    def slowest_ms(fn) -> float:
        dist.barrier()
        t = torch.tensor([fixed_median_ms(fn, iters=args.iters)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    for rows_per_peer in (int(r) for r in args.rows.split(",")):
        num_rows = rows_per_peer * ranks
        send = symm_mem.empty(num_rows, hidden, dtype=torch.bfloat16, device=device)  # grouped by receiver
        recv = symm_mem.empty(num_rows, hidden, dtype=torch.bfloat16, device=device)  # grouped by sender
        handles = [symm_mem.rendezvous(t, dist.group.WORLD) for t in (send, recv)]
        send_peers = [handles[0].get_buffer(q, (num_rows, hidden), torch.bfloat16) for q in range(ranks)]
        bases = [torch.tensor([h.get_buffer(q, (num_rows, hidden), torch.bfloat16).data_ptr() for q in range(ranks)],
                              device=device) for h in handles]
        row = torch.arange(num_rows, device=device)
        # small integers, exact in bf16: sender, receiver, row within the pair
        send.copy_((me * 32 + row // rows_per_peer * 8 + row % 7).float()[:, None].expand(num_rows, hidden))
        expected = (row // rows_per_peer * 32 + me * 8 + (me * rows_per_peer + row % rows_per_peer) % 7)
        expected = expected.to(torch.bfloat16)[:, None].expand(num_rows, hidden)
        streams = [torch.cuda.Stream(device) for _ in range(ranks)]

        def pull_ce(one_stream: bool):
            def run():
                for q in range(ranks):
                    stream = streams[0 if one_stream else q]
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        recv[q * rows_per_peer:(q + 1) * rows_per_peer].copy_(
                            send_peers[q][me * rows_per_peer:(me + 1) * rows_per_peer])
                for stream in streams:
                    torch.cuda.current_stream().wait_stream(stream)
            return run

        def move_sm(push: bool, num_programs: int):
            local, peer_bases = (send, bases[1]) if push else (recv, bases[0])
            return lambda: _move_rows_kernel[(num_programs,)](
                local, peer_bases, num_rows, hidden, rows_per_peer, me, PUSH=push,
                BLOCK_R=4, BLOCK_C=1024, NUM_PROGS=num_programs, num_warps=8)

        ways = {"nccl": lambda: dist.all_to_all_single(recv, send),
                "ce_serial": pull_ce(True), "ce_streams": pull_ce(False)}
        for p in programs:
            ways[f"sm_push{p}"], ways[f"sm_pull{p}"] = move_sm(True, p), move_sm(False, p)
        matmul = lambda: torch.mm(a, b)  # noqa: E731

        def beside_matmul(fn):
            def run():
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                matmul()
                torch.cuda.current_stream().wait_stream(side)
            return run

        out_gb = (ranks - 1) * rows_per_peer * hidden * 2 / 1e9
        entry = {"rows_per_peer": rows_per_peer, "hidden": hidden, "gb_out_per_rank": out_gb,
                 "mm_ms": slowest_ms(matmul)}
        for name, fn in ways.items():
            recv.zero_()
            torch.cuda.synchronize()
            dist.barrier()
            fn()
            torch.cuda.synchronize()
            dist.barrier()  # every sender's stores landed
            correct = torch.tensor([int(torch.equal(recv, expected))], device=device)
            dist.all_reduce(correct, op=dist.ReduceOp.MIN)
            ms = slowest_ms(fn)
            entry[name] = {"correct": bool(correct.item()), "ms": ms, "GBps": out_gb / ms * 1e3,
                           "mm_beside_ms": slowest_ms(beside_matmul(fn))}
        results.append(entry)
        if me == 0:
            print(f"--- {rows_per_peer} rows of {hidden} per pair ({out_gb * 1e3:.0f} MB out per rank), "
                  f"matmul alone {entry['mm_ms']:.3f} ms", flush=True)
            for name in ways:
                r = entry[name]
                print(f"  {name:12s} {r['ms']:7.3f} ms {r['GBps']:6.1f} GB/s   beside the matmul "
                      f"{r['mm_beside_ms']:7.3f} ms   rows {'ok' if r['correct'] else 'WRONG'}", flush=True)
        dist.barrier()
        del handles, send_peers, send, recv
    if me == 0 and args.out:
        save_results(Path(args.out), {"ranks": ranks, "results": results})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
