"""The grouped GEMM on its own: an MoE feed-forward from two calls, forward and backward
checked against a loop over experts.

    python examples/grouped_gemm.py

``grouped_gemm(x, w, m_sizes)`` multiplies each expert's rows by that expert's weight:
the routed rows are sorted by expert, ``m_sizes[e]`` of them for expert e, and ``w`` is
[E, N, K] (out_features before in_features, as ``nn.Linear``). Three optional indices fuse
the MoE permutation into the kernel: ``gather_index`` (routed row r reads ``x[gather_index[r]]``),
``scatter_index`` (row r is written to ``out[scatter_index[r]]``) and ``row_weights`` (the
top-k weight of each output row). On a GPU the Triton kernels run natively; on a CPU this
script runs them in the Triton interpreter (``TRITON_INTERPRET=1``, set before Triton loads).
"""

import os

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede importing ep_moe (and Triton)

from ep_moe import grouped_gemm  # noqa: E402

# T tokens, H hidden, I expert intermediate, E experts, K top-k
T, H, I, E, K = 32, 64, 48, 4, 2


def main() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x_TH = torch.randn(T, H, device=device, requires_grad=True)
    w_up_EIH = (torch.randn(E, I, H, device=device) / H**0.5).requires_grad_()
    w_down_EHI = (torch.randn(E, H, I, device=device) / I**0.5).requires_grad_()
    # What a router gives: K distinct experts per token and their weights.
    expert_ids_TK = torch.rand(T, E, device=device).argsort(dim=1)[:, :K]
    weights_TK = torch.softmax(torch.randn(T, K, device=device), dim=1).requires_grad_()

    # Routing metadata: the T*K slots (token t's k-th choice is slot t*K + k) sorted by expert.
    slot_order = expert_ids_TK.flatten().argsort(stable=True)  # routed row r is slot slot_order[r]
    m_sizes_E = torch.bincount(expert_ids_TK.flatten(), minlength=E)
    token_of_row = slot_order // K

    # Up projection: gathers each routed row's token in the kernel's loads.
    h = F.silu(grouped_gemm(x_TH, w_up_EIH, m_sizes_E, gather_index=token_of_row))
    # Down projection: writes each row back to its slot, times its top-k weight, in the epilogue.
    y_slots = grouped_gemm(h, w_down_EHI, m_sizes_E, scatter_index=slot_order, row_weights=weights_TK.flatten())
    y_TH = y_slots.view(T, K, H).sum(dim=1)

    # The same feed-forward, one expert at a time.
    ref_TH = torch.zeros(T, H, device=device)
    for e in range(E):
        tokens, choice = (expert_ids_TK == e).nonzero(as_tuple=True)
        out = F.silu(x_TH[tokens] @ w_up_EIH[e].T) @ w_down_EHI[e].T
        ref_TH = ref_TH.index_add(0, tokens, weights_TK[tokens, choice, None] * out)

    dy_TH = torch.randn(T, H, device=device)
    inputs = (x_TH, w_up_EIH, w_down_EHI, weights_TK)
    grads = torch.autograd.grad(y_TH, inputs, dy_TH)
    ref_grads = torch.autograd.grad(ref_TH, inputs, dy_TH)
    torch.testing.assert_close(y_TH, ref_TH, atol=1e-4, rtol=1e-4)
    for name, got, want in zip(("x", "w_up", "w_down", "weights"), grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"d{name}: {m}")
    error = max((g - r).abs().max().item() for g, r in zip((y_TH, *grads), (ref_TH, *ref_grads)))
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    kernels = "Triton" if device.type == "cuda" else "Triton interpreter" if interpreted else "PyTorch reference"
    print(f"grouped_gemm: {kernels}, output and 4 gradients match the loop (max abs error {error:.1e})")


if __name__ == "__main__":
    main()
