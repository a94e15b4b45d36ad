"""The package's layout rules, read off the source so that they stay true.

* ``lightning_paci/engine/`` imports no Lightning, directly or through another module of the package (walked over
  every import statement, module-level or inside a function), and importing all of it loads no Lightning;
* no import cycle among module-level imports, and every module-level import goes down the floors of ``LAYERS``
  (docs/architecture.py), whose picture in docs/architecture.md is drawn from the code;
* one concept per module and folders a reader takes in at once: at most 8 modules directly in ``lightning_paci/``,
  at most 11 in a folder, and each package's docstring a map naming every module and folder in it; a module may be
  as long as its concept;
* no module reads another module's private names (``obj._x``, ``obj.__dict__["_x"]``, ``import _x``), and no
  module-level function reaches a private member of a class of its own module: a method lives in its class;
* ``strategy.py`` is one class over Lightning's ``ParallelStrategy`` whose hooks delegate in a few statements;
* ``docs/architecture.md`` names every package and every module in a package;
* no module writes a stage runtime's fields: its counters change through ``RuntimeState``'s methods.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

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


@pytest.mark.parametrize("module", ENGINE)
def test_no_engine_module_imports_lightning_directly_or_through_another(module):
    chain = _reaches_lightning(module)
    assert chain is None, "engine module reaches Lightning: " + " -> ".join(chain or [])


def test_the_walk_finds_lightning_where_it_is_imported():
    # the check above must be able to fail: the integration imports Lightning through its own modules
    assert _reaches_lightning("lightning_paci.integration.stage.reference_pipeline") is not None
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


def _layers() -> Any:
    spec = importlib.util.spec_from_file_location("paci_architecture_page", ROOT / "docs" / "architecture.py")
    assert spec is not None and spec.loader is not None
    layers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layers)
    return layers


LAYERS = _layers()


def upward_imports(imports: dict[str, set[str]], floor: dict[str, int]) -> list[str]:
    """Every import of a unit on a floor at or above the importer's own (``LAYERS`` in docs/architecture.py)."""
    return sorted(f"{unit} -> {other}" for unit, others in imports.items() for other in others
                  if floor[other] >= floor[unit])


def test_every_folder_and_top_level_module_has_its_floor():
    units = {LAYERS.unit_of(m) for m in LAYERS.MODULES}
    assert units == set(LAYERS.FLOOR), f"not in LAYERS: {sorted(units - set(LAYERS.FLOOR))}; gone: " \
                                       f"{sorted(set(LAYERS.FLOOR) - units)}"


def test_imports_only_downwards():
    assert upward_imports(LAYERS.unit_imports(), LAYERS.FLOOR) == []


def test_the_downward_rule_finds_an_upward_import():
    floor = {"engine/runtime/": 2, "engine/transport/": 1, "engine/blocks/": 3, "engine/streams/": 3}
    assert upward_imports({"engine/runtime/": {"engine/transport/"}, "engine/transport/": set()}, floor) == []
    assert upward_imports({"engine/transport/": {"engine/runtime/"}, "engine/blocks/": {"engine/streams/"}},
                          floor) == ["engine/blocks/ -> engine/streams/", "engine/transport/ -> engine/runtime/"]


def test_the_architecture_picture_is_drawn_from_the_code():
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert LAYERS.BEGIN in page and LAYERS.END in page
    assert page == LAYERS.page_with_picture(page), "run `python docs/architecture.py`"


def test_folders_stay_small_enough_to_read_as_one_concern():
    assert len(list(PACKAGE.glob("*.py"))) <= 8
    for folder in sorted({p.parent for p in PACKAGE.rglob("*.py")} - {PACKAGE}):
        modules = [p.name for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 11, f"{folder.relative_to(ROOT)}: {len(modules)} modules, {sorted(modules)}"


@pytest.mark.parametrize("init", sorted(PACKAGE.rglob("*/__init__.py")), ids=lambda p: str(p.parent.name))
def test_every_package_map_names_each_of_its_modules_and_folders(init):
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    parts = [p.name for p in init.parent.glob("*.py") if p.name != "__init__.py"]
    parts += [f"{d.name}/" for d in init.parent.iterdir() if (d / "__init__.py").is_file()]
    missing = [name for name in parts if name not in doc and f".{name.removesuffix('.py')}`" not in doc]
    assert missing == [], f"{init.relative_to(ROOT)}'s docstring does not name {missing}"


def defined_privates(tree: ast.AST) -> set[str]:
    """The ``_``-prefixed names a module defines: functions, classes, methods, module and class attributes,
    ``self._x`` fields."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            found.add(node.attr)
    return {name for name in found if name.startswith("_") and not name.startswith("__")}


def private_reads(tree: ast.AST, own: set[str], others: set[str]) -> list[str]:
    """Where a module reaches another module's private names: ``obj._x`` (or ``obj.__dict__["_x"]``) on an
    object other than ``self``/``cls`` for an ``_x`` that another module of the package defines and this one does
    not, and ``from lightning_paci... import _x``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and \
                node.value.attr == "__dict__" and isinstance(node.slice, ast.Constant):
            name, node = str(node.slice.value), node.value  # type: ignore[assignment]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_paci"):
            found += [f"from {node.module} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
            continue
        else:
            continue
        base = ast.unparse(node.value)  # type: ignore[attr-defined]
        if name in others and name not in own and base not in ("self", "cls"):
            found.append(f"line {node.lineno}: {base}.{name}")
    return found


# private names of torch, Lightning and the standard library that a module of the package also defines (an
# override, as a placeholder's `_apply`): reading them on a torch module is not reading the package's
_FOREIGN = {name for owner in (torch.nn.Module, os) for name in dir(owner)}


def test_no_module_reads_another_modules_private_names():
    trees = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}
    privates = {name: defined_privates(tree) for name, tree in trees.items()}
    found = {}
    for name, tree in trees.items():
        others = set().union(*(p for other, p in privates.items() if other != name)) - _FOREIGN
        if reads := private_reads(tree, privates[name], others):
            found[name] = reads
    assert found == {}


def test_the_private_read_check_finds_a_read():
    tree = ast.parse("x = runtime._after_backward\nleaf.__dict__['_shadow']\nself._mine = 1\n"
                     "from lightning_paci.engine import _hidden\n")
    assert sorted(private_reads(tree, own={"_mine"}, others={"_after_backward", "_shadow", "_mine"})) == [
        "from lightning_paci.engine import _hidden", "line 1: runtime._after_backward", "line 2: leaf._shadow"]


def methods_outside_their_class(tree: ast.Module) -> list[str]:
    """Module-level functions that reach a class's private members (its ``_`` methods and ``self._x`` fields,
    defined in the same module) through an object other than ``self``: a method kept outside its class."""
    members: set[str] = set()
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        members |= defined_privates(cls) - {cls.name}
    found = []
    for function in (node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))):
        found += [f"{function.name}: {ast.unparse(node)}" for node in ast.walk(function)
                  if isinstance(node, ast.Attribute) and node.attr in members
                  and ast.unparse(node.value) not in ("self", "cls")]
    return found


def test_no_method_lives_outside_its_class():
    found = {name: m for name, path in MODULES.items()
             if (m := methods_outside_their_class(ast.parse(path.read_text())))}
    assert found == {}


def test_the_outside_method_check_finds_one():
    tree = ast.parse("class Watchdog:\n    def __init__(self):\n        self._heard = None\n\n"
                     "def _has_ended(watchdog):\n    return watchdog._heard is None\n")
    assert methods_outside_their_class(tree) == ["_has_ended: watchdog._heard"]


def test_the_strategy_is_one_class_over_lightnings_parallel_strategy():
    tree = ast.parse(MODULES["lightning_paci.strategy"].read_text())
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    assert [(c.name, [ast.unparse(b) for b in c.bases]) for c in classes] == [("PACIStrategy", ["ParallelStrategy"])]


def test_the_strategys_hooks_delegate():
    """Lightning's interface only: each method a property or a hook of a few statements that hands the work to the
    module owning it (its arguments aside, ``__init__`` builds those owners)."""
    tree = ast.parse(MODULES["lightning_paci.strategy"].read_text())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef))
    long = {}
    for method in cls.body:
        if isinstance(method, ast.FunctionDef) and method.name != "__init__":
            body = [s for s in method.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            statements = sum(1 for s in body for node in ast.walk(s) if isinstance(node, ast.stmt))
            if statements > 8:
                long[method.name] = statements
    assert long == {}


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


_RUNTIME_OWNERS = {"lightning_paci.engine.runtime.runtime", "lightning_paci.engine.runtime.runtime_state"}
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
