"""The trainer: a small MoE language model, or a Hugging Face MoE model, trained with ep_moe's
expert-parallel layers under torchrun (``torchrun --nproc-per-node 2 -m ep_moe.train``,
``ep-moe train``; in a checkout also ``launch/train.py``). :mod:`ep_moe.train.train` has the
commands and :func:`ep_moe.train.train.main`.

The top floor of the package, beside ``ep_moe/cli.py`` (whose ``ep-moe train`` runs it): it
may import anything in ep_moe, and nothing on a floor below imports it.
"""
