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

import base64
import contextlib
import io
import json
import os
import pickle
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

WORK = Path(sys.argv[1]).resolve()
OUT = Path(sys.argv[2])
DEEPSPEED = "--deepspeed" in sys.argv[3:]
TAG = "__distckpt_type__"
MARKER = WORK / "ran"  # what a command smuggled in would create

# -------------------------------------------------------------- hostile typed values

#: Class names an attacker writes in a typed value: callables anywhere, callables that a
#: deepspeed module imports, torch classes, a config class that opens a file, dunder paths.
HOSTILE_TAGS = [
    "os:system",
    "subprocess:Popen",
    "builtins:eval",
    "builtins:__import__",
    "importlib:import_module",
    "deepspeed.runtime.engine:subprocess.Popen",
    "deepspeed.runtime.engine:os.system",
    "deepspeed.env_report:subprocess.Popen",
    "deepspeed:comm.torch.build_shm_op",
    "deepspeed.runtime.config:DeepSpeedConfig",
    "deepspeed.utils.tensor_fragment:fragment_address.__init__.__globals__",
    "deepspeed.runtime.fp16.loss_scaler:LossScaler.__class__",
    "torch.nn:Linear",
    "torch:load",
    "torch.Size.__class__",
    "distckpt.values:pickle.loads",
    "no_such_module:Thing",
    "",
]
#: What each form of a typed value may carry: commands, paths, constructor arguments.
PAYLOADS: dict[str, Any] = {
    "value": ["touch", str(MARKER)],
    "enum": "/etc/hostname",
    "fields": {"args": ["touch", str(MARKER)], "shell": False, "in_features": 2},
    "attributes": {"config": "/etc/hostname", "__class__": "x", "cur_scale": 1.0},
}
#: The rows of the table, each with fields an attacker adds or mistypes.
ROW_CASES: list[tuple[str, str, Any]] = [
    ("torch.Size", "value", [2**70]),
    ("torch.Size", "value", "8"),
    ("torch.dtype", "value", "_dynamo"),
    ("torch.dtype", "value", "nn"),
    ("torch.device", "value", "cuda:0 && touch x"),
    ("deepspeed.runtime.zero.config:ZeroStageEnum", "enum", "__class__"),
    ("deepspeed.runtime.zero.config:ZeroStageEnum", "fields", {"value": 1}),
    ("deepspeed.utils.tensor_fragment:fragment_address", "fields", {"numel": 1, "start": "0"}),
    (
        "deepspeed.utils.tensor_fragment:fragment_address",
        "fields",
        {"numel": 1, "start": 0, "__init__": "x"},
    ),
    (
        "deepspeed.runtime.fp16.loss_scaler:LossScaler",
        "attributes",
        {"cur_scale": 1.0, "dynamic": False, "__class__": "subprocess:Popen"},
    ),
    (
        "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",
        "attributes",
        {"cur_scale": 1.0, "dynamic": True, "dtype": {TAG: "os:system", "value": "id"}},
    ),
]


class Evil:
    """Unpickled, it would run a command."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {MARKER}",))


def typed(tag: str, form: str, payload: Any) -> Any:
    """A typed value as distckpt stores a DeepSpeed dict (values' typed JSON)."""
    body = distckpt.values.encode(payload)
    return {"map": {TAG: tag, form: body}}


def cases() -> list[tuple[str, str, Any]]:
    """(name, checkpoint, replacement of its first typed value, or of its value ``v``)."""
    out: list[tuple[str, str, Any]] = []
    for tag in HOSTILE_TAGS:
        for form, payload in PAYLOADS.items():
            out.append((f"{tag or '<empty>'} {form}", "ds", typed(tag, form, payload)))
    for tag, form, payload in ROW_CASES:
        out.append((f"{tag} {form} {payload!r:.40}", "ds", typed(tag, form, payload)))
    out.append(("tag not a string", "ds", {"map": {TAG: 7, "value": 1}}))
    evil = base64.b64encode(pickle.dumps(Evil())).decode()
    out.append(("pickled value", "plain", {"pickle": evil}))
    out.append(("pickled value in a tuple", "plain", {"tuple": [1, {"pickle": evil}]}))
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


def deepspeed_state() -> dict[str, Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return {
        "module": {"w": torch.arange(4.0)},
        "stage": ZeroStageEnum.gradients,
        "shapes": [{"w": torch.Size([4])}],
        "mapping": {"w": fragment_address(numel=4, start=0)},
        "scaler": LossScaler(4.0),
        "dynamic": DynamicLossScaler(2.0**8, 10, 1, 2, False),
        "dtype": torch.float16,
        "device": torch.device("cpu"),
    }


def deepspeed_save(root: Path) -> Path:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    from distckpt.integrations.deepspeed import DistckptCheckpointEngine

    info = CheckpointCommitInfo(tag="t", save_dir=str(root), save_latest=False)
    engine = DistckptCheckpointEngine()
    engine.create(info)
    engine.makedirs(str(root / "t"), exist_ok=True)
    engine.save(deepspeed_state(), str(root / "t" / "model.pt"))
    engine.commit(info)
    return root / "t"


def megatron_objects(data: Any = None) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {"obj": ShardedObject("obj", data, (1,), (0,), replica_id=0)}


def megatron_save(root: Path, data: Any) -> None:
    from distckpt.integrations.megatron import DistckptSaveStrategy

    root.mkdir(parents=True)
    DistckptSaveStrategy(comm=SingleComm()).save(megatron_objects(data), root)


def megatron_archive(kind: str) -> bytes:
    buffer = io.BytesIO()
    torch.save({"rng": Evil()} if kind == "pickle" else {"tp": 1}, buffer)
    if kind == "pickle":
        return buffer.getvalue()
    import zipfile  # the same records, deflated: a record may then declare any size

    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as deflated:
        for record in source.infolist():
            deflated.writestr(record.filename, source.read(record))
    return out.getvalue()


# ------------------------------------------------------------------------- the edits


def first_typed(doc: Any) -> list[Any] | None:
    """The path to the first typed value (a ``map`` with the tag) in a stored value."""
    if isinstance(doc, dict):
        if "map" in doc and isinstance(doc["map"], dict) and TAG in doc["map"]:
            return []
        for k, v in doc.items():
            found = first_typed(v)
            if found is not None:
                return [k, *found]
    if isinstance(doc, list):
        for i, v in enumerate(doc):
            found = first_typed(v)
            if found is not None:
                return [i, *found]
    return None


def craft(kind: str, source: Path, at: Path, replacement: Any) -> Path:
    shutil.copytree(source.parent if kind == "plain" else source, at)
    target = at / "ck" if kind == "plain" else at
    if kind == "megatron":
        raw = megatron_archive(replacement)
        key = megatron_objects()["obj"].unique_key
        payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        distckpt.save(
            {"objects": {key: distckpt.Shard(payload, (len(raw),), (0,))}},
            target / "distckpt",
            overwrite=True,
        )
        return target

    def edit(variables: dict[str, Any]) -> None:
        if kind == "plain":
            variables["v"]["value"] = replacement
            return
        for entry in variables.values():
            value = entry.get("value") if isinstance(entry, dict) else None
            path = first_typed(value)
            if path is None:
                continue
            parent = entry
            keys = ["value", *path]
            for k in keys[:-1]:
                parent = parent[k]
            parent[keys[-1]] = replacement
            return
        raise AssertionError("no typed value to replace")

    Crafted(target).edit_index(edit)
    return target


# ----------------------------------------------------------------------- the loaders

PLAIN = (type(None), bool, int, float, str, bytes, io.BytesIO, torch.Tensor)


def table_types() -> tuple[type, ...]:
    if not DEEPSPEED:
        return (torch.Size, torch.dtype, torch.device)
    from distckpt.integrations.deepspeed.types import table

    return tuple(row.cls for row in table().values())


def foreign(obj: Any, allowed: tuple[type, ...]) -> str | None:
    """The type of the first object in ``obj`` that is neither plain data nor allowed."""
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple, torch.Size):
        for v in obj:
            if (found := foreign(v, allowed)) is not None:
                return found
        return None
    if type(obj) is dict:
        for k, v in obj.items():
            if (found := foreign(k, allowed) or foreign(v, allowed)) is not None:
                return found
        return None
    if type(obj) in PLAIN or isinstance(obj, torch.Tensor) or type(obj) in allowed:
        return None
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


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
    allowed = table_types()
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
