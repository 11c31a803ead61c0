"""tests/hostile/test_hostile_typed.py's process: every typed value a checkpoint may hold,
with hostile class names and fields, through every loader, under an audit hook.

``python typed_walk.py WORK OUT.json [--deepspeed]`` builds, in WORK, a checkpoint of
DeepSpeed's engine (with ``--deepspeed``: every row of its typed-value table), a plain
one holding Python values, and a Megatron one holding a ShardedObject. Every loader runs
once on each, unchanged (their lazy imports happen then). Then an audit hook
(:func:`sys.addaudithook`) records what the process does, and each crafted case (a copy
of a checkpoint with one stored value replaced, the index resealed) is read by every
loader: the DeepSpeed engine's ``load``, :func:`distckpt.load`, the DCP reader (its
metadata, then ``dcp.load``), the Megatron load strategy, and the CLI's ``inspect``,
``verify``, ``export`` and ``diff``.

Recorded for each case and loader: the outcome (``ok`` or the exception's type), and as
violations: an exception that is not a :class:`distckpt.CheckpointError`; a returned
object of a type that is neither plain data, a tensor nor a row of the table; and any
audited event of importing a module, starting a process, executing code, looking up a
pickled global, opening a file outside WORK or connecting a socket. Written to OUT.json.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

import distckpt
from distckpt.cli import main as cli
from distckpt.comm import SingleComm
from distckpt.testing.hostile import Crafted

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from tests.support import audit  # noqa: E402
from tests.support.hostile_typed import (  # noqa: E402
    HOSTILE_TAGS,
    ROW_CASES,
    Evil,
    allowed_types,
    deepspeed_save,
    foreign,
    megatron_archive,
    megatron_objects,
    megatron_save,
    payloads,
    pickled,
    replace_first_typed,
    replace_object,
    typed,
)

WORK = Path(sys.argv[1]).resolve()
OUT = Path(sys.argv[2])
DEEPSPEED = "--deepspeed" in sys.argv[3:]
TAG = "__distckpt_type__"
MARKER = WORK / "ran"  # what a command smuggled in would create
PAYLOADS = payloads(MARKER)

# -------------------------------------------------------------- hostile typed values


def cases() -> list[tuple[str, str, Any]]:
    """(name, checkpoint, replacement of its first typed value, or of its value ``v``)."""
    out: list[tuple[str, str, Any]] = []
    for tag in HOSTILE_TAGS:
        for form, payload in PAYLOADS.items():
            out.append((f"{tag or '<empty>'} {form}", "ds", typed(tag, form, payload)))
    for tag, form, payload in ROW_CASES:
        out.append((f"{tag} {form} {payload!r:.40}", "ds", typed(tag, form, payload)))
    out.append(("tag not a string", "ds", {"map": {TAG: 7, "value": 1}}))
    evil = pickled(Evil(MARKER))
    out.append(("pickled value", "plain", evil))
    out.append(("pickled value in a tuple", "plain", {"tuple": [1, evil]}))
    out.append(("pickled object", "megatron", "pickle"))
    out.append(("compressed archive", "megatron", "deflated"))
    return [c for c in out if DEEPSPEED or c[1] != "ds"]


# ------------------------------------------------------------------------ checkpoints


def build() -> dict[str, Path]:
    made = {"plain": WORK / "plain" / "ck", "megatron": WORK / "megatron"}
    distckpt.save(
        {"w": torch.arange(6.0), "v": {"lr": 0.1, "betas": (0.9, 0.99)}, "step": 3},
        made["plain"],
    )
    megatron_save(made["megatron"], {"tp": 1, "rng": torch.arange(4)})
    if DEEPSPEED:
        made["ds"] = deepspeed_save(WORK / "ds")
    return made


def craft(kind: str, source: Path, at: Path, replacement: Any) -> Path:
    shutil.copytree(source.parent if kind == "plain" else source, at)
    target = at / "ck" if kind == "plain" else at
    if kind == "megatron":
        replace_object(target, megatron_archive(replacement, MARKER))
        return target

    def edit(variables: dict[str, Any]) -> None:
        if kind == "plain":
            variables["v"]["value"] = replacement
        else:
            replace_first_typed(variables, replacement)

    Crafted(target).edit_index(edit)
    return target


# ----------------------------------------------------------------------- the loaders


def loaders(kind: str, root: Path) -> dict[str, Callable[[], Any]]:
    """Every loader of the checkpoint of ``kind`` at ``root`` (Megatron's: its directory)."""
    from distckpt.integrations.dcp import DistckptReader

    path = root / "distckpt" if kind == "megatron" else root

    def dcp_metadata() -> Any:
        meta = DistckptReader(path).read_metadata()
        return list(meta.state_dict_metadata)

    def dcp_load() -> Any:
        import torch.distributed.checkpoint as dcp

        state: dict[str, Any] = {}
        if kind == "plain":
            state = {"w": torch.zeros(6), "v": {"lr": 0.0, "betas": (0.0, 0.0)}, "step": 0}
        dcp.load(state, storage_reader=DistckptReader(path), no_dist=True)
        return state

    def plain_load() -> Any:
        values = {v.name: None for v in distckpt.list_variables(path) if v.shape is None}
        distckpt.load(values, path, strict=False)
        return values

    def run_cli(*args: str) -> Callable[[], Any]:
        def run() -> Any:
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = cli([*args])
            if rc not in (0, 1, 2):
                raise AssertionError(f"exit code {rc}")
            return None

        return run

    found: dict[str, Callable[[], Any]] = {}
    found["distckpt.load"] = plain_load
    found["dcp metadata"] = dcp_metadata
    found["dcp.load"] = dcp_load
    found["inspect"] = run_cli("inspect", str(path))
    found["verify"] = run_cli("verify", str(path))
    found["export"] = run_cli("export", str(path), f"{root}.pt", "--overwrite")
    found["diff"] = run_cli("diff", str(path), str(path))
    if kind == "ds":
        from distckpt.integrations.deepspeed import DistckptCheckpointEngine

        found["deepspeed"] = lambda: DistckptCheckpointEngine().load(str(path / "model.pt"))
    if kind == "megatron":
        from distckpt.integrations.megatron import DistckptLoadStrategy

        found["megatron"] = lambda: DistckptLoadStrategy(comm=SingleComm()).load(
            megatron_objects(), root
        )
    return found


# ---------------------------------------------------------------------- the auditing


def run_case(kind: str, path: Path, watch: bool = True) -> list[dict[str, Any]]:
    records = []
    allowed = allowed_types()
    for name, load in loaders(kind, path).items():
        violations: list[str] = []
        failure: BaseException | None = None
        with audit.watching(WORK, new_imports=True) if watch else nullcontext([]) as events:
            try:
                got = load()
            except (Exception, CheckpointException) as exc:
                failure = exc
        if failure is None:
            outcome = "ok"
            wrong = foreign(got, allowed)
            if wrong is not None:
                violations.append(f"built a {wrong}")
        else:
            outcome = f"{type(failure).__name__}: {str(failure)[:160]}"
            wrapped = name == "dcp.load" and _dcp_wrapped(failure)
            if not isinstance(failure, distckpt.CheckpointError) and not wrapped:
                trace = "".join(traceback.format_exception(failure))[-800:]
                violations.append("not a CheckpointError: " + trace)
        violations += events
        if MARKER.exists():
            violations.append("a command ran")
        records.append({"loader": name, "outcome": outcome, "violations": violations})
    return records


def _dcp_wrapped(exc: BaseException) -> bool:
    """DCP re-raises a storage reader's error as its own (a CheckpointException, which
    derives from BaseException, or an AssertionError quoting it): distckpt's error is then
    the cause it carries."""
    text = str(exc)
    return "CheckpointError" in text or "UnsupportedValueError" in text or "Corrupt" in text


def main() -> None:
    base = build()
    # Every loader once, untouched: the lazy imports of each happen now, not under audit.
    warm = [r for kind, path in base.items() for r in run_case(kind, path, watch=False)]
    results: list[dict[str, Any]] = [{"case": "pristine", "kind": "", "records": warm}]
    for k, (name, kind, replacement) in enumerate(cases()):
        at = WORK / f"case{k}"
        path = craft(kind, base[kind], at, replacement)
        results.append({"case": name, "kind": kind, "records": run_case(kind, path)})
    OUT.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
