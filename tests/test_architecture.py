"""The house's rules, checked on the source: no import cycle in ``tasks/``, ``flows/``, ``reward_fns/`` (an import
inside a function counts: it closes a cycle all the same), nothing below a stage imports a stage, reward functions
know nothing of the pipeline, and no module grows past 350 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("tasks", "flows", "reward_fns")
STAGES = {"validate", "probe", "sft", "grpo", "evaluate", "promote", "watch", "base_model", "preflight", "launch"}
MAX_LINES = 350
# The harness runs alone inside the sandbox, so it may use the standard library only and is one file by design.
LONG_BY_DESIGN = {"reward_fns/sandbox_harness.py"}


def module_files(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name → file, for every ``.py`` file under ``packages`` (a package is its ``__init__``)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def lazy_exports(tree: ast.Module) -> dict[str, str]:
    """A package ``__init__``'s ``_EXPORTS`` (name → submodule), if it declares its surface that way."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module → the project modules it imports, anywhere in its body. ``from pkg import name`` points at the
    submodule ``name`` is, or the one a lazy surface serves it from; importing a module imports its parents."""
    modules = module_files(root, packages)
    trees = {name: ast.parse(path.read_text()) for name, path in modules.items()}
    surfaces = {name: lazy_exports(tree) for name, tree in trees.items()}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, tree in trees.items():
        is_package = modules[name].name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {t for alias in node.names if (t := resolve(alias.name))}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in modules:
                        targets.add(full)
                    elif alias.name in surfaces.get(base, {}):
                        targets.add(f"{base}.{surfaces[base][alias.name]}")
                    elif target := resolve(base):
                        targets.add(target)
        for target in list(targets):  # importing a.b.c runs a/__init__ and a/b/__init__ first
            parts = target.split(".")
            targets |= {".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in modules}
        targets.discard(name)
        graph[name] = targets - set(_parents(name))  # a module's own parents are imported before it
    return graph


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every import cycle.

    >>> import_cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}})
    [['a', 'b']]
    >>> import_cycles({"a": {"b"}, "b": set()})
    []
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_no_import_cycle_in_the_project() -> None:
    cycles = import_cycles(import_graph(REPO))
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_check_finds_a_cycle_closed_inside_a_function(tmp_path: Path) -> None:
    (tmp_path / "tasks" / "tracking").mkdir(parents=True)
    (tmp_path / "tasks" / "__init__.py").write_text("")
    (tmp_path / "tasks" / "tracking" / "__init__.py").write_text('_EXPORTS = {"open_run": "runs"}\n')
    (tmp_path / "tasks" / "tracking" / "runs.py").write_text("def open_run():\n    from tasks.registry import x\n")
    (tmp_path / "tasks" / "registry.py").write_text("from tasks.tracking import open_run\nx = 1\n")
    graph = import_graph(tmp_path, ("tasks",))
    assert graph["tasks.registry"] >= {"tasks.tracking.runs"}  # resolved through the lazy surface
    assert import_cycles(graph) == [["tasks.registry", "tasks.tracking.runs"]]


def test_nothing_below_a_stage_imports_a_stage_or_a_flow() -> None:
    graph = import_graph(REPO)
    stage_modules = {f"tasks.{stage}" for stage in STAGES}
    wrong = []
    for module, targets in graph.items():
        below_stages = module.startswith("tasks.") and module.count(".") >= 2  # tasks/<package>/<module>
        for target in targets:
            if below_stages and target in stage_modules:
                wrong.append(f"{module} imports the stage {target}")
            if module.startswith("tasks") and target.startswith("flows"):
                wrong.append(f"{module} imports the flow module {target}")
            if module.startswith("reward_fns") and not target.startswith("reward_fns"):
                wrong.append(f"{module} (a reward function) imports {target}")
    assert wrong == []


def test_tasks_top_level_holds_stages_packages_and_few_shared_modules() -> None:
    shared = {"__init__", "errors", "layout"}
    top = {p.stem for p in (REPO / "tasks").glob("*.py")}
    assert top - STAGES - shared == set()
    packages = {p.name for p in (REPO / "tasks").iterdir() if (p / "__init__.py").is_file()}
    assert packages == {"config", "inputs", "models", "training", "evaluation", "tracking", "registry", "speedups"}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_over_350_lines(package: str) -> None:
    long = {
        str(path.relative_to(REPO)): n
        for path in (REPO / package).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES and str(path.relative_to(REPO)) not in LONG_BY_DESIGN
    }
    assert long == {}


def test_no_surface_name_is_also_a_submodule_name() -> None:
    """Once ``pkg.name`` is imported as a module, ``from pkg import name`` gives the module, not the function."""
    clashes = []
    for init in (REPO / "tasks").glob("*/__init__.py"):
        exports = lazy_exports(ast.parse(init.read_text()))
        clashes += [f"{init.parent.name}.{name}" for name in exports if (init.parent / f"{name}.py").is_file()]
        clashes += [f"{init.parent.name}.{name} -> {module}" for name, module in exports.items()
                    if not (init.parent / f"{module}.py").is_file()]  # fmt: skip
    assert clashes == []
