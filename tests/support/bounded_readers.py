"""Every reader of one checkpoint, run in this process with its address space bounded
(as the hostile fuzzer's examples are: :data:`tests.support.hostile_fuzz.MEMORY_BOUND`
beyond what the process holds once torch and distckpt are imported), so that a reader
that allocates for what an index declares rather than what it stores fails here.

``python tests/support/bounded_readers.py CASES.json`` reads a list of cases, each
``{"name", "ck", "other", "run", "out"}``, and for each runs ``distckpt verify CK``,
``inspect CK``, ``ls RUN``, ``diff CK OTHER``, ``export CK OUT``, the DCP reader's
``read_metadata`` of CK and ``distckpt.load`` of every stored name into ``None``
placeholders. It prints one JSON object: by case, by reader, ``{"rc", "out", "err",
"err_lines", "err_with"}`` (the CLI: its exit status, output, and how many error lines
say a few things), ``{"ok": ...}`` (what it returned, in short) or ``{"raised": type,
"message", ...}``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import distckpt  # noqa: E402
from distckpt import cli  # noqa: E402
from tests.support.hostile_fuzz import MEMORY_BOUND  # noqa: E402


def bound_memory() -> None:
    with open("/proc/self/statm") as f:
        held = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (held + MEMORY_BOUND, hard))


def raised(exc: BaseException) -> dict[str, Any]:
    return {
        "raised": type(exc).__name__,
        "message": str(exc)[:2000],
        "checkpoint_error": isinstance(exc, distckpt.CheckpointError),
        "trace": "".join(traceback.format_exception(exc)[-4:])[-2000:],
    }


def command(*argv: str) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(list(argv))
    except BaseException as exc:  # noqa: BLE001 - what escapes the CLI is the finding
        return raised(exc)
    lines = err.getvalue().splitlines()
    return {"rc": rc, "out": out.getvalue()[-4000:], "err": err.getvalue()[-4000:],
            "err_lines": len(lines), "err_with": _words(lines)}  # fmt: skip


def _words(lines: list[str]) -> dict[str, int]:
    """How many of ``lines`` say each of a few things (the output is cut to its end)."""
    said = ("is missing", "the index says", "'w'")
    return {w: sum(w in line for line in lines) for w in said}


def call(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        return {"ok": fn()}
    except BaseException as exc:  # noqa: BLE001
        return raised(exc)


def dcp_metadata(ck: str) -> dict[str, Any]:
    from distckpt.integrations.dcp import DistckptReader

    meta = DistckptReader(ck).read_metadata()
    return {
        key: list(entry.size) if hasattr(entry, "size") else "bytes"
        for key, entry in meta.state_dict_metadata.items()
    }


def load(ck: str) -> dict[str, Any]:
    names = [v.name for v in distckpt.list_variables(ck)]
    state: dict[str, Any] = {name: None for name in names}
    distckpt.load(state, ck, strict=False)
    return {
        name: list(value.shape) if isinstance(value, torch.Tensor) else repr(value)[:60]
        for name, value in state.items()
    }


def readers(ck: str, other: str, run: str, out: str) -> dict[str, Any]:
    return {
        "verify": command("verify", ck),
        "inspect": command("inspect", ck),
        "ls": command("ls", run),
        "diff": command("diff", ck, other),
        "export": command("export", ck, out, "--overwrite"),
        "dcp": call(lambda: dcp_metadata(ck)),
        "load": call(lambda: load(ck)),
    }


def main(argv: list[str]) -> int:
    cases = json.loads(Path(argv[0]).read_text())
    bound_memory()
    found = {}
    for case in cases:
        found[case["name"]] = readers(case["ck"], case["other"], case["run"], case["out"])
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
