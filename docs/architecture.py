"""The layers of lightning_paci, and the picture of them in docs/architecture.md, drawn from the code.

``LAYERS`` is the rule: the package's folders and top-level modules from the top down, a row per floor; a module
imports (at module level) only from its own folder or from a floor below its own. ``tests/test_layout.py`` checks
the rule against every import statement and the picture against :func:`render`, so neither can drift.

    python docs/architecture.py            # rewrite the picture in docs/architecture.md
    python docs/architecture.py --check    # exit 1 if it is not current
"""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_paci"
PAGE = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- layers: drawn by docs/architecture.py -->", "<!-- layers: end -->"

# floors from the top down; units on one floor do not import each other
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__init__.py",),
    ("checkpoint.py", "plan.py", "simulate.py"),
    ("strategy.py",),
    ("callbacks/",),
    ("integration/", "integration/setup/"),
    ("integration/stage/",),
    ("integration/processes/",),
    ("integration/checkpoints/",),
    ("integration/lightning_callbacks/",),
    ("integration/trainer/",),
    ("config.py",),
    ("planner/",),
    ("partition/",),
    ("engine/", "engine/streams/", "engine/blocks/"),
    ("engine/runtime/",),
    ("engine/replicas/",),
    ("engine/transport/",),
    ("engine/supervision/",),
    ("optim/",),
    ("simulation/",),
    ("schedules/",),
    ("errors.py",),
)
FLOOR = {unit: len(LAYERS) - i for i, row in enumerate(LAYERS) for unit in row}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def unit_of(module: str) -> str:
    """The unit of ``LAYERS`` a module belongs to: its folder (``engine/runtime/``), or itself at the top level."""
    path = MODULES[module].relative_to(PACKAGE)
    if path.parent == Path("."):
        return path.name
    return path.parent.as_posix() + "/"


def module_imports(module: str) -> set[str]:
    """The package's modules ``module`` imports at module level (``if TYPE_CHECKING:`` blocks are not run)."""
    found: set[str] = set()
    for node in ast.parse(MODULES[module].read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.update(m for m in [node.module, *(f"{node.module}.{a.name}" for a in node.names)] if m in MODULES)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
    return found


def unit_imports() -> dict[str, set[str]]:
    """Each unit's imports of other units."""
    out: dict[str, set[str]] = {unit: set() for row in LAYERS for unit in row}
    for module in MODULES:
        unit = unit_of(module)
        out.setdefault(unit, set()).update(unit_of(m) for m in module_imports(module) if unit_of(m) != unit)
    return out


def _summary(unit: str) -> str:
    path = PACKAGE / unit / "__init__.py" if unit.endswith("/") else PACKAGE / unit
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = doc.split("\n\n")[0].replace("\n", " ")
    return first.split(": ")[0] if len(first) > 70 else first


def render() -> str:
    """The floors, each unit with its number of modules and what it imports, top down."""
    imports = unit_imports()
    lines = ["```text"]
    for i, row in enumerate(LAYERS):
        for unit in row:
            count = sum(1 for m in MODULES if unit_of(m) == unit and MODULES[m].name != "__init__.py")
            size = f"{count} modules" if unit.endswith("/") else "module"
            below = ", ".join(sorted(imports[unit], key=lambda u: (-FLOOR[u], u))) or "-"
            lines += textwrap.wrap(f"{unit:<34} {size:<11} imports: {below}", 118, subsequent_indent=" " * 56)
        if i < len(LAYERS) - 1:
            lines.append("    |")
    return "\n".join(lines + ["```"])


def page_with_picture(page: str) -> str:
    before, _, rest = page.partition(BEGIN)
    _, _, after = rest.partition(END)
    return f"{before}{BEGIN}\n{render()}\n{END}{after}"


if __name__ == "__main__":
    current = PAGE.read_text()
    wanted = page_with_picture(current)
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if current == wanted else "docs/architecture.md's picture is not current: run "
                                              "`python docs/architecture.py`")
    PAGE.write_text(wanted)
