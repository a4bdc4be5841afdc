"""The house's rules, checked on the source: no import cycle in ``tasks/``, ``flows/``, ``reward_fns/`` (an import
inside a function counts: it closes a cycle all the same), nothing below a stage imports a stage, reward functions
know nothing of the pipeline, every module's docstring says what it owns and what it must not import, no module
grows past 500 formatted lines (then it is split by job), and the homes of what comes next (tools, the node agent,
judges, in-training evaluation: docs/development.md) keep their own import rules once they hold code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("tasks", "flows", "reward_fns")
STAGES = {"validate", "probe", "sft", "grpo", "evaluate", "promote", "watch", "base_model", "preflight", "launch"}
MAX_LINES = 500
# The harness runs alone inside the sandbox, so it may use the standard library only and is one file by design.
LONG_BY_DESIGN = {"reward_fns/sandbox_harness.py"}
PACKAGES_BELOW_STAGES = {
    "config",
    "inputs",
    "models",
    "training",
    "evaluation",
    "tracking",
    "registry",
    "speedups",
    "serving",
}
# Where the next pieces live (docs/development.md, "Homes"), and what each may not import, on top of the rules every
# module keeps. A home is checked once it exists; nothing is created ahead of its code.
HOMES: dict[str, tuple[str, ...]] = {
    # Tools and environments: callables in TRL's tool contract; they know no pipeline (the sandbox tool builds on
    # reward_fns' sandbox), so a tool runs the same in a trainer, a probe or a test.
    "tasks.environments": (
        "tasks.training",
        "tasks.tracking",
        "tasks.registry",
        "tasks.evaluation",
        "prefect",
        "mlflow",
    ),
    # The node agent and its launchers (local, Slurm, Kubeflow TrainJob, manual): MLflow is the only thing between
    # nodes, through tasks.tracking's hand-off; the agent starts the ranks, it never runs a stage itself.
    "tasks.training.nodes": ("prefect",),
    # In-training hold-out evaluation: scores through tasks.evaluation and tasks.models, logs through the trainer's
    # callbacks; no Prefect or MLflow of its own (the stage's callback reports).
    "tasks.training.holdout": ("prefect", "mlflow", "tasks.registry"),
    # Judges and reward models: rewards like the others (no tasks/ at all); the verdict cache is handed in as a
    # plain object by the stage that builds the rewards.
    "reward_fns.judges": ("tasks", "flows", "prefect", "mlflow"),
}
# Convention: a module's docstring opens with what it owns and has a line saying what it must not import (or hold).
MUST_NOT = "Must not "


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
    homes = {home.split(".")[1] for home in HOMES if home.startswith("tasks.") and home.count(".") == 1}
    assert PACKAGES_BELOW_STAGES <= packages <= PACKAGES_BELOW_STAGES | homes | STAGES  # a stage split by job


def third_party_imports(tree: ast.Module) -> set[str]:
    r"""The top-level names of every module a file imports, anywhere in its body (relative imports left out).

    >>> sorted(third_party_imports(ast.parse("import prefect.flows\ndef f():\n    from mlflow import x")))
    ['mlflow', 'prefect']
    """
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def home_violations(root: Path, homes: dict[str, tuple[str, ...]] = HOMES) -> list[str]:
    """Imports a home's modules make that its rule forbids: project modules through the import graph (a lazy
    surface resolved), libraries by their top-level name."""
    graph = import_graph(root)
    modules = module_files(root)
    wrong = []
    for module, targets in sorted(graph.items()):
        for home, forbidden in homes.items():
            if module != home and not module.startswith(home + "."):
                continue
            libraries = third_party_imports(ast.parse(modules[module].read_text()))
            for target in sorted(targets | libraries):
                if any(target == f or target.startswith(f + ".") for f in forbidden):
                    wrong.append(f"{module} (in {home}) imports {target}")
    return wrong


def test_the_homes_of_what_comes_next_keep_their_rules() -> None:
    assert home_violations(REPO) == []


def test_the_home_rules_catch_a_tool_that_reports_to_mlflow(tmp_path: Path) -> None:
    (tmp_path / "tasks" / "environments").mkdir(parents=True)
    (tmp_path / "tasks" / "__init__.py").write_text("")
    (tmp_path / "tasks" / "environments" / "__init__.py").write_text("")
    (tmp_path / "tasks" / "environments" / "python_tool.py").write_text("def run():\n    import mlflow\n")
    (tmp_path / "tasks" / "environments" / "ok.py").write_text("import json\n")
    assert home_violations(tmp_path) == ["tasks.environments.python_tool (in tasks.environments) imports mlflow"]


def oversized_modules(root: Path, package: str) -> dict[str, int]:
    """Modules of ``package`` over ``MAX_LINES`` lines (as ``ruff format`` lays them out)."""
    return {
        str(path.relative_to(root)): n
        for path in (root / package).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES and str(path.relative_to(root)) not in LONG_BY_DESIGN
    }


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_over_500_lines(package: str) -> None:
    assert oversized_modules(REPO, package) == {}, "split these by job (docs/development.md)"


def modules_without_the_convention(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Modules whose docstring is missing or has no line starting with ``Must not`` (what it must not import or
    hold)."""
    missing = []
    for name, path in module_files(root, packages).items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if not any(line.lstrip().startswith(MUST_NOT) or f" {MUST_NOT}" in line for line in doc.splitlines()):
            missing.append(name)
    return sorted(missing)


def test_every_module_says_what_it_owns_and_must_not_import() -> None:
    assert modules_without_the_convention(REPO) == []


def test_the_convention_check_fails_on_a_module_without_it(tmp_path: Path) -> None:
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "__init__.py").write_text('"""The stages.\nMust not import: torch at import."""\n')
    (tmp_path / "tasks" / "bare.py").write_text("x = 1\n")
    (tmp_path / "tasks" / "vague.py").write_text('"""Helpers."""\n')
    assert modules_without_the_convention(tmp_path, ("tasks",)) == ["tasks.bare", "tasks.vague"]


def test_no_surface_name_is_also_a_submodule_name() -> None:
    """Once ``pkg.name`` is imported as a module, ``from pkg import name`` gives the module, not the function."""
    clashes = []
    for init in (REPO / "tasks").glob("*/__init__.py"):
        exports = lazy_exports(ast.parse(init.read_text()))
        clashes += [f"{init.parent.name}.{name}" for name in exports if (init.parent / f"{name}.py").is_file()]
        clashes += [
            f"{init.parent.name}.{name} -> {module}"
            for name, module in exports.items()
            if not (init.parent / f"{module}.py").is_file()
        ]
    assert clashes == []
