"""Every file path and module name README.md and docs/*.md mention exists.

A moved or split module leaves the docs pointing at a file or a module that is gone; this
reads the Markdown (nothing is imported) and checks each reference:

* a Markdown link's target (``[text](docs/ops.md#data)``), relative to the document;
* a code span naming a repository path (it starts with a top-level folder:
  ``launch/config.py``, ``tp_fuse/ops/fused/userbuffers_*.py``), relative to the root;
* a code span naming a bare source file (``fuser_path.py``): some file of that name;
* a code span naming a project module (``tp_fuse.launch.config_parse.from_dict``): the
  longest dotted prefix that is a module must exist, and the first name after it must be
  defined or imported at that module's top level (or served by its ``__getattr__``).
"""

from __future__ import annotations

import ast
import fnmatch
import glob
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Dotted package -> repository folder (pyproject's package-dir).
PACKAGES = {"tp_fuse.comm": "comm", "tp_fuse.layers": "layers", "tp_fuse.launch": "launch",
            "tp_fuse.configs": "configs", "tp_fuse": "tp_fuse"}
#: Top-level folders of the repository: a code span starting with one names a repository path.
FOLDERS = ("tp_fuse", "comm", "layers", "launch", "configs", "tests", "examples", "tools", "docs", ".ci")
#: Names that look like a project path or module but are not one: test files by their bare
#: name (most are Transformer Engine's, run by tools/run_te_tests.py) and TE's test tree, the
#: launcher's lock file, a placeholder.
OUTSIDE = ("test_*.py", "tests/pytorch/*", "tp_fuse.lock", "tp_fuse.X")
_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_MODULE = re.compile(r"^tp_fuse(\.[A-Za-z_]\w*)+$")


def documents() -> list[str]:
    return ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def repository_files() -> list[str]:
    """Tracked and untracked (not ignored) files, relative to the root."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if os.path.exists(os.path.join(ROOT, f))]


def _prose(text: str) -> str:
    """The document without fenced code blocks (commands and trees, checked by other tests)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _is_repository_path(word: str) -> bool:
    """A span naming a repository path (``launch/config.py``, ``tp_fuse/ops/``) or a source file."""
    if re.fullmatch(r"[\w*-]+\.py", word):
        return True
    return re.fullmatch(r"[\w.*/-]+", word) is not None and word.split("/")[0] in FOLDERS and "/" in word


def _path_exists(ref: str, doc_dir: str, files: list[str]) -> bool:
    ref = ref.split("#")[0].split("::")[0].rstrip(":,.")
    if not ref:
        return True
    bare = ref.rstrip("/")
    # tp_fuse/comm/... is the installed place of the repository's comm/ (pyproject's package-dir).
    for package, folder in PACKAGES.items():
        if package != "tp_fuse" and bare.startswith(f"tp_fuse/{folder}"):
            bare = folder + bare[len(f"tp_fuse/{folder}"):]
    for base in (ROOT, os.path.join(ROOT, doc_dir)):
        if glob.glob(os.path.join(base, bare)):
            return True
    dirs = {os.path.dirname(f) for f in files}
    dirs |= {d for f in files for d in _parents(f)}
    if "/" not in bare:  # a bare file name: some file of that name
        return any(fnmatch.fnmatch(os.path.basename(f), bare) for f in files)
    return any(fnmatch.fnmatch(f, "*/" + bare) for f in files) or any(d.endswith("/" + bare) for d in dirs)


def _parents(path: str) -> list[str]:
    parts = path.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _module_file(dotted: str) -> str | None:
    """The source file of project module ``dotted``, or None when it is not one."""
    for package, folder in sorted(PACKAGES.items(), key=lambda kv: -len(kv[0])):
        if dotted == package or dotted.startswith(package + "."):
            rest = dotted[len(package):].lstrip(".").split(".") if dotted != package else []
            base = os.path.join(ROOT, folder, *rest)
            for candidate in (base + ".py", os.path.join(base, "__init__.py")):
                if os.path.isfile(candidate):
                    return candidate
            if package != "tp_fuse" and not rest:  # tp_fuse/comm.py etc.: the package's public names
                return os.path.join(ROOT, "tp_fuse", folder + ".py")
            if rest and os.path.isdir(base):  # a namespace folder (configs)
                return base
            return None
    return None


def _top_level_names(source: str) -> set[str]:
    """Names a module defines or imports at its top level, and its ``__all__``; with a module
    ``__getattr__`` (names served lazily) also every string constant of the module."""
    tree = ast.parse(source)
    names: set[str] = set()
    lazy = False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            lazy |= node.name == "__getattr__"
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if lazy:
        names |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return names


def module_problem(ref: str) -> str | None:
    """Why the dotted name ``ref`` names no project module (and attribute), or None."""
    parts = ref.split(".")
    for n in range(len(parts), 0, -1):
        found = _module_file(".".join(parts[:n]))
        if found is None:
            continue
        if n == len(parts) or os.path.isdir(found):
            return None
        with open(found, encoding="utf-8") as f:
            names = _top_level_names(f.read())
        if parts[n] in names:
            return None
        return f"{'.'.join(parts[:n])} ({os.path.relpath(found, ROOT)}) has no {parts[n]!r}"
    return f"no module {ref}"


def dead_references(doc: str, files: list[str]) -> list[str]:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = _prose(f.read())
    doc_dir = os.path.dirname(doc)
    dead = []
    for target in _LINK.findall(text):
        if not target.startswith(("http://", "https://", "#", "mailto:")) and not _path_exists(target, doc_dir, files):
            dead.append(f"{doc}: link to {target}")
    for span in _SPAN.findall(text):
        span = span.strip()
        word = span.split()[0] if span.split() else ""
        if " " in span and not word.endswith(".py"):
            continue  # a command or an expression, not one path
        if any(fnmatch.fnmatch(word, o) for o in OUTSIDE):
            continue
        if _MODULE.match(word):
            problem = module_problem(word)
            if problem is not None:
                dead.append(f"{doc}: `{span}`: {problem}")
        elif _is_repository_path(word) and not _path_exists(word, doc_dir, files):
            dead.append(f"{doc}: `{span}`: no such file or folder")
    return dead


@pytest.mark.parametrize("doc", documents())
def test_documented_paths_exist(doc: str) -> None:
    dead = dead_references(doc, repository_files())
    assert not dead, "dead references (moved or removed?):\n" + "\n".join(dead)


def test_a_dead_reference_is_found(tmp_path) -> None:
    """The check itself: a removed module, a missing file and a missing attribute are reported."""
    files = repository_files()
    assert module_problem("tp_fuse.launch.config.TrainConfig") is None
    assert module_problem("tp_fuse.launch.config_parse.from_dict") is None
    assert module_problem("tp_fuse.launch.config.from_dict") is not None  # moved to config_parse
    assert module_problem("tp_fuse.launch.no_such_module") is not None
    assert _path_exists("launch/models/hf_config.py", "docs", files)
    assert _path_exists("tp_fuse/comm/overlap/", "docs", files)  # the installed place of comm/
    assert not _path_exists("launch/models/no_such.py", "docs", files)
    assert not _path_exists("no_such_file.py", "", files)
