"""README.md stays a true front door: its commands run, its links and the docs' links resolve,
CI uses its set-up as written, and docs/architecture.md has a section for every folder of src/ and a line for every
module in it.

A command is checked as far as it can be without training: every distinct ``python SCRIPT`` or
``python -m MODULE`` in README's bash blocks is run once with ``--help`` (exit 0), one process at a
time, each under its own timeout.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
HELP_TIMEOUT_S = 60  # one --help imports argparse and a little more; generous for a loaded machine

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def bash_lines(text: str) -> list[str]:
    """The commands of the text's bash blocks, continuation lines joined, comments dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip() if not line.lstrip().startswith("#") else ""
            if line:
                lines.append(line)
    return lines


def python_targets(text: str) -> list[tuple[str, ...]]:
    """Distinct ``(script,)`` or ``("-m", module)`` of every ``python ...`` command, in order."""
    targets: dict[tuple[str, ...], None] = {}
    for line in bash_lines(text):
        words = shlex.split(line)
        if not words or words[0] != "python":
            continue
        target = ("-m", words[2]) if words[1] == "-m" else (words[1],)
        targets[target] = None
    return list(targets)


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.slow
def test_readme_commands_run_at_least_as_help():
    targets = python_targets(README.read_text())
    scripts = {t[0] for t in targets if t[0] != "-m"}
    # The guide's front door shows every runner; a parsing slip that finds none must not pass.
    assert {"run_baseline_training.py", "run_parameter_server_training.py", "run_ddp_training.py"} <= scripts, targets
    failures = []
    for target in targets:
        command = [sys.executable, *target, "--help"]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=HELP_TIMEOUT_S)
        if result.returncode != 0 or "usage" not in result.stdout.lower():
            failures.append(f"{' '.join(target)} --help: exit {result.returncode}\n{result.stderr[-1500:]}")
    assert not failures, "\n".join(failures)


def test_every_relative_link_points_at_a_file_and_readme_anchors_exist():
    problems = []
    for page in [README, *DOCS]:
        for target in LINK.findall(re.sub(r"```.*?```", "", page.read_text(), flags=re.S)):
            if re.match(r"[a-z]+:", target):  # https:, file:, mailto:
                continue
            path_part, _, fragment = target.partition("#")
            linked = (page.parent / path_part).resolve() if path_part else page
            if not linked.exists():
                problems.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
                problems.append(f"{page.relative_to(ROOT)}: {target}: no heading with that anchor")
    assert not problems, "\n".join(problems)


def test_ci_runs_the_readme_setup_as_written():
    text = README.read_text()
    section = text[text.index("## Set-up") : text.index("\n## ", text.index("## Set-up") + 1)]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    setup = block.strip().splitlines()
    assert len(setup) == 2, setup
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert [line for line in ci if line in setup] == setup, "each README set-up line, in order, as a line of .ci/run"
    assert not [line for line in ci if "pip install" in line and line not in setup], "CI installs only what README says"
    assert (ROOT / "requirements.txt").read_text().strip().splitlines()[-1].startswith("-e .[")


MODULE_ROW = re.compile(r"^\| (`src/[^|]*?`) \|", re.M)
FOLDER_SECTION = re.compile(r"^### `(src/(?:\w+/)*)`$", re.M)


def module_sections(page: str) -> dict[str, list[str]]:
    """``{folder: the modules its rows name}`` of the page's "## Modules": one ``### `src/folder/``` section per
    folder, a row per module (its first cell may name several files, in code spans)."""
    body = page[page.index("\n## Modules\n") :]
    body = body[: body.index("\n## ", 1)]
    heads = list(FOLDER_SECTION.finditer(body))
    sections: dict[str, list[str]] = {}
    for head, following in zip(heads, heads[1:] + [None]):
        text = body[head.end() : following.start() if following else len(body)]
        cells = MODULE_ROW.findall(text)
        sections.setdefault(head.group(1), []).extend(m for cell in cells for m in re.findall(r"`([^`]+)`", cell))
    return sections


def architecture_problems(page: str, root: Path) -> list[str]:
    """What docs/architecture.md's module sections get wrong about ``root/src``: a module without a row, a row
    naming no file or a file outside its section's folder, a package folder without its section."""
    src = root / "src"
    modules = {p.relative_to(root).as_posix() for p in src.rglob("*.py") if "_pb2" not in p.name}
    folders = {p.parent.relative_to(root).as_posix() + "/" for p in src.rglob("*.py")}
    sections = module_sections(page)
    named = {m for rows in sections.values() for m in rows}
    problems = [f"no section for folder {f}" for f in sorted(folders - set(sections))]
    problems += [f"a section for {f}, which holds no module" for f in sorted(set(sections) - folders)]
    problems += [f"no row for {m}" for m in sorted(modules - named)]
    for folder, rows in sections.items():
        for m in rows:
            if not (root / m).is_file():
                problems.append(f"a row for {m}, which does not exist")
            elif m.rpartition("/")[0] + "/" != folder:
                problems.append(f"{m} is listed under {folder}")
    duplicated = sorted({m for m in named if sum(rows.count(m) for rows in sections.values()) > 1})
    problems += [f"more than one row for {m}" for m in duplicated]
    return problems


def test_architecture_page_names_every_module_in_src():
    page = (ROOT / "docs" / "architecture.md").read_text()
    sections = module_sections(page)
    assert len(sections) > 10 and sum(map(len, sections.values())) > 100, sections
    problems = architecture_problems(page, ROOT)
    assert not problems, "docs/architecture.md:\n" + "\n".join(problems)
    assert "src/parameter_server_pb2.py" in sections["src/"]  # the generated stubs, one line together


def test_the_architecture_check_finds_a_missing_row_a_stale_row_and_a_missing_section(tmp_path):
    for name in ("src/__init__.py", "src/config.py", "src/ps/__init__.py", "src/ps/engine.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    rows = "| module | what |\n|---|---|\n"
    page = (
        f"# Page\n\n## Modules\n\n### `src/`\n\n{rows}| `src/__init__.py` | x |\n| `src/config.py` | x |\n\n"
        f"### `src/ps/`\n\n{rows}| `src/ps/__init__.py` | x |\n| `src/ps/engine.py` | x |\n\n## Next\n"
    )
    assert architecture_problems(page, tmp_path) == []
    missing_row = page.replace("| `src/ps/engine.py` | x |\n", "")
    assert architecture_problems(missing_row, tmp_path) == ["no row for src/ps/engine.py"]
    assert architecture_problems(page.replace("ps/engine.py", "ps/ps_core.py"), tmp_path) == [
        "no row for src/ps/engine.py",
        "a row for src/ps/ps_core.py, which does not exist",
    ]
    assert architecture_problems(page.replace("### `src/ps/`\n", ""), tmp_path) == [
        "no section for folder src/ps/",
        "src/ps/__init__.py is listed under src/",
        "src/ps/engine.py is listed under src/",
    ]


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "```bash\npython a.py --x 1 \\\n    --y 2   # note\npython -m pkg.mod --z\n"
            "torchrun b.py\npython a.py\n```\n",
            [("a.py",), ("-m", "pkg.mod")],
        ),
    ],
)
def test_python_targets_are_deduplicated_and_continuations_joined(text, expected):
    assert python_targets(text) == expected
