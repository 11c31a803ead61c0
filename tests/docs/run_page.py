"""Run one page's code blocks in order, as a reader would: ``python run_page.py BLOCKS``,
in the page's directory, where ``BLOCKS`` is the JSON list that ``test_examples`` wrote
(see :mod:`tests.docs.blocks`). Python blocks share one interpreter's globals; the others
run as their own processes. The first failure names its block (page and line) and ends
the run with status 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

#: A block that runs as its own process gets this long.
TIMEOUT = float(os.environ.get("DOCS_BLOCK_TIMEOUT", "240"))


def launch(block: dict, script: str) -> list[str]:
    path = Path(f"block_{block['line']}.py")
    path.write_text(script)
    if block["kind"] == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={block['arg']}",
            str(path),
        ]
    if block["kind"] == "mpiexec":
        mpiexec = Path(sys.executable).with_name("mpiexec")
        rank = [sys.executable, str(path)]
        if os.environ.get("TESTS_WARM_RANKS_SOCKET"):  # each rank forked warm (run_warm)
            from tests.support.launch_util import WARM_PROXY

            rank.insert(1, str(WARM_PROXY))
        return [str(mpiexec), "-n", block["arg"], *rank]
    return [sys.executable, str(path)]


def run_warm(block: dict, argv: list[str]) -> bool:
    """Under the test suite (``$TESTS_WARM_RANKS_SOCKET`` set), run a block's ranks, or
    its one process, forked from the suite's warm interpreter, as its other jobs are
    (``tests/support/warm_ranks.py``: a torchrun rank gets torchrun's environment, an
    mpiexec rank is mpiexec's); False when the block is not run here."""
    if not os.environ.get("TESTS_WARM_RANKS_SOCKET") or block["kind"] in ("bash", "mpiexec"):
        return False  # a bash block runs as written; mpiexec's ranks are proxied (launch)
    from tests.support.warm_ranks import run_ranks

    script = argv[-1]
    nprocs = int(block["arg"]) if block["kind"] == "torchrun" else 1
    print(f"--- {block['where']}: {' '.join(argv)} (forked warm)", flush=True)
    plain = block["kind"] != "torchrun"
    environ = dict(os.environ)
    try:
        done = run_ranks(
            nprocs, script, timeout=TIMEOUT, plain=plain, cwd=os.getcwd(), environ=environ
        )
    except AssertionError as late:
        raise SystemExit(f"{block['where']}: {late}") from None
    sys.stdout.write(done.stdout)
    sys.stdout.write(done.stderr)
    sys.stdout.flush()
    if done.returncode:
        raise SystemExit(f"{block['where']}: exited with status {done.returncode}")
    return True


def run_process(block: dict, argv: list[str]) -> None:
    if run_warm(block, argv):
        return
    print(f"--- {block['where']}: {' '.join(argv)}", flush=True)
    try:
        done = subprocess.run(argv, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{block['where']}: still running after {TIMEOUT:.0f} s") from None
    if done.returncode:
        raise SystemExit(f"{block['where']}: exited with status {done.returncode}")


def main() -> None:
    blocks = json.loads(Path(sys.argv[1]).read_text())
    scope: dict = {"__name__": "__main__"}
    for block in blocks:
        kind, where = block["kind"], block["where"]
        if kind in ("skip", "output"):
            continue
        if kind == "file":
            target = Path(block["arg"])
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block["code"])
            continue
        if kind == "bash":
            run_process(block, ["bash", "-euo", "pipefail", "-c", block["code"]])
            continue
        if kind == "page":
            print(f"--- {where}", flush=True)
            for code in [*block["setup"], block["code"]]:
                try:
                    exec(compile(code, where, "exec"), scope)
                except BaseException:
                    traceback.print_exc()
                    raise SystemExit(f"{where}: the block raised") from None
            continue
        run_process(block, launch(block, "".join(block["setup"]) + block["code"]))


if __name__ == "__main__":
    main()
