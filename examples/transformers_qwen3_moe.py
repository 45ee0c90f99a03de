"""A Hugging Face Qwen3-MoE with ep_moe's experts (needs pip install 'ep-moe[transformers]').

Trained for a few steps:

    python examples/transformers_qwen3_moe.py                          # one process
    torchrun --nproc-per-node 2 examples/transformers_qwen3_moe.py     # experts split over 2 ranks

It saves a tiny random ``Qwen3MoeForCausalLM`` as a checkpoint folder (a real one works the
same), loads it with ``experts_implementation="ep_moe"``, trains it, and saves it back in
transformers' format. Under torchrun each rank reads only its own experts from the folder
(``ep_moe.integrations.transformers.from_pretrained``), trains on its own tokens, and
``sync_gradients`` averages the gradients; the save gathers the experts again.
"""

import os
import tempfile

import torch
import torch.distributed as dist
try:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
except ImportError:
    raise SystemExit("examples/transformers_qwen3_moe.py needs transformers 5: "
                     "pip install 'ep-moe[transformers]'") from None

import ep_moe.integrations.transformers as ep_hf
from ep_moe.parallel import sync_gradients

STEPS, VOCAB = 8, 128


def main() -> None:
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    with tempfile.TemporaryDirectory() as folder:
        folder = folder if not distributed else _shared(folder)
        if rank == 0:  # a checkpoint to start from: a tiny random Qwen3-MoE
            config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    num_experts=8, num_experts_per_tok=2)
            torch.manual_seed(0)
            Qwen3MoeForCausalLM(config).save_pretrained(f"{folder}/start")
        if distributed:
            dist.barrier()
            model = ep_hf.from_pretrained(AutoModelForCausalLM, f"{folder}/start", dist.group.WORLD, device=device)
        else:
            model = AutoModelForCausalLM.from_pretrained(f"{folder}/start", experts_implementation="ep_moe").to(device)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        generator = torch.Generator().manual_seed(rank)
        batch = torch.randint(0, VOCAB, (4, 32), generator=generator).to(device)  # each rank its own tokens
        losses = []
        for _ in range(STEPS):
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            if distributed:
                sync_gradients(model, dist.group.WORLD, None)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        ep_hf.save_pretrained(model, f"{folder}/trained")
        if rank == 0:
            experts = ep_hf.experts_modules(model)[0][1]
            print(f"transformers_qwen3_moe: world {world}, {experts.down_proj.shape[0]} of 8 experts per rank, "
                  f"task loss {losses[0]:.4f} -> {losses[-1]:.4f}, saved {sorted(os.listdir(f'{folder}/trained'))}")
        if distributed:
            dist.barrier()  # rank 0 removes the folder only once every rank is done with it
    if distributed:
        dist.destroy_process_group()


def _shared(folder: str) -> str:
    """Rank 0's temporary folder, the same path on every rank (one node)."""
    paths = [folder]
    dist.broadcast_object_list(paths, src=0)
    return paths[0]


if __name__ == "__main__":
    main()
