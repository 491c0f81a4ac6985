"""One generic registry, one spelling per trajectory, and an import graph without cycles (issue 15)."""

import ast
from pathlib import Path

import pytest

from softprior.experiments import EXPERIMENTS
from softprior.model.config import MODEL_PRESETS, UnknownModelError
from softprior.paths import GateConfig, get_path, list_paths
from softprior.positional import SCHEMES
from softprior.registry import Registry
from softprior.schedules import Constant
from softprior.tasks.generators import TASKS
from softprior.tasks.registry import UnknownTaskError

SRC = Path(__file__).resolve().parents[1] / "src" / "softprior"


class Oops(ValueError):
    pass


def test_registry_registers_looks_up_and_names_the_allowed():
    r = Registry("widget", Oops, {"a": 1}, describe=lambda v: f"value {v}")
    r.register("b", 2)
    assert r["b"] == 2 and "a" in r and list(r) == ["a", "b"] and len(r) == 2
    assert r.listing() == [("a", "value 1"), ("b", "value 2")]
    with pytest.raises(Oops, match=r"unknown widget 'c'; allowed: a, b"):
        r["c"]
    with pytest.raises(ValueError, match="already registered"):
        r.register("a", 3)
    r.register("a", 3, overwrite=True)
    assert r["a"] == 3 and r.get("zzz") is None


def test_every_concept_uses_the_registry():
    for reg in (TASKS, MODEL_PRESETS, SCHEMES, EXPERIMENTS):
        assert isinstance(reg, Registry)
    with pytest.raises(UnknownTaskError, match="allowed: assoc_recall"):
        TASKS["nope"]
    with pytest.raises(UnknownModelError, match="allowed: base, large"):
        MODEL_PRESETS["huge"]
    assert ("unforced", get_path("unforced").description) in list_paths()


def test_a_constant_gate_has_one_spelling():
    a = GateConfig(mode="scheduled", schedule=Constant(value=0.5))
    b = GateConfig(mode="fixed", value=0.5)
    assert a == b and a.value_at(7, 100) == 0.5
    from softprior.config import make_run_config
    pa = get_path("forced_const0.5").model_copy(update={"pos": a, "content": a})
    assert make_run_config("assoc_recall", pa).run_id == make_run_config("assoc_recall", "forced_const0.5").run_id


def _imports(path: Path, pkg: list[str]) -> set[str]:
    """softprior modules a file imports (module level and inside functions; not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skip |= {id(n) for b in node.body for n in ast.walk(b)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg[: len(pkg) - node.level + 1]
            mod = base + (node.module.split(".") if node.module else [])
            names = [mod + [a.name] for a in node.names] if not node.module else [mod]
            for m in names:
                out.add(".".join(m))
    return out


def _module_of(name: str, files: dict[str, Path]) -> str | None:
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name or None


def test_the_import_graph_has_no_cycle():
    files = {}
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = p
    graph = {}
    for mod, p in files.items():
        pkg = mod.split(".") if p.name == "__init__.py" else mod.split(".")[:-1]
        graph[mod] = {m for m in (_module_of(i, files) for i in _imports(p, pkg)) if m and m != mod}
    graph = {m: {d for d in deps if not m.startswith(d + ".") and not (m == "softprior")} for m, deps in graph.items()}
    graph["softprior"] = set()  # the package face re-exports; its children import siblings, not it
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in graph.get(m, ()):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)


def test_membership_is_a_plain_question_not_an_error():
    from softprior.model.baselines import resolve_baseline
    from softprior.tasks.generators import TASKS
    assert "assoc_recall" in TASKS and "no_such_task" not in TASKS
    from softprior.model.baselines import UnknownBaselineError
    with pytest.raises(UnknownBaselineError) as ei:  # the baseline error, not the scheme registry one
        resolve_baseline("no_such_baseline")
    assert "baseline" in str(ei.value)


def test_a_task_or_prior_name_is_registered_once_unless_overwrite_is_asked():
    """``register_task`` and ``register_prior`` refuse a name already taken (a plugin cannot silently
    replace a built-in task or prior) and replace it only with ``overwrite=True``."""
    from softprior.model.priors import PRIORS, register_prior
    from softprior.tasks.registry import TASK_SPECS, register_task, task_spec
    spec = task_spec("assoc_recall")
    with pytest.raises(ValueError, match="already registered"):
        register_task("assoc_recall", config=spec.config, generator=spec.generator, description="another")
    assert task_spec("assoc_recall") is spec
    family = PRIORS["alibi"]
    with pytest.raises(ValueError, match="already registered"):
        register_prior("alibi", family.build, "another")
    try:
        register_prior("alibi", family.build, "another", overwrite=True)
        assert PRIORS["alibi"].description == "another"
    finally:
        PRIORS.register("alibi", family, overwrite=True)
    assert TASK_SPECS["assoc_recall"] is spec


def test_a_prior_that_is_not_a_module_with_a_bias_is_refused_in_one_line():
    from softprior.model.priors import register_prior

    class NotAPrior:
        pass
    with pytest.raises(TypeError, match="got NotAPrior") as e:
        register_prior("not_a_prior", NotAPrior, "no bias")
    assert "\n" not in str(e.value)
