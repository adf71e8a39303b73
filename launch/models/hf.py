"""``+model=hf model.path=<dir>``: a Hugging Face decoder from a local directory, wrapped for TP.

The directory is untrusted input. Nothing in it runs code:

* ``config.json`` is first read as JSON (its ``model_type`` must be one of
  :data:`LAUNCHER_FAMILIES`: every family with a built-in ``wrap`` plan,
  ``tp_fuse.layers.wrap.hf_plans.FAMILIES``, each tested TP=2 vs TP=1 through the launcher;
  every size it gives bounded; GLM, which has no built-in plan, needs ``model.plan``), then
  resolved by ``transformers.AutoConfig`` (class defaults,
  spellings); ``transformers`` reads and builds with ``trust_remote_code=False`` and
  ``local_files_only=True`` (no hub access, an ``auto_map`` runs nothing);
* weight headers are read by ``safetensors`` (dtypes checked before loading); weights are
  loaded only from ``*.safetensors`` (a directory with pickled
  ``pytorch_model.bin`` weights only is refused); without weights the model is randomly
  initialized from the run's seed, identically on every rank;
* the tokenizer is ``tokenizer.json`` read by ``tokenizers`` (a data file, no code).

The model is wrapped with its family plan over the TP group (also at TP size 1, so that
FP8 reaches its GEMMs) and called by the trainer as ``model(tokens, labels) -> loss``.
At TP size > 1 the wrapped model is first checked against the original
(``wrap(verify=True)``: one forward and backward on a ``[2, 8]`` token probe, every output
and gradient compared; ``model.verify=false`` skips it): a model that would train wrong
stops at start-up with the first differing parameter named.

The pieces: :mod:`~tp_fuse.launch.models.hf_config` (config.json -> the launcher's sizes),
:mod:`~tp_fuse.launch.models.hf_weights` (weight-file checks),
:mod:`~tp_fuse.launch.models.hf_plan` (``model.plan``); this module builds and wraps.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_fuse.layers import wrap

from ..tokenizer import FileTokenizer
from .hf_config import read_hf_config
from .hf_plan import resolve_plan
from .hf_weights import check_weight_files

__all__ = ["CausalLMLoss", "build_hf_model", "load_tokenizer"]


def load_tokenizer(path: str) -> FileTokenizer:
    """The model directory's ``tokenizer.json`` (a ``tokenizers`` file: JSON, no code runs)."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.lexists(file):  # a FIFO or a link to a device: FileTokenizer names it
        raise ValueError(f"model.path: {file} does not exist; +model=hf tokenizes with the model directory's "
                         f"tokenizer.json (fast tokenizer file; no hub access)")
    return FileTokenizer(file, name=f"{path}/tokenizer.json")


class CausalLMLoss(torch.nn.Module):
    """``model(tokens, labels) -> mean cross-entropy`` (labels already shifted; -100 ignored)
    around a Hugging Face causal LM, the trainer's model contract."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=tokens).logits  # [b, s, vocab]
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


@contextlib.contextmanager
def _transformers_progress(show: bool) -> Iterator[None]:
    """transformers' own progress bars (``Loading weights``) on or off while the block runs.

    Every rank loads the weights; one bar (rank 0's) is enough. transformers keeps the
    switch in its own module state, so it is put back as it was afterwards.
    """
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if show == was:
        yield
        return
    (hf_logging.enable_progress_bar if show else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def build_hf_model(path: str, *, tp_group: Any, dtype: torch.dtype, device: torch.device, seed: int,
                   overlap: Any, verify: bool = True, plan: Any = None, progress_bar: bool = True) -> CausalLMLoss:
    """Build (weights from safetensors if present, else seeded random init), wrap (with
    ``plan``: ``model.plan``, and ``verify=True`` at TP size > 1 when ``verify``), return.
    ``progress_bar`` False (ranks other than 0) silences transformers' weight-loading bar."""
    import transformers

    read_hf_config(path)
    check_weight_files(path)  # also checked by the config check, before any process group
    safetensors = glob.glob(os.path.join(path, "*.safetensors"))
    pickled = glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))
    common = dict(trust_remote_code=False)
    if safetensors:
        with _transformers_progress(progress_bar):
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, use_safetensors=True, dtype=dtype, **common)
    elif pickled:
        raise ValueError(f"model.path: {path} has only pickled weights ({os.path.basename(pickled[0])}); they are "
                         f"not loaded (unpickling runs code). Convert them to safetensors")
    else:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True, **common)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # identical on every rank: wrap checks it
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, **common)
    model.to(device)
    if tp_group is not None:
        check = verify and dist.get_world_size(tp_group) > 1
        # verify=True: the automatic probe, required (its failure stops the run);
        # model.verify=false: wrap's explicit opt-out (it warns what is not checked).
        wrap(model, tp_group, plan=resolve_plan(plan, model.config), overlap=overlap,
             verify=True if check else (None if verify else False))
    return CausalLMLoss(model)
