"""tools/ as a package: its modules import one another as `tools.<group>.<name>` with no
import cycle (read from the source with ast, nothing imported), and every script answers
`--help` with its docstring and exit 0 (`python -m tools.<group>.<name> --help`, from the
repository root)."""

from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(TOOLS.rglob("*.py"))}
SCRIPTS = sorted(name for name, path in MODULES.items() if 'if __name__ == "__main__"' in path.read_text())


def imported_modules(tree: ast.AST) -> set[str]:
    """The tools modules a module's source imports, wherever the import statement sits."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from tools.check import fuzz` imports tools.check.fuzz; `from tools.x import f` imports tools.x
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        found.update(name for name in names if name in MODULES)
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {name: imported_modules(ast.parse(path.read_text())) - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_and_passes_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_tools_import_one_another_without_a_cycle():
    graph = import_graph(MODULES)
    assert graph["tools.bench.bench_gpu"] >= {"tools.common.runs", "tools.common.step_clock"}  # the graph is read
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_the_tools_import_one_another_by_package_path():
    """A bare `from bench import ...` only worked with the script's own folder on sys.path,
    and hides the edge from the cycle check."""
    stems = {name.rsplit(".", 1)[-1] for name in MODULES} - {"tools"}
    bare = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            tops = ([a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import)
                    else [node.module.split(".")[0]] if isinstance(node, ast.ImportFrom) and node.module else [])
            bare += [f"{name}: {top}" for top in tops if top in stems]
    assert not bare, bare


def test_every_script_is_found():
    assert {"tools.bench.bench", "tools.check.load", "tools.device.nvrtc_check", "tools.models.build_model",
            "tools.probe.step_gaps"} <= set(SCRIPTS)
    assert not [name for name in SCRIPTS if name.startswith("tools.common.")]  # shared code only


def help_of(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", script, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.timeout(600)
def test_every_script_answers_help_with_what_it_does():
    """`--help` parses no model and loads no weights: each script's answer is its argparse
    help, whose description is the module docstring (its first line at least)."""
    with ThreadPoolExecutor(4) as pool:
        done = dict(zip(SCRIPTS, pool.map(help_of, SCRIPTS), strict=True))
    failed = {s: (d.returncode, d.stderr[-300:]) for s, d in done.items() if d.returncode != 0}
    assert not failed, failed
    for script, result in done.items():
        first_line = ast.get_docstring(ast.parse(MODULES[script].read_text())).splitlines()[0]
        assert result.stdout.startswith("usage:"), script
        assert " ".join(first_line.split()) in " ".join(result.stdout.split()), script
