"""No import circles between nanovllm's modules, and every module imports on its own.

The static check reads the import statements of every module (with ast, nothing is imported) and looks for a cycle
in the graph they make: once counting only what runs at import time, once also counting the imports deferred into
functions (a deferred import still ties the two modules together; cli.py <-> eval and models/registry.py <-> models
were such circles). The dynamic check imports each module first, in a fresh copy of the interpreter, so that an
earlier import cannot hide a circle.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import pkgutil
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "nanovllm"


def package_modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package, walked with pkgutil without importing it: name -> (source file, is a package)."""
    modules = {PACKAGE: (ROOT / PACKAGE / "__init__.py", True)}

    def walk(directory: Path, prefix: str) -> None:
        for info in pkgutil.iter_modules([str(directory)], prefix):
            leaf = info.name.rpartition(".")[2]
            if info.ispkg:
                modules[info.name] = (directory / leaf / "__init__.py", True)
                walk(directory / leaf, info.name + ".")
            elif (directory / f"{leaf}.py").is_file():
                modules[info.name] = (directory / f"{leaf}.py", False)

    walk(ROOT / PACKAGE, PACKAGE + ".")
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_statements(path: Path, deferred: bool) -> list[ast.Import | ast.ImportFrom]:
    """The module's import statements that run when it is imported (class bodies and if/try blocks included;
    `if TYPE_CHECKING:` blocks left out), plus with deferred=True those inside functions."""
    found = []

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                if deferred:
                    visit(ast.iter_child_nodes(node))
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.orelse)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            else:
                visit(ast.iter_child_nodes(node))

    visit(ast.parse(path.read_text(), str(path)).body)
    return found


def import_graph(deferred: bool) -> dict[str, set[str]]:
    """module -> the package modules its import statements name. An import names the deepest module it spells
    (`from nanovllm.models import llama` names nanovllm.models.llama, `from nanovllm import LLM` names nanovllm);
    the parent packages Python imports on the way are left out, as every module would otherwise reach nanovllm."""
    modules = package_modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (path, is_package) in modules.items():
        targets = set()
        for node in import_statements(path, deferred):
            if isinstance(node, ast.Import):
                targets.update(owner(alias.name) for alias in node.names)
                continue
            base = node.module or ""
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                base = importlib.util.resolve_name("." * node.level + base, package)
            if base.partition(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.add(full if full in modules else owner(base))
        graph[name] = targets - {None, name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle for each strongly connected component of more than one module (Tarjan), as
    [a, b, ..., a] starting at its first module in sorted order."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:
        start = min(component)
        came_from, queue = {}, deque([start])
        while queue:  # breadth first from start back to start, inside the component
            v = queue.popleft()
            if start in graph[v]:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                cycles.append([*reversed(path), start])
                break
            for w in sorted(graph[v] & component):
                if w not in came_from and w != start:
                    came_from[w] = v
                    queue.append(w)
    return sorted(cycles)


def test_graph_sees_the_package():
    graph = import_graph(deferred=True)
    assert {"nanovllm", "nanovllm.cli", "nanovllm.engine_args", "nanovllm.models.registry"} <= set(graph)
    assert "nanovllm.engine_args" in graph["nanovllm.cli"]
    assert "nanovllm.llm" in graph["nanovllm"]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c", "a"]]


@pytest.mark.parametrize("deferred", [False, True], ids=["at-import", "with-deferred-imports"])
def test_no_import_cycles(deferred):
    cycles = import_cycles(import_graph(deferred))
    for cycle in cycles:
        print("import cycle:", " -> ".join(cycle))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_engine_args_imports_only_config():
    graph = import_graph(deferred=True)
    assert graph["nanovllm.engine_args"] == {"nanovllm.config"}
    assert graph["nanovllm.config"] == set()
    users = sorted(name for name, targets in graph.items() if "nanovllm.cli" in targets)
    assert users == [], f"only the console entry point should import nanovllm.cli: {users}"


# One interpreter loads the package's third-party imports once, then forks a child per module that imports just
# that module: each child starts with no nanovllm module loaded, at a fraction of a fresh interpreter's start-up.
# A child whose import fails for want of a third-party package (an optional extra) reports SKIP.
_IMPORT_EACH = r"""
import importlib, os, sys, traceback
from collections import deque

preload, modules = PRELOAD, MODULES
for statement in preload:
    try:
        exec(statement, {})
    except Exception:
        pass
assert not any(m == "nanovllm" or m.startswith("nanovllm.") for m in sys.modules)


def child(name):
    try:
        importlib.import_module(name)
    except ImportError as e:
        missing = e.name or ""
        if missing and missing.partition(".")[0] != "nanovllm":
            print(f"SKIP {name}: needs {missing}")
            return 0
        traceback.print_exc(file=sys.stdout)
        return 1
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        return 1
    print(f"OK {name}")
    return 0


def start(name):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.dup2(write, 1)
        os.dup2(write, 2)
        code = 1
        try:
            code = child(name)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write)
    return name, pid, read


failed, running, pending = [], deque(), list(modules)
while pending or running:
    while pending and len(running) < max(2, os.cpu_count() or 1):
        running.append(start(pending.pop(0)))
    name, pid, read = running.popleft()
    with os.fdopen(read, "rb") as pipe:
        output = pipe.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    print(output.rstrip() if code == 0 else f"FAIL {name} (exit {code}):\n{output}", flush=True)
    if code != 0:
        failed.append(name)
print("failed:", " ".join(failed) if failed else "none")
sys.exit(1 if failed else 0)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the import check forks a child per module")
def test_each_module_imports_first_in_a_fresh_interpreter():
    modules = sorted(name for name in package_modules() if name.rpartition(".")[2] != "__main__")  # runs at import
    preload = set()
    for path, _ in package_modules().values():
        for node in import_statements(path, deferred=False):
            if isinstance(node, ast.ImportFrom) and (node.level or node.module == "__future__"):
                continue
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module]
            if all(n.partition(".")[0] != PACKAGE for n in names):
                preload.add(ast.unparse(node))
    script = _IMPORT_EACH.replace("PRELOAD", repr(sorted(preload))).replace("MODULES", repr(modules))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    print(result.stdout, result.stderr)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    imported = [line for line in result.stdout.splitlines() if line.startswith("OK ")]
    assert "OK nanovllm.cli" in imported and "OK nanovllm.models.registry" in imported
