"""Train a small MoE language model with ep_moe's expert-parallel layer, under torchrun.

Quick start (CPU, two processes, gloo, the torch reference experts; about a minute)::

    torchrun --nproc-per-node 2 -m ep_moe.train     # from an installed package
    torchrun --nproc-per-node 2 launch/train.py     # the same from a checkout
    ep-moe train --steps 50                         # one process, no torchrun needed

The same command on a GPU machine uses NCCL and the Triton kernels (tuned once at start:
rank 0 tunes or reads the cache and broadcasts). Choose the expert-parallel size and a
config (a preset of ``ep_moe/configs/train/`` by name, or a TOML file of yours), and
override any value::

    torchrun --nproc-per-node 8 -m ep_moe.train --config gpu --ep-size 8
    torchrun --nproc-per-node 2 -m ep_moe.train --set moe.num_experts=16 --set training.lr=1e-3

Several nodes: start the same command on every node with torchrun's rendezvous (the
checkpoint directory must be on a file system all nodes share)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $HEAD_NODE:29500 --rdzv-id $JOB_ID \\
        -m ep_moe.train --config gpu --ep-size 8

(under SLURM: ``srun --ntasks-per-node=1 torchrun --nnodes $SLURM_NNODES ...`` with
``HEAD_NODE=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)``). Fill every
node's kernel cache before a large job with ``torchrun --nproc-per-node 8 -m ep_moe.cli
autotune ...`` (``launch/warmup_node.sh`` in a checkout).

A Hugging Face MoE model (``ep_moe/train/hf_model.py``; the ``hf`` preset), fine-tuned
from its safetensors weights or trained from its config, its experts run by ep_moe and split
over the ranks, on text tokenized with its tokenizer (``ep_moe/train/tokens.py``)::

    torchrun --nproc-per-node 2 -m ep_moe.train --hf-model DIR --data FILES [--eval-data FILES]

Your own data for the built-in model: ``--data corpus.txt`` (bytes as tokens; ``.jsonl``,
folders and globs too) or ``--data tokens.bin`` (flat uint16 ids; ``.u32`` uint32, ``.i32``
int32) with ``--set model.vocab_size=N``. Checkpoints go to
``checkpoint.dir`` every ``checkpoint.interval`` steps and at the end; ``--resume latest``
continues exactly where the newest one left off. ``--metrics-file run.jsonl`` records every
logged step as JSON; ``--tensorboard runs/tiny`` writes the same to TensorBoard (``pip
install tensorboard``, then ``tensorboard --logdir runs``).
``--set training.activation_checkpointing=true`` recomputes each block in the backward
(less activation memory), ``--set training.compile=true`` compiles each block with
``torch.compile``; ``--set parallel.fsdp=true`` shards the dense weights, the experts'
replicas, gradients and AdamW state with FSDP2 (DCP checkpoints, which resume with or
without it). Every option is described in ``ep_moe/train/config.py`` and
``ep_moe/configs/train/tiny.toml``.

A bad config value, data file or checkpoint stops the run before training with one line
naming it and the fix (``train.py: error: ...``, exit status 2; under torchrun printed by
rank 0, followed by torchrun's own summary of the failed processes). So do output paths
that cannot be written or are of the wrong kind (``--checkpoint-dir``, ``--metrics-file``,
``--tensorboard``, ``--export-hf``), checked in seconds before step 1, and a checkpoint
directory another trainer is using (rank 0 locks it for the run: ``{dir}/.lock`` names the
holder's host and pid; a lock left by a dead process of the same host is taken over with
a warning). A data file truncated while the run reads it stops the run the same way, at
the next epoch, naming the file. A resume whose ``training.steps`` is already reached
trains nothing, says so in a warning (raise ``--steps``), still exports an HF model, and
exits 0.
"""

import logging
import os
import sys
import time
from typing import Optional

from ep_moe.train.config import parse_args
from ep_moe.train.errors import UserError
from ep_moe.train.trainer import Trainer, destroy_distributed


RANK0_PRINTS_S = 2.0
"""How long the other ranks wait, after an error every rank raised alike, before exiting."""


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    """Parse the config (``argv``, else the command line; ``prog`` names the command in
    ``--help``), build the trainer, train; always tear the process group down.

    A :class:`ep_moe.train.errors.UserError` (a bad config value, data file or checkpoint)
    is printed by rank 0 as one line, ``train.py: error: ...``, and the process exits with status 2;
    every rank raises it alike (before the process group starts, or after the ranks
    agreed), so it is printed once. Anything else is a bug and keeps its traceback.
    """
    rank0 = int(os.environ.get("RANK", "0")) == 0
    trainer = None
    try:
        job = parse_args(argv, prog=prog)
        logging.basicConfig(level=logging.INFO if rank0 else logging.WARNING, stream=sys.stdout,
                            format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
        trainer = Trainer(job)
        trainer.train()
    except UserError as exc:
        if rank0:
            print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
        else:  # torchrun stops every rank once one exits: let rank 0 print the line first
            time.sleep(RANK0_PRINTS_S)
        sys.exit(2)
    finally:
        if trainer is not None:
            trainer.close()
            trainer = None
        destroy_distributed()
