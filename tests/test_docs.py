"""The documentation stays what the README promises: a short front page linking every guide page, an option
reference generated from ``PACIConfig`` (current), and no history of the project's own making in the text."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_the_readme_is_short_and_links_every_guide_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert len([p for p in pages if p != "architecture.md"]) >= 5
    for page in pages:
        assert f"(docs/{page})" in readme, f"README.md does not link docs/{page}"


def test_the_option_reference_is_generated_and_current() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("paci_options_page", DOCS / "options.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    page = (DOCS / "options.md").read_text()
    assert page == generator.render(), "docs/options.md is not current: run `python docs/options.py`"
    from lightning_paci.config import PACIConfig

    assert all(f"| `{name}` |" in page for name in PACIConfig.__dataclass_fields__)
    import inspect

    from lightning_paci import PACIStrategy

    arguments = set(inspect.signature(PACIStrategy.__init__).parameters) - {"self"}
    assert sorted(a for a in arguments if f"| `{a}` |" not in page) == []  # every argument of the strategy


_PATH = re.compile(r"(?<![\w/.])((?:lightning_paci|benchmarks|examples|tests|docs)/[\w/.-]*[\w-]\.(?:py|md|png|json))")


def test_every_repository_path_the_docs_name_exists() -> None:
    pages = [ROOT / "README.md", *DOCS.glob("*.md"), ROOT / "benchmarks" / "RESULTS.md"]
    missing = []
    for page in pages:
        for path in _PATH.findall(page.read_text()):
            if not (ROOT / path).exists() and not (page.parent / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert missing == []


def _text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    files = [ROOT / name for name in listed if name.endswith((".py", ".md", ".toml", ".txt", ".cfg"))]
    return files or [*ROOT.glob("**/*.py"), *ROOT.glob("**/*.md")]


def test_no_numbered_work_periods_and_issue_numbers_only_in_the_changelog() -> None:
    period = re.compile(r"\b(session|work period|stop)s? \d+", re.IGNORECASE)
    issue = re.compile(r"\bissues? \d+", re.IGNORECASE)
    found = []
    for path in _text_files():
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            if period.search(line) or (path.name != "CHANGELOG.md" and issue.search(line)):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "\n".join(found[:40]) + (f"\n... {len(found) - 40} more" if len(found) > 40 else "")


def test_ci_runs_the_readmes_two_set_up_commands() -> None:
    # .ci/run installs as the README says and runs its test command (tests, linter, type checker), nothing else
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    ci = [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]
    block = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    readme = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    assert ci[0] == readme[0].replace("pip install", "python3 -m pip install")
    assert ci[1] == readme[1] == "python3 -m pytest -n 3 --dist worksteal && python3 -m ruff check . && python3 -m mypy"


def test_every_test_the_pages_name_exists_and_runs_here() -> None:
    """Every ``test_file.py::test`` README.md and docs/ cite exists, is not marked skip, and does not skip for a
    package this environment (the test extra) lacks: a cited test must run in CI."""
    import importlib.util

    named = set()
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        named |= set(re.findall(r"(test_\w+\.py)(?:::(\w+))?", page.read_text()))
    assert len(named) >= 40
    problems = []
    for file, test in sorted(named):
        path = ROOT / "tests" / file
        if not path.exists():
            problems.append(f"{file}: no such file")
            continue
        if not test:
            continue
        source = path.read_text()
        found = re.search(rf"((?:^@.*\n)*)^def {test}\(.*?(?=^\S|\Z)", source, re.M | re.S)
        if found is None:
            problems.append(f"{file}::{test}: no such test")
            continue
        if "mark.skip" in found.group(1):
            problems.append(f"{file}::{test}: marked skip")
        for package in re.findall(r"importorskip\([\"']([\w.]+)", found.group(0)):
            if importlib.util.find_spec(package.split(".")[0]) is None:
                problems.append(f"{file}::{test}: skips without {package}")
    assert problems == []


# A measured figure in prose: a speed ratio (1.78x), an efficiency (0.914) or a change in percent (+0.04%).
_FIGURE = re.compile(r"(?<![\w.])([+-]?\d+\.\d+%|0\.\d{3}(?![\d%x])|\d+\.\d+ ?x(?!\w))")
# figures the pages derive rather than measure, with the derivation
_DERIVED = {
    "1.88x": "PACI's limit over a flushed 1F1B, (m + N - 1) / m at N = m = 8",
    "1.3x": "recomputation's compute, (F + B + F) / (F + B) with B = 2F",
}


def test_every_figure_the_docs_state_is_in_the_results_or_a_dated_report() -> None:
    # RESULTS.md holds the current figures, benchmarks/reports/ the dated runs behind them; a page that states a
    # figure neither holds has copied it wrong or kept one that is gone. Code blocks and inline code are output
    # samples and arguments, not claims.
    sources = [ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "benchmarks" / "reports").glob("*.md"))]
    known = " ".join(p.read_text() for p in sources).replace(" x", "x")
    stated = 0
    unknown = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        prose = re.sub(r"```.*?```", lambda block: "\n" * block[0].count("\n"), page.read_text(), flags=re.S)
        for number, line in enumerate(prose.splitlines(), start=1):
            for figure in _FIGURE.findall(re.sub(r"`[^`]*`", "", line)):
                figure = figure.replace(" ", "")
                stated += 1
                if figure not in _DERIVED and figure not in known:
                    unknown.append(f"{page.relative_to(ROOT)}:{number}: {figure}")
    assert stated >= 100
    assert unknown == []


def test_the_lines_the_package_says_at_info_reach_the_console() -> None:
    """big-models.md, tuning.md and the fine-tuning example promise lines said at INFO (the meta-device build, the
    weights' key prefix, the plan's prediction): with no logging configured they reach stderr, as Lightning's own
    lines do; DEBUG stays quiet."""
    import os
    import sys

    code = ("import logging, lightning_paci\n"
            "logging.getLogger('lightning_paci.integration.setup.stage_build').info('lightning_paci: said at INFO')\n"
            "logging.getLogger('lightning_paci.integration.setup.stage_build').debug('lightning_paci: DEBUG')\n")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                         env=dict(os.environ, PYTHONPATH=str(root)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "lightning_paci: said at INFO" in out.stderr and "DEBUG" not in out.stderr


def test_the_virtual_stage_page_shows_the_lists_as_built() -> None:
    """docs/virtual-stages.md's schedule block: its commented results are what the lines return."""
    from lightning_paci import build_schedule, simulate_schedule

    page = (DOCS / "virtual-stages.md").read_text()
    schedule = build_schedule("interleaved", 4, 8, 8, 4, virtual_stages=2)
    assert "schedule.num_stages, schedule.num_devices                               # (8, 4)" in page
    assert (schedule.num_stages, schedule.num_devices) == (8, 4)
    shown = re.search(r'compute_only=True\)\s+# "([^"]+)"', page)
    assert shown is not None
    text = schedule.stage_text(0, compute_only=True)
    position = 0
    for part in shown.group(1).split(" ... "):  # each shown run of actions appears, in this order
        part = part.removesuffix(" ...")
        found = text.find(part, position)
        assert found >= 0, (part, text[position:position + 200])
        position = found + len(part)
    bubble = re.search(r"steady_bubble_fraction\s+# ([0-9.]+)", page)
    assert bubble is not None
    assert round(simulate_schedule(schedule).stages[0].steady_bubble_fraction, 3) == float(bubble.group(1))


def _command_outputs() -> list[tuple[str, str, str]]:
    """Every ```bash block of one ``python -m lightning_paci...`` command followed at once by a ```text block: (page,
    command, shown output)."""
    found = []
    for page in sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]:
        for match in re.finditer(r"```bash\n(python -m lightning_paci\.[^\n]+)\n```\n\n```text\n(.*?)```",
                                 page.read_text(), re.S):
            found.append((page.name, match.group(1), match.group(2)))
    return found


def test_every_shown_output_of_a_package_command_is_what_the_command_prints() -> None:
    """The output blocks that follow a ``python -m lightning_paci.<tool>`` command: each shown line (``...`` elides
    lines) is a line the command prints now, in order."""
    import os
    import shlex
    import sys

    blocks = _command_outputs()
    assert any(command.startswith("python -m lightning_paci.simulate") for _, command, _ in blocks)
    for page, command, shown in blocks:
        out = subprocess.run([sys.executable, *shlex.split(command)[1:]], capture_output=True, text=True,
                             timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert out.returncode == 0, (page, command, out.stderr[-2000:])
        printed = out.stdout.splitlines()
        position = 0
        for line in shown.splitlines():
            if line.strip() == "...":
                continue
            assert line in printed[position:], (page, command, line)
            position = printed.index(line, position) + 1
