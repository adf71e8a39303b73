"""Configuration errors reported the way a user can act on them: once, in one line, early.

``launch/train.py`` calls :func:`precheck` on the command-line overrides *before* Hydra
starts (so before Hydra creates a run directory, and before torchrun's ranks build
anything). It does what the run itself would do -- compose the config, convert it to
the typed dataclasses, validate it against the world size -- and turns every failure
into a message:

* a typo'd key of an existing group (``trainer.max_step=5``), which Hydra reports as
  "To append to your config use +trainer.max_step=5" (the wrong fix), becomes
  ``unknown key trainer.max_step; known keys of trainer: ...; did you mean
  trainer.max_steps?``;
* an unknown option of a config group (``fp8=delayd``), which Hydra reports with the list
  of options only, also gets ``did you mean 'delayed'?``;
* everything else ( bad value, cross-field constraint) keeps its
  own message, without a traceback.

:func:`report_and_exit` prints the message on rank 0 only (every torchrun rank checks the
same config and would print the same line) and exits with status 2 on every rank.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from tp_fuse.layers.config import GPTConfig

from .config import CONFIG_DIR, SECTIONS, ModelConfig
from .config_parse import from_dict
from .config_validate import validate

__all__ = ["CONFIG_DIR", "CONFIG_ERROR_EXIT", "closest", "group_option_error", "known_keys", "override_key_error",
           "precheck", "report_and_exit"]

#: Exit status for a configuration error (as argparse uses for usage errors).
CONFIG_ERROR_EXIT = 2
#: Without torchrun's store: how long ranks != 0 wait before exiting, so that rank 0's
#: message is printed first. With it: the longest they wait for rank 0.
_OTHER_RANKS_DELAY_S = 2.0
_OTHER_RANKS_WAIT_S = 60.0



#: Keys that were replaced: the message says what to use instead.
_REPLACED = {
    "trainer.val_batches": "trainer.val_tokens (validation is sized in tokens, the same set for every layout)",
}


def known_keys(section: str) -> list[str]:
    """Field names of config group ``section`` (``model``: ModelConfig's own fields but
    ``gpt``, then every GPTConfig field)."""
    if section == "model":
        own = [f.name for f in dataclasses.fields(ModelConfig) if f.name != "gpt"]
        return [*own, *(f.name for f in dataclasses.fields(GPTConfig))]
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


def closest(name: str, candidates: list[str]) -> Optional[str]:
    """The candidate most similar to ``name`` (difflib ratio >= 0.6), or None."""
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


def _did_you_mean(prefix: str, name: str, candidates: list[str]) -> str:
    guess = closest(name, candidates)
    return f"; did you mean {prefix}{guess}?" if guess else ""


def override_key_error(override: str) -> Optional[str]:
    """Our message for a ``group.key=value`` override whose group or key does not exist.

    Overrides that add (``+``), force-add (``++``) or delete (``~``) keys, Hydra's own
    (``hydra.*``) and group selections (``fp8=delayed``) are left to Hydra and
    :func:`tp_fuse.launch.config_parse.from_dict`.
    """
    if "=" not in override or override.startswith(("+", "~", "-")):
        return None
    key = override.split("=", 1)[0]
    if "/" in key or key.startswith("hydra") or "." not in key:
        return None
    parts = key.split(".")
    section, field = parts[0], parts[1]
    sections = ["model", *SECTIONS]
    if section not in sections:
        return (f"unknown config group {section!r} in {override!r}; groups: {', '.join(sections)}"
                + _did_you_mean("", section, sections))
    keys = known_keys(section)
    if f"{section}.{field}" in _REPLACED:
        return f"{section}.{field} was replaced by {_REPLACED[f'{section}.{field}']}"
    if field not in keys:
        return (f"unknown key {section}.{field} in {override!r}; known keys of {section}: {', '.join(keys)}"
                + _did_you_mean(f"{section}.", field, keys))
    if len(parts) > 2:
        return f"{key}: {section}.{field} has no sub-keys (in {override!r})"
    return None


def group_option_error(override: str, config_dir: str) -> Optional[str]:
    """Our message for ``group=option`` (or ``+group=option``) naming an option that does not
    exist in ``config_dir/group/``: the options and the closest one; None when it exists or
    the override is not a group selection."""
    if "=" not in override or override.startswith(("~", "-")):
        return None
    key, option = override.split("=", 1)
    group = key.lstrip("+")
    if not group or "." in group or "/" in group or group.startswith("hydra"):
        return None
    directory = os.path.join(config_dir, group)
    if not os.path.isdir(directory):
        return None
    options = sorted(name[:-len(".yaml")] for name in os.listdir(directory) if name.endswith(".yaml"))
    if option in options or not option or "," in option:  # a Hydra sweep list is Hydra's to check
        return None
    guess = closest(option, options)
    return (f"unknown option {option!r} of config group {group} in {override!r}; options: {', '.join(options)}"
            + (f"; did you mean {guess!r}?" if guess else ""))


def _hydra_message(exc: BaseException) -> str:
    """Hydra's exception text without its stack trace (its cause holds the detail)."""
    text = str(exc).strip()
    cause = exc.__cause__
    if cause is not None and str(cause).strip() and str(cause).strip() not in text:
        text = f"{text}: {str(cause).strip()}"
    # Hydra appends where it searched for configs: noise for a typo'd option name.
    text = text.split("Config search path", 1)[0]
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def precheck(argv: list[str], config_dir: str, world_size: int) -> Optional[str]:
    """The configuration error of these command-line overrides, or None if the config is valid.

    ``argv`` as given to ``launch/train.py``. Command-line flags (``--help``, ``--cfg``,
    ``-m``) skip the check: Hydra handles them.
    """
    if any(a.startswith("-") for a in argv):
        return None
    for arg in argv:
        msg = override_key_error(arg) or group_option_error(arg, config_dir)
        if msg is not None:
            return msg
    overrides = [a for a in argv if not a.lstrip("+~").startswith("hydra")]
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            raw = hydra_compose(config_name="train", overrides=overrides)
    except Exception as exc:  # Hydra's composition/override errors: report, never crash here
        return _hydra_message(exc)
    data = OmegaConf.to_container(raw, resolve=True)
    assert isinstance(data, dict)
    try:
        validate(from_dict(data), world_size)
    except ValueError as exc:
        return str(exc)
    return None


def _torchrun_store() -> Optional[dist.TCPStore]:
    """A client of torchrun's agent store (None when not under torchrun or unreachable)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=_OTHER_RANKS_WAIT_S))
    except (KeyError, ValueError, RuntimeError):
        return None


def report_and_exit(message: str, rank: int) -> None:
    """Print ``message`` once (rank 0), without a traceback; exit non-zero on every rank.

    torchrun stops the other workers as soon as one exits, so ranks != 0 wait until rank 0
    has printed (a key in torchrun's store; a short sleep where there is no store).
    """
    key = f"tp_fuse/config_error_printed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = _torchrun_store() if os.environ.get("WORLD_SIZE", "1") != "1" else None
    if rank == 0:
        print(f"[tp-fuse] config error: {message}", file=sys.stderr, flush=True)
        if store is not None:
            store.set(key, "1")
    elif store is not None:
        try:
            store.wait([key])
        except RuntimeError:  # rank 0 never got there: exit anyway
            pass
    else:
        time.sleep(_OTHER_RANKS_DELAY_S)
    raise SystemExit(CONFIG_ERROR_EXIT)


def main(argv: list[str]) -> int:
    """``python -m tp_fuse.launch.config_errors [overrides]``: check a config without training.

    ``make train`` runs it before torchrun, so a config error is one line, not one per
    rank plus torchrun's failure report. ``WORLD_SIZE`` (default 1) is the world size
    to validate against.
    """
    error = precheck(argv, CONFIG_DIR, int(os.environ.get("WORLD_SIZE", "1")))
    if error is not None:
        print(f"[tp-fuse] config error: {error}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

