"""The jobs the tests launch print whole lines: the ranks of a job share one pipe, and a
test reads their lines (``OK <rank>``, ``CASE {...}``) from it. Each process's stdout is
line buffered and not written through (tests/support/whole_lines), so each line is one
write, even under torchrun, which runs its workers with ``python -u``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.launch_util import check, run_mpi, run_torchrun

LINES = 500
SCRIPT = f"""
import os, sys
print("STDOUT", sys.stdout.line_buffering, sys.stdout.write_through)
rank = os.environ.get("RANK") or os.environ.get("PMI_RANK")
for i in range({LINES}):
    print(f"LINE {{rank}} {{i}}")
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("launcher", ["torchrun", "mpiexec"])
def test_two_ranks_print_whole_lines(launcher: str, tmp_path: Path) -> None:
    script = tmp_path / "lines.py"
    script.write_text(SCRIPT)
    run = run_torchrun if launcher == "torchrun" else run_mpi
    proc = run(2, script, timeout=150)
    check(proc)
    assert proc.stdout.count("STDOUT True False\n") == 2, proc.stdout[:2000]
    lines = sorted(line for line in proc.stdout.splitlines() if not line.startswith("STDOUT"))
    assert lines == sorted(f"LINE {r} {i}" for r in range(2) for i in range(LINES))
