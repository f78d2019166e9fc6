"""The import contract (issue 15): the serving path never imports a tool, and vllm_kvq has
no import cycles.

Read from the source with ast, so function-local imports count as much as top-level ones
(they are how an import cycle hides); nothing is imported. Importing a module also runs
its packages' __init__.py, so those are edges too. Imports under `if TYPE_CHECKING:` never
run and are left out.

- serving path: what a vLLM engine or `vllm serve` loads through our entry points
  (formats, config, codebook_file, plugin, backend, residual, ops, serving) and all they
  import, directly or not;
- tools: vllm_kvq.tools.* (compare, calibrate, evaluate, corpus, kernel timing); they may
  import the serving path.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "vllm_kvq"
SERVING = ["vllm_kvq.formats", "vllm_kvq.config", "vllm_kvq.codebook_file", "vllm_kvq.plugin",
           "vllm_kvq.backend", "vllm_kvq.residual", "vllm_kvq.ops", "vllm_kvq.serving"]
TOOLS = "vllm_kvq.tools"


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__.py)."""
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imported_names(path: Path, name: str, is_pkg: bool) -> set[str]:
    """Dotted names this module imports anywhere in its body (relative imports resolved;
    `from a import b` yields a.b, which is dropped later if b is not a module)."""
    found: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for c in child.orelse:
                    visit(c)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module
                found.add(mod)
                found.update(f"{mod}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the vllm_kvq modules importing it runs (with their packages' __init__)."""
    mods = modules()
    g = {}
    for name, path in mods.items():
        edges = set()
        for imp in imported_names(path, name, path.name == "__init__.py"):
            parts = imp.split(".")
            for i in range(1, len(parts) + 1):  # a.b.c runs a, a.b and a.b.c
                prefix = ".".join(parts[:i])
                if prefix in mods and prefix != name:
                    edges.add(prefix)
        g[name] = edges
    return g


def reachable(g: dict[str, set[str]], start: str) -> dict[str, str]:
    """Module -> the module that first imported it, for everything `start` imports."""
    via = {start: ""}
    todo = [start]
    while todo:
        m = todo.pop()
        for n in sorted(g[m]):
            if n not in via:
                via[n] = m
                todo.append(n)
    return via


def chain(via: dict[str, str], end: str) -> str:
    path = [end]
    while via[path[-1]]:
        path.append(via[path[-1]])
    return " -> ".join(reversed(path))


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    return out


def test_the_walker_sees_function_local_and_relative_imports(tmp_path):
    g = graph()
    # config imports the calibration file inside functions only
    assert "vllm_kvq.codebook_file" in g["vllm_kvq.config"]
    # `from vllm_kvq import ops`: a module named in the from-list
    assert "vllm_kvq.ops" in g["vllm_kvq.backend"]
    # a submodule's import runs its packages
    assert {"vllm_kvq.tools", "vllm_kvq.tools.compare"} <= g["vllm_kvq.tools.compare.report"]
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a.b\n"
                 "def f():\n    from . import c\n    from ..d import e\n")
    assert imported_names(f, "p.q.m", False) == {"typing", "typing.TYPE_CHECKING", "p.q",
                                                 "p.q.c", "p.d", "p.d.e"}


@pytest.mark.parametrize("module", SERVING)
def test_serving_path_never_imports_a_tool(module):
    g = graph()
    assert module in g, f"{module} is not in the package any more: update SERVING"
    via = reachable(g, module)
    bad = sorted(m for m in via if m == TOOLS or m.startswith(TOOLS + "."))
    assert not bad, "the serving path imports tools: " + "; ".join(chain(via, m) for m in bad)


def test_tools_are_where_the_contract_expects_them():
    mods = modules()
    for tool in ("compare.cli", "calibrate.cli", "evaluate", "corpus", "kernel_timing"):
        assert f"{TOOLS}.{tool}" in mods
    # tools may import the serving path (the compare tool sizes pages with config/formats)
    assert "vllm_kvq.config" in reachable(graph(), f"{TOOLS}.compare.cli")


def test_no_import_cycles_inside_vllm_kvq():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)
