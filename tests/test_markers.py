"""Test markers stay consistent: ``pytest -m multirank`` selects every test that starts
several processes and ``pytest -m gpu`` every CUDA-only test (pyproject's markers).

A source scan (nothing is imported): a test module that starts ranks (``run_distributed``,
``torchrun``) carries ``pytest.mark.multirank``, and so does each test that starts them itself
or through a fixture or helper of its module (``pytest -m "not multirank"`` would otherwise
select a test whose fixture starts ranks); a test that skips without CUDA (a
``skipif(not torch.cuda.is_available() ...)`` mark, or ``pytest.skip`` under ``if not
torch.cuda.is_available()``) carries ``pytest.mark.gpu``.
"""

from __future__ import annotations

import ast
import glob
import os

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
MODULES = sorted(glob.glob(os.path.join(TESTS, "test_*.py")))
#: Calls that start several ranks (tests/dist_utils.py, tests/test_launch_train.py).
RANK_STARTERS = ("run_distributed(", "torchrun(")


def _source(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("path", MODULES, ids=os.path.basename)
def test_multi_rank_modules_carry_multirank(path: str) -> None:
    source = _source(path)
    calls = [line for line in source.splitlines()
             if any(s in line for s in RANK_STARTERS) and not line.lstrip().startswith(("def ", "#", "from "))]
    if calls:
        assert "pytest.mark.multirank" in source, f"{os.path.basename(path)} starts ranks ({calls[0].strip()!r}) " \
                                                  "but no test in it carries @pytest.mark.multirank"


def _starts_ranks(fn: ast.FunctionDef, functions: dict[str, ast.FunctionDef], seen: set[str]) -> bool:
    """Whether ``fn``, or a function of its module it names (a fixture parameter, a helper it
    calls), calls a rank starter or builds a ``python -m torch.distributed.run`` command."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and any(ast.unparse(node.func) + "(" == s for s in RANK_STARTERS):
            return True
        if isinstance(node, ast.List) and any(isinstance(e, ast.Constant) and e.value == "torch.distributed.run"
                                              for e in node.elts):  # a command line [python, -m, torchrun]
            return True
    names = [a.arg for a in fn.args.args] + [n.id for n in ast.walk(fn) if isinstance(n, ast.Name)]
    for name in names:
        if name in functions and name not in seen:
            seen.add(name)
            if _starts_ranks(functions[name], functions, seen):
                return True
    return False


def _marks(node: ast.AST) -> list[str]:
    return [ast.unparse(d) for d in getattr(node, "decorator_list", [])]


@pytest.mark.parametrize("path", MODULES, ids=os.path.basename)
def test_each_multi_rank_test_carries_multirank(path: str) -> None:
    tree = ast.parse(_source(path))
    module_marks = [ast.unparse(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)]
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    tests = [(fn, []) for fn in functions.values() if fn.name.startswith("test_")]
    tests += [(fn, _marks(cls)) for cls in tree.body if isinstance(cls, ast.ClassDef)
              for fn in cls.body if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")]
    missing = [fn.name for fn, class_marks in tests
               if _starts_ranks(fn, functions, {fn.name})
               and not any("multirank" in m for m in (*_marks(fn), *class_marks, *module_marks))]
    assert not missing, f"tests that start ranks (themselves or through a fixture) without multirank: {missing}"


def _cuda_only(fn: ast.FunctionDef) -> bool:
    for deco in fn.decorator_list:
        text = ast.unparse(deco)
        if "skipif" in text and "not torch.cuda.is_available()" in text:
            return True
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and ast.unparse(node.test).startswith("not torch.cuda.is_available()") \
                and any("pytest.skip" in ast.unparse(s) for s in node.body):
            return True
    return False


@pytest.mark.parametrize("path", MODULES, ids=os.path.basename)
def test_cuda_only_tests_carry_gpu(path: str) -> None:
    tree = ast.parse(_source(path))
    # Module-level marks such as `cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), ...)`.
    aliases = {t.id for node in tree.body if isinstance(node, ast.Assign)
               and "not torch.cuda.is_available()" in ast.unparse(node.value) for t in node.targets
               if isinstance(t, ast.Name)}
    missing = []
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")):
        decos = [ast.unparse(d) for d in fn.decorator_list]
        if (_cuda_only(fn) or any(d in aliases for d in decos)) and "pytest.mark.gpu" not in decos:
            missing.append(fn.name)
    assert not missing, f"CUDA-only tests without @pytest.mark.gpu: {missing}"
