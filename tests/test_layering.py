"""The package's layering: no import cycle, counting every import (module level, inside functions,
and under ``if TYPE_CHECKING:``), and no lower layer reaching up into ``calibration/`` (docs/DESIGN.md,
"Layers")."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "softprior"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its ``__init__``)."""
    out = {}
    for p in sorted(SRC.rglob("*.py")):
        parts = list(p.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imported(path: Path, mod: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` (module ``mod``) imports in any import statement, wherever it
    stands: ``from X import y`` is module ``X.y`` where that is a module, else ``X``; importing a module
    of another package runs that package's ``__init__`` too (``mod``'s own packages are not counted:
    they are being imported already)."""
    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                source = ".".join(base + (node.module.split(".") if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import softprior.x.y` names softprior.x.y; a name within a module
                t = t.rpartition(".")[0]
            while t and t != mod and not mod.startswith(t + "."):
                out.add(t)
                t = t.rpartition(".")[0]
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imported(p, m, modules) for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle(tmp_path):
    # the finder sees a cycle closed by a type-only import and a function-level one (a planted package)
    pkg = tmp_path / "softprior"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    modules = {"softprior": pkg / "__init__.py", "softprior.a": pkg / "a.py", "softprior.b": pkg / "b.py"}
    graph = {m: _imported(p, m, modules) for m, p in modules.items()}
    assert graph == {"softprior": set(), "softprior.a": {"softprior.b"}, "softprior.b": {"softprior.a"}}
    assert find_cycle(graph) in (["softprior.a", "softprior.b", "softprior.a"],
                                 ["softprior.b", "softprior.a", "softprior.b"])
    # the package
    graph = import_graph()
    assert len(graph) > 40 and "softprior.store" in graph["softprior.executors.sweep"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_lower_layer_imports_calibration():
    """Calibration is a top layer (the search, identification, the robustness map): only the command line's
    ``calibrate`` (``cli/calibrate.py``), the paper's driver, the study's (``softprior study``) and the
    calibration's reports (``reports/calibration.py``, ``reports/calibration_doc.py``: its table, figure,
    registered record and CALIBRATION.md's blocks) import it. The records every layer reads live below ``config``
    (``softprior.preregistration``), the store's records and clock in ``softprior.store.record_clock``."""
    graph = import_graph()
    users = {m for m, deps in graph.items() if not m.startswith("softprior.calibration")
             and any(d == "softprior.calibration" or d.startswith("softprior.calibration.") for d in deps)}
    assert users <= {"softprior.cli.calibrate", "softprior.paper", "softprior.study", "softprior.reports.calibration",
                     "softprior.reports.calibration_doc"}, sorted(users)
    assert not {d for d in graph["softprior.preregistration"] if d != "softprior"}, graph["softprior.preregistration"]


def test_only_the_drivers_import_the_reports():
    """The report writers (``reports/``) lie above ``calibration/``: only the command line and the paper's
    and the study's drivers import them (docs/DESIGN.md, "The packages")."""
    graph = import_graph()
    users = {m for m, deps in graph.items() if not m.startswith("softprior.reports")
             and any(d == "softprior.reports" or d.startswith("softprior.reports.") for d in deps)}
    assert users and all(m.startswith("softprior.cli.") or m in ("softprior.paper", "softprior.study")
                         for m in users), sorted(users)


def test_only_the_store_touches_its_private_functions():
    """``RunStore`` owns every file under the store: outside ``softprior.store`` no module imports a
    private name of the store package nor calls one of its private writers or connections (they go
    through ``RunStore``'s public methods: ``write_cache``, ``write_record``, ``optuna_url``, ...)."""
    private = {"_connect", "_atomic_write_bytes", "_atomic_write_text", "_atomic_save_tensors", "_row"}
    found = []
    for mod, path in _modules().items():
        if mod == "softprior.store" or mod.startswith("softprior.store."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and "store" in (node.module or "").split("."):
                found += [f"{mod}: imports {a.name}" for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr in private:
                found.append(f"{mod}: line {node.lineno} uses .{node.attr}")
    assert not found, found


# which packages each lower package may import (docs/DESIGN.md, "The packages"): the model does not know
# how it is trained, the training loop does not know sweeps, stores' sweeps or reports, and the kernels
# import nothing of the package (they read the model's config by its fields)
LOWER = {
    "softprior.tasks": {"softprior.registry", "softprior.plugins"},
    "softprior.positional": {"softprior.registry"},
    "softprior.kernels": set(),
    "softprior.model": {"softprior.kernels", "softprior.paths", "softprior.plugins", "softprior.positional",
                        "softprior.registry", "softprior.schedules"},
    "softprior.training": {"softprior.config", "softprior.model", "softprior.paths", "softprior.provenance",
                           "softprior.tasks", "softprior.kernels", "softprior.registry", "softprior.schedules"},
}


def test_the_lower_packages_import_only_what_lies_below_them():
    graph = import_graph()
    for pkg, allowed in LOWER.items():
        for m, deps in graph.items():
            if m != pkg and not m.startswith(pkg + "."):
                continue
            outside = {d for d in deps if d != "softprior" and d != pkg and not d.startswith(pkg + ".")}
            bad = {d for d in outside if not any(d == a or d.startswith(a + ".") for a in allowed)}
            assert not bad, f"{m} imports {sorted(bad)}: {pkg} may import only {sorted(allowed)}"


# modules whose ``__all__`` may name what another module defines: the package face (its lazy public API,
# PEP 562, names each its defining module) and the kernels' package (kept as it is while the kernels
# are reworked elsewhere)
REEXPORTERS = {"softprior", "softprior.kernels"}


def test_no_module_re_exports_another_modules_names():
    """A module's ``__all__`` lists only what it defines (docs/DESIGN.md, "Layers"): callers import a
    name from the module that defines it, so no name has two addresses."""
    found = []
    for mod, path in _modules().items():
        if mod in REEXPORTERS:
            continue
        tree = ast.parse(path.read_text(), str(path))
        defined, listed = set(), []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                    listed += [e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)]
        found += [f"{mod}: {name}" for name in listed if name not in defined]
    assert not found, found
