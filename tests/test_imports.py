"""The import structure: no cycle among the project's modules, and the paths that must stay light (a config
error, ``rail --help``, ``import controller``) import neither torch nor transformers.

The cycle check reads the source with :mod:`ast` and executes nothing. It counts every import of a project
module, at module level and inside functions alike: a lazy import only moves a circle from import time to call
time, where it still ties the two modules together.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from processes import ROOT, run

PACKAGES = ("rail", "policy", "controller")
HEAVY = ("torch", "transformers")


def project_modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's ``__init__``) for every module of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def import_edges(modules: dict[str, tuple[Path, bool]]) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: line of the first such import}. ``from pkg import name`` is an edge
    to ``pkg.name`` when that is a module, else to ``pkg``; imports under ``if TYPE_CHECKING:`` never run."""

    def owner(name: str) -> str | None:  # the longest project module that ``name`` is or lies in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, dict[str, int]] = {}
    for mod, (path, is_pkg) in modules.items():
        here = mod if is_pkg else mod.rpartition(".")[0]
        out: dict[str, int] = {}
        stack = [ast.parse(path.read_text(encoding="utf-8"), str(path))]
        while stack:
            for node in ast.iter_child_nodes(stack.pop()):
                if _type_checking_only(node):
                    continue
                stack.append(node)
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:  # relative: from .x import y
                        parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                        base = ".".join(parts + ([base] if base else []))
                    targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
                else:
                    continue
                for t in targets:
                    dep = owner(t)
                    if dep is not None and dep != mod:
                        out.setdefault(dep, node.lineno)
        edges[mod] = out
    return edges


def find_cycle(edges: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep in sorted(edges.get(m, {})):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_graph_sees_imports_at_every_level():
    edges = import_edges(project_modules())
    assert "rail.config" in edges["rail.cli"]  # module level
    assert "rail.train" in edges["rail.cli"]  # inside a function
    assert "rail.lab.ablate_ray" in edges["rail.lab.ablate"]  # the Ray backend, imported when chosen
    assert "rail.envs.toolcalls" in edges["rail.envs.base"]
    assert "rail.envs.actions" in edges["rail.envs.toolcalls"]
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}}) is None


def test_no_import_cycles():
    edges = import_edges(project_modules())
    cycle = find_cycle(edges)
    if cycle:
        where = [f"{a} -> {b} ({modules_path(a)}:{edges[a][b]})" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle:\n  " + "\n  ".join(where))
    # the two circles this test was written against, in neither direction at any level
    assert "rail.lab.ablate" not in edges["rail.lab.ablate_ray"]
    assert "rail.envs.base" not in edges["rail.envs.toolcalls"]


def test_the_training_loop_never_imports_the_lab():
    """The research tooling (``rail.lab``) imports the loop, never the other way: nothing outside ``rail.lab``
    reaches it, directly or through other modules, but the CLI's lab commands."""
    edges = import_edges(project_modules())
    lab = {m for m in edges if m == "rail.lab" or m.startswith("rail.lab.")}
    assert {"rail.lab.ablate", "rail.lab.ablation_report", "rail.lab.adaptivity"} <= lab
    for mod in sorted(set(edges) - lab - {"rail.cli"}):
        seen, todo = {mod}, [mod]
        while todo:
            for dep in edges.get(todo.pop(), {}):
                if dep not in seen and dep != "rail.cli":
                    seen.add(dep)
                    todo.append(dep)
        assert not seen & lab, f"{mod} reaches the lab: {sorted(seen & lab)}"


def modules_path(mod: str) -> str:
    return str(project_modules()[mod][0].relative_to(ROOT))


def _run(code: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-c", code], timeout=120)


def _heavy_after(code: str) -> str:
    """``code``, then print which of HEAVY are imported."""
    return f"{code}\nimport sys\nprint('heavy:', sorted(m for m in {HEAVY!r} if m in sys.modules))"


def test_a_refused_config_imports_no_torch():
    # validate() itself: every name it checks against (controllers, interventions, engines, environments)
    r = _run(_heavy_after(
        "from rail.config import Config, ConfigError, validate\n"
        "cfg = Config()\ncfg.budget.group_size = 0\n"
        "try:\n    validate(cfg)\nexcept ConfigError as e:\n    print('refused:', e)\n"
        "else:\n    raise SystemExit('accepted')\n"))
    assert r.returncode == 0, r.stderr
    assert "refused: budget.group_size = 0" in r.stdout and "heavy: []" in r.stdout, r.stdout
    # and a config error at the end of the menu and ladder checks (the last names validate reads)
    r = _run(_heavy_after(
        "from rail.config import ConfigError, build_config\n"
        "try:\n    build_config(sets=[{'controller': {'ladder': ['resample@nowhere']}}])\n"
        "except ConfigError as e:\n    print('refused:', e)\n"))
    assert r.returncode == 0, r.stderr
    assert "refused: controller.ladder" in r.stdout and "heavy: []" in r.stdout, r.stdout


def test_the_cli_refuses_a_config_without_torch():
    r = _run(_heavy_after(
        "import sys\nfrom rail.cli import main\n"
        "rc = main(['train', '--set', 'budget.group_size=0'])\nprint('rc:', rc)"))
    assert r.returncode == 0, r.stderr
    assert "rc: 2" in r.stdout and "heavy: []" in r.stdout, (r.stdout, r.stderr)
    assert "config error: budget.group_size = 0" in r.stderr


def test_help_and_the_controller_package_import_no_torch():
    r = _run(_heavy_after(
        "from rail.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit as e:\n    print('exit:', e.code)"))
    assert r.returncode == 0, r.stderr
    assert "exit: 0" in r.stdout and "heavy: []" in r.stdout, r.stdout
    r = _run(_heavy_after("import controller, controller.session, controller.traces"))
    assert r.returncode == 0 and "heavy: []" in r.stdout, (r.stdout, r.stderr)
