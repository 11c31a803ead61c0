"""The README's commands and .ci/run stay in step, and the test files the documents name
exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_commands():
    """The README's two commands (run the example, run the tests) are lines of .ci/run,
    which CI runs on a fresh clone."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    test_command = next(b.strip() for b in blocks if "pytest" in b)
    run_command = next(
        b.strip() for b in blocks if b.startswith("python3 -m venv") and "examples/" in b
    )
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci
    assert run_command in ci
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_readme_example_exists():
    readme = (ROOT / "README.md").read_text()
    for script in re.findall(r"python (examples/\S+\.py)", readme):
        assert (ROOT / script).is_file(), script


#: Where tests are named: the documents, the CI script, and the package metadata.
NAMING = [
    "README.md",
    "benchmarks/README.md",
    ".ci/run",
    "pyproject.toml",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")),
]


def test_named_test_files_exist():
    """Every ``tests/...`` path (or pattern) these files name is there: the layout of
    tests/ and what the documents say of it move together."""
    named = set()
    for doc in NAMING:
        named.update(re.findall(r"tests/[\w/*.-]*\w", (ROOT / doc).read_text()))
    assert len(named) > 20, named
    missing = sorted(path for path in named if not list(ROOT.glob(path)))
    assert not missing, missing


def test_example_checkpoints_are_ignored() -> None:
    """What an example writes when run from the checkout as the README says (its default
    ``--dir``) is ignored by git: a user who tries it leaves no untracked directory."""
    written = set()
    for script in sorted((ROOT / "examples").glob("*.py")):
        written.update(re.findall(r'"--dir",\s*default="(?:\./)?([\w.-]+)"', script.read_text()))
    assert "quickstart_ckpt" in written, written
    for name in sorted(written):
        ignored = subprocess.run(
            ["git", "check-ignore", "--no-index", "-q", f"{name}/ckpt/zarr.json"], cwd=ROOT
        )
        assert ignored.returncode == 0, f"{name}/ is not in .gitignore"
