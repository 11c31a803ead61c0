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
        return [str(mpiexec), "-n", block["arg"], sys.executable, str(path)]
    return [sys.executable, str(path)]


def run_process(block: dict, argv: list[str]) -> None:
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
