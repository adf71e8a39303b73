"""launch: the Hydra launcher, training loop, checkpoints and W&B logging.

The only package that imports Hydra or W&B. Entry point: ``launch/train.py``
(``torchrun --nproc-per-node=N launch/train.py +model=gpt [overrides]``).
"""

from tp_fuse._floors import floor_path

# This package's modules are in the folder launch/ (a checkout's top level, or beside this file
# installed); the folder has no __init__.py so that it never shadows an installed `launch`.
__path__ = floor_path(__file__, "launch")
