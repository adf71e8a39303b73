"""YAML that users hand us (debug configs, overlap configs, wrap-plan files), read with bounds.

Every YAML file tp-fuse reads from a user goes through :func:`read_yaml_file` (or
:func:`load_yaml` for text already in memory). Three bounds, because ``yaml.safe_load``
only stops code from running, not memory or time from running out:

* **size**: at most :data:`MAX_YAML_BYTES` bytes, read with
  :func:`tp_fuse.safe_files.read_regular_file` (no FIFO, no device: ``/dev/zero`` is
  refused, not read forever);
* **no aliases**: a 1 kB "billion laughs" file (``b: [*a, *a, ...]`` nine levels deep)
  stands for 10^9 strings. PyYAML builds it as shared references, so the parse is fast,
  but anything that walks the result (validation, ``repr`` in an error message) never
  ends. Config files never need aliases (none of ours, Megatron's or Transformer
  Engine's use one), so an alias (and the ``<<: *x`` merge key, which needs one) is
  refused at parse time, before anything is built, naming its line and column but never
  the value it refers to;
* **nesting**: a file nested past Python's recursion limit is one error, not a
  ``RecursionError`` traceback.

Errors are one-line ``ValueError`` s naming the file and the line and column.
"""

from __future__ import annotations

import os
from typing import Any, Union

import yaml

from .safe_files import read_regular_file

__all__ = ["MAX_YAML_BYTES", "load_yaml", "read_yaml_file"]

#: A config file is a few kB; 4 MiB is far above any real one (and parses in well under 5 s).
MAX_YAML_BYTES = 4 * 2**20

_PLAIN = ("only plain YAML is accepted: mappings, lists, strings, numbers, booleans; "
          "no !!python or other tags, no aliases")


class _AliasRefused(yaml.YAMLError):
    """An alias event met while composing (carries where it is and the anchor name only)."""

    def __init__(self, mark: Any, anchor: str) -> None:
        super().__init__(anchor)
        self.mark = mark
        self.anchor = anchor


class _PlainLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses aliases before composing them (the pure-Python composer:
    the C one cannot be hooked, and config files are small)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _AliasRefused(event.start_mark, event.anchor)
        return super().compose_node(parent, index)


def _where(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"


def _problem(exc: yaml.MarkedYAMLError) -> str:
    return " ".join(" ".join(filter(None, (exc.context, exc.problem))).split()) or type(exc).__name__


def load_yaml(text: Union[str, bytes], where: str, *, limit: int = MAX_YAML_BYTES) -> Any:
    """``text`` parsed as plain YAML (see the module docstring); ``where`` names it in errors
    (``"debug config /path/debug.yaml"``).

    Raises:
        ValueError: one line, naming ``where``, the line and column, and what is wrong.
    """
    if len(text) > limit:
        raise ValueError(f"{where}: {len(text)} bytes of YAML, more than the {limit} a config file may have")
    loader = None
    try:
        loader = _PlainLoader(text)  # reads the text: a bad encoding or control character fails here
        return loader.get_single_data()
    except _AliasRefused as exc:
        raise ValueError(f"{where}: {_where(exc.mark)}: an alias (*{exc.anchor}); {_PLAIN} "
                         "(write the value out)") from None
    except yaml.constructor.ConstructorError as exc:
        raise ValueError(f"{where}: {_where(exc.problem_mark)}: {_problem(exc)} ({_PLAIN})") from None
    except yaml.MarkedYAMLError as exc:
        raise ValueError(f"{where}: not valid YAML: {_where(exc.problem_mark)}: {_problem(exc)}") from None
    except yaml.YAMLError as exc:  # a reader error (bad encoding, control characters)
        raise ValueError(f"{where}: not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply to be a config file") from None
    except ValueError as exc:  # e.g. an integer of more than sys.get_int_max_str_digits() digits
        raise ValueError(f"{where}: {' '.join(str(exc).split())}") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_yaml_file(path: Union[str, os.PathLike], what: str, *, limit: int = MAX_YAML_BYTES) -> Any:
    """The YAML file ``path`` (a regular file of at most ``limit`` bytes; a symbolic link is
    followed: a user's own config may be one), parsed by :func:`load_yaml`. ``what`` names
    it in errors (``"debug config"``).

    Raises:
        FileNotFoundError: ``path`` does not exist (callers say what they need).
        ValueError: one line naming the file: too large, not a regular file, or not plain YAML.
    """
    path = os.fspath(path)
    return load_yaml(read_regular_file(path, limit, what, follow_symlinks=True), f"{what} {path}", limit=limit)
