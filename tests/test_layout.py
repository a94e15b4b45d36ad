"""The package's layout rules, read off the source so that they stay true.

* ``lightning_paci/engine/`` imports no Lightning, directly or through another module of the package (walked over
  every import statement, module-level or inside a function), and importing all of it loads no Lightning;
* no import cycle among module-level imports;
* at most 8 modules directly in ``lightning_paci/``; no module over 400 lines, no class over 250 -- but
  ``strategy.py``, one class over Lightning's strategy interface (about 45 hooks and properties, each a few lines
  that delegate): splitting it into mixins over several files cost every reader the chain, so it is one class in one
  file, as each of Lightning's strategies is, and its limits are 600 and 500 lines; and ``engine/supervision.py``,
  the failure watchdog: one protocol between the processes (heartbeats, reports, who is gone, the end of a run)
  that a reader follows in one class, 460 and 300;
* ``docs/architecture.md`` names every package and every module in a package;
* no module writes a stage runtime's fields: its counters change through ``RuntimeState``'s methods.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_paci"
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(module: str, *, module_level_only: bool = False) -> set[str]:
    """Every name ``module`` imports (absolute, as written or resolved from a relative import)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            found.add(stem)
            # `from lightning_paci.x import y` may import the submodule y
            found.update(f"{stem}.{alias.name}" for alias in node.names if f"{stem}.{alias.name}" in MODULES)
    return found


def _internal(names: set[str], *, parents: bool = True) -> set[str]:
    """The package's modules behind ``names``; with ``parents``, also the subpackages whose ``__init__`` each import
    runs. The root ``lightning_paci/__init__.py`` is left out: it is the public face, which registers the strategy
    and so imports Lightning by design, and the rule is about what the engine's own modules import."""
    out: set[str] = set()
    for name in names:
        parts = name.split(".")
        for i in range(2 if parents else len(parts), len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in MODULES:
                out.add(prefix)
    return out


def _reaches_lightning(start: str) -> list[str] | None:
    """The chain of package modules from ``start`` to one importing Lightning, or None."""
    seen, stack = {start}, [[start]]
    while stack:
        chain = stack.pop()
        names = _imports(chain[-1])
        if any(n.split(".")[0] in LIGHTNING for n in names):
            return chain
        for nxt in sorted(_internal(names) - seen):
            seen.add(nxt)
            stack.append([*chain, nxt])
    return None


ENGINE = sorted(m for m in MODULES if m == "lightning_paci.engine" or m.startswith("lightning_paci.engine."))


def test_the_engine_exists_with_its_parts():
    for part in ("runtime", "comm", "program", "reference", "driver", "cursor", "records", "microbatch"):
        assert f"lightning_paci.engine.{part}" in MODULES


@pytest.mark.parametrize("module", ENGINE)
def test_no_engine_module_imports_lightning_directly_or_through_another(module):
    chain = _reaches_lightning(module)
    assert chain is None, "engine module reaches Lightning: " + " -> ".join(chain or [])


def test_the_walk_finds_lightning_where_it_is_imported():
    # the check above must be able to fail: the integration imports Lightning through its own modules
    assert _reaches_lightning("lightning_paci.integration.reference_pipeline") is not None
    assert _reaches_lightning("lightning_paci.strategy") is not None


def test_importing_the_whole_engine_loads_no_lightning():
    # a bare package object skips lightning_paci/__init__.py (which registers the strategy and so loads Lightning)
    code = (
        "import importlib, sys, types\n"
        "pkg = types.ModuleType('lightning_paci')\n"
        f"pkg.__path__ = [{str(PACKAGE)!r}]\n"
        "sys.modules['lightning_paci'] = pkg\n"
        f"for name in {ENGINE!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_no_import_cycle_among_module_level_imports():
    graph = {m: _internal(_imports(m, module_level_only=True), parents=False) - {m} for m in MODULES}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(graph[module]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(nxt):], nxt]))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[module] = 2

    for module in MODULES:
        if module not in state:
            visit(module, [module])


def test_at_most_eight_modules_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top


_LARGER = {"lightning_paci.strategy": (600, 500), "lightning_paci.engine.supervision": (460, 300)}  # (module, class)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_and_classes_stay_small(module):
    source = MODULES[module].read_text()
    module_limit, class_limit = _LARGER.get(module, (400, 250))
    assert len(source.splitlines()) <= module_limit, f"{module}: {len(source.splitlines())} lines"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            assert length <= class_limit, f"{module}.{node.name}: {length} lines"


def test_the_strategy_is_one_class_over_lightnings_parallel_strategy():
    tree = ast.parse(MODULES["lightning_paci.strategy"].read_text())
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    assert [(c.name, [ast.unparse(b) for b in c.bases]) for c in classes] == [("PACIStrategy", ["ParallelStrategy"])]


def _sections(page: str) -> dict[str, str]:
    """``### `engine/` ...`` headings -> their text, keyed by the folder the heading names."""
    sections: dict[str, str] = {}
    for chunk in page.split("\n### `")[1:]:
        folder, _, body = chunk.partition("`")
        sections[folder] = body.split("\n## ")[0]
    return sections


def test_architecture_page_names_every_package_and_module():
    sections = _sections((ROOT / "docs" / "architecture.md").read_text())
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        folder = "lightning_paci/" if relative.parent == Path(".") else f"{relative.parent.as_posix()}/"
        assert folder in sections, f"docs/architecture.md has no section for {folder}"
        if relative.name != "__init__.py" or folder == "lightning_paci/":
            assert f"`{relative.name}`" in sections[folder], f"docs/architecture.md: {folder} does not name {relative}"


def test_architecture_page_names_no_module_that_is_gone():
    sections = _sections((ROOT / "docs" / "architecture.md").read_text())
    for folder, body in sections.items():
        base = PACKAGE if folder == "lightning_paci/" else PACKAGE / folder
        assert base.is_dir(), f"docs/architecture.md names a package that does not exist: {folder}"
        for name in re.findall(r"`(\w+\.py)`", body):
            assert (base / name).is_file(), f"docs/architecture.md: {folder} names {name}, which it does not hold"


_RUNTIME_OWNERS = {"lightning_paci.engine.runtime", "lightning_paci.engine.runtime_state"}
_A_RUNTIME = re.compile(r"(^|\.)runtimes?(\[.*\])?$|^group\[.*\]$")


def _runtime_writes(tree: ast.AST) -> list[str]:
    """Assignments to an attribute of something named ``runtime`` (``runtime.x = ``, ``self.runtime.x += ``,
    ``runtimes[s].x = ``) and appends to its hook list, as source text."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple)
                                                                else [target])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                ast.unparse(node.func).endswith(".update_hooks.append"):
            found.append(ast.unparse(node))
        found += [ast.unparse(t) for t in targets
                  if isinstance(t, ast.Attribute) and _A_RUNTIME.search(ast.unparse(t.value))]
    return found


def test_no_module_writes_a_stage_runtimes_fields():
    writes = {name: _runtime_writes(ast.parse(path.read_text())) for name, path in MODULES.items()
              if name not in _RUNTIME_OWNERS}
    assert {name: w for name, w in writes.items() if w} == {}


def test_the_runtime_write_check_finds_a_write():
    assert _runtime_writes(ast.parse("runtime.loss_scale = 2.0\nself.runtime.version += 1\n"
                                     "a, runtimes[0].crossings = 1, f\nrt = runtime.version\n")) == [
        "runtime.loss_scale", "self.runtime.version", "runtimes[0].crossings"]


def test_every_user_facing_error_is_defined_in_errors_py_and_exported():
    import lightning_paci
    from lightning_paci import errors

    defined_elsewhere = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Failure")) and \
                    name != "lightning_paci.errors":
                defined_elsewhere.append(f"{name}.{node.name}")
    assert defined_elsewhere == []
    classes = [n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, Exception)]
    assert len(classes) >= 12 and set(classes) <= set(lightning_paci.__all__)
    assert all(getattr(lightning_paci, n) is getattr(errors, n) for n in classes)


def test_the_old_verbs_still_resolve_with_a_deprecation_warning():
    import lightning_paci

    with pytest.warns(DeprecationWarning, match=r"`lightning_paci.build` is `lightning_paci.build_schedule`"):
        assert lightning_paci.build is lightning_paci.build_schedule
    assert "build" not in lightning_paci.__all__ and "validate_schedule" in lightning_paci.__all__
