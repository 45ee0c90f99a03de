"""The trainer from a checkout: ``torchrun --nproc-per-node 2 launch/train.py [options]``.

The same as ``torchrun --nproc-per-node 2 -m ep_moe.train`` (``ep_moe/train/train.py`` has
the commands and options); the package must be installed (``pip install -e .``).
"""

from ep_moe.train.train import main

if __name__ == "__main__":
    main(prog="launch/train.py")
