"""The README's commands and .ci/run stay in step."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    test_command = next(b.strip() for b in blocks if "pytest" in b)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci


def test_readme_example_exists():
    readme = (ROOT / "README.md").read_text()
    for script in re.findall(r"python (examples/\S+\.py)", readme):
        assert (ROOT / script).is_file(), script
