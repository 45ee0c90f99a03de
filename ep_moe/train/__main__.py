"""``torchrun --nproc-per-node N -m ep_moe.train [options]``: the trainer (``--help`` lists the options)."""

from ep_moe.train.train import main

if __name__ == "__main__":
    main(prog="ep_moe.train")
