"""launch: the Hydra launcher, training loop, checkpoints and W&B logging.

The only package that imports Hydra or W&B. Entry point: ``launch/train.py``
(``torchrun --nproc-per-node=N launch/train.py +model=gpt [overrides]``).
"""
