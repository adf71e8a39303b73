"""No import circle between the project's modules, function-local imports included.

The module graph is read from the sources (an AST scan, nothing is imported): every
``import`` / ``from ... import`` of a project module, at module level or inside a function,
is an edge ``importer -> imported`` (``from pkg import name`` points at ``pkg.name`` when that
is a module, else at ``pkg``). ``if TYPE_CHECKING:`` imports never run and are left out.

A function-local import is allowed only where it is listed in ``ALLOWED_LAZY`` with its
reason: it defers an optional heavy dependency (Triton, dynamo, DCP) on purpose, or reaches the
TE room above through a package's lazy attribute. Everything else is imported at the top.
A function-local import does not make a circle acceptable: with every edge counted, lazy
ones included, the graph must have no circle, except through the edges of
``ALLOWED_CIRCLES`` (each one a known circle with the reason it is not broken yet; an entry
that no longer closes a circle fails the test, so the list only shrinks).
"""

from __future__ import annotations

import ast
import functools
import os
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: repository folder -> its package (pyproject's package-dir mapping)
FOLDERS = {"tp_fuse": "tp_fuse", "comm": "tp_fuse.comm", "layers": "tp_fuse.layers", "launch": "tp_fuse.launch"}
#: tp_fuse/<name>.py that are packages (their modules are in the root folder: tp_fuse/_floors.py)
FILE_PACKAGES = {"tp_fuse.comm", "tp_fuse.layers", "tp_fuse.launch"}

_DYNAMO = "torch._dynamo is loaded only while compiling (tp_fuse/graph_breaks.py)"
_TRITON = "Triton is optional and loaded only where a Triton kernel runs"
_DCP = ("torch.distributed.checkpoint (with DTensor and sympy, about a CPU-second) is loaded at the first "
        "checkpoint save or load, not by config validation or runs that never checkpoint")

#: (importer, imported) -> why the import is inside a function.
ALLOWED_LAZY: dict[tuple[str, str], str] = {
    ("tp_fuse", "tp_fuse.te"): "the TE room sits on tp_fuse.layers, which imports tp_fuse (module __getattr__)",
    ("tp_fuse.distributed", "tp_fuse.te.distributed"): "TE's names at TE's path tp_fuse.distributed: the TE room "
                                                       "sits on tp_fuse.layers, which imports tp_fuse.distributed "
                                                       "(module __getattr__)",
    ("tp_fuse.distributed", "tp_fuse.graph_breaks"): _DYNAMO,
    ("tp_fuse.ops.compiled.fuser_path", "tp_fuse.graph_breaks"): _DYNAMO,
    ("tp_fuse.ops.compiled.fuser_path", "tp_fuse.ops.compiled.overlap"): _DYNAMO,
    ("tp_fuse.ops.compiled.fuser_path", "tp_fuse.ops.compiled.overlap_fp8"): _DYNAMO,
    ("tp_fuse.launch.trainer", "tp_fuse.launch.logging.compile_stats"): _DYNAMO,
    ("tp_fuse.launch.checkpoint.manager", "tp_fuse.launch.checkpoint.dcp_io"): _DCP,
    ("tp_fuse.kernels.cast", "tp_fuse.kernels.cast_triton"): _TRITON,
    ("tp_fuse.kernels.gemm", "tp_fuse.kernels.gemm_triton"): _TRITON,
    ("tp_fuse.kernels.activations", "tp_fuse.kernels.activations_triton"): _TRITON,
    ("tp_fuse.kernels.norms", "tp_fuse.kernels.norms_triton"): _TRITON,
    ("tp_fuse.kernels.scale_update", "tp_fuse.kernels.scale_update_triton"): _TRITON,
    ("tp_fuse.quantization.nvfp4.cast", "tp_fuse.kernels.nvfp4_cast_triton"): _TRITON,
    ("tp_fuse.quantization.block.cast", "tp_fuse.kernels.block_cast_triton"): _TRITON,
}

#: Function-local imports (each also in ALLOWED_LAZY) that still close a circle, and why the
#: circle is not broken yet. Nothing else may close one.
ALLOWED_CIRCLES: dict[tuple[str, str], str] = {}


@functools.lru_cache(maxsize=1)
def project_modules() -> dict[str, tuple[str, bool]]:
    """Module name -> (file, is_package) for every module of the project's folders."""
    out: dict[str, tuple[str, bool]] = {}
    for folder, package in FOLDERS.items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                if not f.endswith(".py"):
                    continue
                parts = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, folder))[:-3].split(os.sep)
                is_package = parts[-1] == "__init__"
                if is_package:
                    parts = parts[:-1]
                name = ".".join([package, *parts])
                out[name] = (os.path.join(dirpath, f), is_package or name in FILE_PACKAGES)
    return out


def _under(node: ast.AST, parents: dict[ast.AST, ast.AST], kinds: tuple[type, ...], test=None) -> bool:
    p = parents.get(node)
    while p is not None:
        if isinstance(p, kinds) and (test is None or test(p)):
            return True
        p = parents.get(p)
    return False


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_edges(modules: dict[str, tuple[str, bool]]) -> list[tuple[str, str, bool, str]]:
    """``(importer, imported, function_local, "file:line")`` for every project import."""
    edges = []
    for name, (path, is_package) in modules.items():
        with open(path, encoding="utf-8") as f:
            source_text = f.read()
        if "import" not in source_text:
            continue
        tree = ast.parse(source_text, path)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in parents:
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if _under(node, parents, (ast.If,), _is_type_checking):
                continue
            local = _under(node, parents, (ast.FunctionDef, ast.AsyncFunctionDef))
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append(sub if sub in modules else source)
            else:
                targets = [alias.name for alias in node.names]
            where = f"{os.path.relpath(path, ROOT)}:{node.lineno}"
            for target in dict.fromkeys(targets):
                if target in modules and target != name:
                    edges.append((name, target, local, where))
    return edges


def find_cycle(edges: list[tuple[str, str]]) -> list[str]:
    """One circle of the directed graph, as a list of modules, or [] (iterative DFS)."""
    graph: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        graph[a].append(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in list(graph):
        if start in state:
            continue
        path, stack = [start], [iter(graph[start])]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(graph[nxt]))
    return []


@functools.lru_cache(maxsize=1)
def project_edges() -> tuple[tuple[str, str, bool, str], ...]:
    return tuple(import_edges(project_modules()))


def test_the_scan_sees_the_project() -> None:
    modules = project_modules()
    assert {"tp_fuse", "tp_fuse.comm", "tp_fuse.layers.wrap", "tp_fuse.launch.train", "tp_fuse.te"} <= set(modules)
    edges = project_edges()
    assert ("tp_fuse.ops.sequential", "tp_fuse.ops.fuser", False) in {(a, b, local) for a, b, local, _ in edges}
    lazy = ("tp_fuse.ops.compiled.fuser_path", "tp_fuse.ops.compiled.overlap", True)
    assert lazy in {(a, b, local) for a, b, local, _ in edges}
    assert find_cycle([("a", "b"), ("b", "c"), ("c", "a")]) == ["a", "b", "c", "a"]
    assert find_cycle([("a", "b"), ("a", "c"), ("b", "c")]) == []
    assert _reaches([("a", "b"), ("b", "c")], "a", "c") and not _reaches([("a", "b"), ("b", "c")], "c", "a")


def test_function_local_imports_are_the_allowed_ones() -> None:
    edges = project_edges()
    unexplained = sorted(f"{where}: {a} -> {b}" for a, b, local, where in edges
                         if local and (a, b) not in ALLOWED_LAZY)
    assert not unexplained, ("function-local imports of project modules: move them to the top, or list the "
                             "edge in ALLOWED_LAZY with its reason (an optional heavy dependency, or the "
                             "TE room's lazy attributes):\n" + "\n".join(unexplained))


def test_no_import_circle() -> None:
    """Every edge counts, function-local ones included: a lazy import only postpones a circle."""
    edges = [(a, b) for a, b, local, _ in project_edges() if not (local and (a, b) in ALLOWED_CIRCLES)]
    cycle = find_cycle(edges)
    assert not cycle, ("import circle (break it by the dependency direction, e.g. a registry the lower module "
                       "owns, or data classes moved below both; a function-local import does not): "
                       + " -> ".join(cycle))


def _reaches(edges: list[tuple[str, str]], start: str, goal: str) -> bool:
    graph: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        graph[a].append(b)
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def test_allow_lists_hold_only_live_entries() -> None:
    """Each allowed lazy import exists; each allowed circle is still one (fixed: remove it)."""
    edges = project_edges()
    lazy = {(a, b) for a, b, local, _ in edges if local}
    assert not set(ALLOWED_LAZY) - lazy, f"no longer function-local imports: {sorted(set(ALLOWED_LAZY) - lazy)}"
    assert set(ALLOWED_CIRCLES) <= set(ALLOWED_LAZY)
    others = [(a, b) for a, b, _, _ in edges]
    closed = [(a, b) for a, b in ALLOWED_CIRCLES if not _reaches(others, b, a)]
    assert not closed, f"ALLOWED_CIRCLES entries that close no circle any more: {closed}"
