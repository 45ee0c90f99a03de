"""Token <-> routed-row ops (gather, slot sum) against a float64 reference, both backends.

On the CPU the Triton path runs in the interpreter (float32, float16); on a GPU in
bfloat16 too. Routings cover drops, an expert with every slot, one token, and widths that
are not a multiple of any block.
"""

from __future__ import annotations

import pytest
import torch

from ep_moe.kernels.grouped_gemm import row_block_programs
from ep_moe.kernels.permute import (gather_tokens, launch_gather_rows, launch_sum_slot_rows, permute_tokens,
                                    sum_slot_rows)
from ep_moe.routing import build_routing_metadata, sort_slots

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
E = 6

# (tokens, top_k, hidden, routing): "random" experts, "one" expert takes every slot, "drops"
# keeps about 60% of the slots (as a capacity would).
CASES = {
    "random": (37, 3, 300, "random"),
    "one_expert": (21, 2, 40, "one"),
    "drops": (29, 4, 72, "drops"),
    "all_dropped": (9, 2, 20, "all_dropped"),
    "one_token": (1, 2, 17, "random"),
    "no_tokens": (0, 2, 16, "random"),
}


def make_meta(num_tokens: int, top_k: int, routing: str, gen: torch.Generator):
    if routing == "one":
        ids_TK = torch.stack([torch.full((num_tokens,), 2)] + [torch.full((num_tokens,), 3 + k)
                                                               for k in range(top_k - 1)], dim=1)
    else:
        ids_TK = torch.rand(num_tokens, E, generator=gen).topk(top_k, dim=1).indices
    keep_TK = None
    if routing == "drops":
        keep_TK = torch.rand(num_tokens, top_k, generator=gen) > 0.4
        keep_TK[0] = False  # a token with every slot dropped
    if routing == "all_dropped":
        keep_TK = torch.zeros(num_tokens, top_k, dtype=torch.bool)
    return build_routing_metadata(ids_TK.to(DEVICE), E, None if keep_TK is None else keep_TK.to(DEVICE))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_permute_then_sum_against_float64(case, dtype, backend):
    num_tokens, top_k, hidden, routing = CASES[case]
    gen = torch.Generator().manual_seed(list(CASES).index(case))
    meta = make_meta(num_tokens, top_k, routing, gen)
    x_TH = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype).requires_grad_()
    scale_R = torch.rand(meta.slot_index_R.shape[0], 1, generator=gen).to(DEVICE, dtype)

    rows_RH = permute_tokens(x_TH, meta, backend)
    y_TH = sum_slot_rows(rows_RH * scale_R, meta, backend)
    dy_TH = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    (dx_TH,) = torch.autograd.grad(y_TH, x_TH, dy_TH)

    # float64 reference from the definitions: rows[r] = x[token(r)], y[t] = sum of t's kept rows.
    x64, s64 = x_TH.detach().double(), scale_R.double()
    tok = meta.token_index_R
    assert torch.equal(rows_RH.detach(), x_TH.detach()[tok])
    want_y = torch.zeros(num_tokens, hidden, dtype=torch.float64, device=DEVICE).index_add_(0, tok, x64[tok] * s64)
    want_dx = torch.zeros_like(want_y).index_add_(0, tok, dy_TH.double()[tok] * s64)
    assert y_TH.dtype == dtype and dx_TH.dtype == dtype
    if num_tokens:
        assert rel_err(y_TH, want_y) < TOL[dtype]
        assert rel_err(dx_TH, want_dx) < TOL[dtype]
    if routing == "drops":  # a token with every slot dropped gets exact zeros
        dropped = (meta.row_of_slot_N.view(num_tokens, top_k) < 0).all(1)
        assert dropped.any() and torch.equal(y_TH[dropped], torch.zeros_like(y_TH[dropped]))


def test_sum_slot_rows_writes_every_token_in_slot_order():
    """The raw launcher: every output row written (poisoned first would show otherwise),
    slots summed in order k = 0..K-1 (bitwise equal to a sequential fp32 sum)."""
    gen = torch.Generator().manual_seed(3)
    num_tokens, top_k, hidden = 19, 3, 33
    src = torch.randn(num_tokens * top_k + 5, hidden, generator=gen).to(DEVICE)
    rows = torch.randperm(num_tokens * top_k, generator=gen).to(DEVICE)
    out = launch_sum_slot_rows(src, rows, top_k)
    want = src[rows[0::top_k]].clone()
    for k in range(1, top_k):
        want += src[rows[k::top_k]]
    assert torch.equal(out, want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tokens_gathered_before_the_row_count_is_known(backend):
    """sort_slots keeps dropped slots as trailing rows; gather_tokens gathers with the kept
    count still on the device, and permute_tokens(gathered=) then matches a permute of
    the cut metadata, forward and backward."""
    gen = torch.Generator().manual_seed(5)
    num_tokens, top_k, hidden, experts = 13, 3, 40, 4
    ids = torch.rand(num_tokens, experts, generator=gen).topk(top_k, dim=1).indices
    keep = torch.rand(num_tokens, top_k, generator=gen) > 0.5
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE)
    padded = sort_slots(ids.to(DEVICE), experts, keep.to(DEVICE))
    kept = int(keep.sum())
    early = gather_tokens(x, padded, padded.counts_E.sum(), backend)
    assert early.shape == (num_tokens * top_k, hidden)
    meta = padded.first_rows(kept)
    want_meta = build_routing_metadata(ids.to(DEVICE), experts, keep.to(DEVICE))
    assert torch.equal(meta.slot_index_R, want_meta.slot_index_R)
    assert torch.equal(meta.row_of_slot_N, want_meta.row_of_slot_N)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = permute_tokens(x1, meta, backend, gathered=early[:kept])
    want = permute_tokens(x2, want_meta, backend)
    assert torch.equal(got, want)
    dy = torch.randn(kept, hidden, generator=gen).to(DEVICE)
    got.backward(dy)
    want.backward(dy)
    assert torch.equal(x1.grad, x2.grad)
    with pytest.raises(ValueError, match=r"permute_tokens: gathered is \(\d+, 40\) torch.float32; pass a contiguous"):
        permute_tokens(x1, meta, backend, gathered=early[:kept - 1])


@pytest.mark.parametrize("used", [0, 5, 1 << 20])
def test_gather_rows_with_a_device_row_count(used):
    """launch_gather_rows(limit=): the first rows gathered (and scaled), the rest of out
    untouched; more row blocks than the limited grid's programs, so the programs stride."""
    gen = torch.Generator().manual_seed(11)
    cols = 24  # one column block
    rows = 16 * row_block_programs(1 << 30, 1, DEVICE, limited=True) + 300  # more row blocks than programs
    used = min(used, rows)
    src = torch.randn(300, cols, generator=gen).to(DEVICE)
    idx = torch.randint(0, 300, (rows,), generator=gen).to(DEVICE, torch.int32)
    scale = torch.rand(rows, generator=gen).to(DEVICE)
    out = torch.full((rows, cols), -7.0, device=DEVICE)
    launch_gather_rows(src, idx, scale, out=out, limit=torch.tensor(used, device=DEVICE), scale_by_out_row=True)
    want = src[idx[:used].long()] * scale[:used, None]
    assert torch.allclose(out[:used], want, rtol=1e-6, atol=0) and bool((out[used:] == -7.0).all())


def test_bad_input_names_the_argument():
    """Tokens or rows that do not match ``meta`` (the Triton path would read past them) and
    unknown backends are refused by name."""
    meta = make_meta(5, 2, "mixed", torch.Generator().manual_seed(0))
    x = torch.randn(5, 8, device=DEVICE)
    rows = permute_tokens(x, meta, "torch")
    with pytest.raises(ValueError, match=r"permute_tokens: x_TH is \(4, 8\); pass the \[T, H\] tokens .* = 5"):
        permute_tokens(x[:4], meta, "triton")
    with pytest.raises(ValueError, match=r"permute_tokens: x_TH is \(5, 2, 4\)"):
        permute_tokens(x.view(5, 2, 4), meta, "triton")
    with pytest.raises(ValueError, match=r"sum_slot_rows: rows_RH is .*at least the R = "):
        sum_slot_rows(rows[:-1], meta, "triton")
    for call in (lambda: permute_tokens(x, meta, "Triton"), lambda: sum_slot_rows(rows, meta, "auto")):
        with pytest.raises(ValueError, match=r"backend='(Triton|auto)'; use 'triton' or 'torch'"):
            call()
