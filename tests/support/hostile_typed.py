"""Typed values an attacker writes, and the hostile fuzzer's ``typed`` family.

The catalogue (:data:`HOSTILE_TAGS`, :func:`payloads`, :data:`ROW_CASES`, :class:`Evil`)
is what ``tests/scripts/typed_walk.py`` walks through every loader, case by case; the
family draws from it at random: a typed value of a DeepSpeed engine's checkpoint (``ds``,
where DeepSpeed is installed) replaced by one naming a hostile class with hostile fields,
a stored value of ``ck`` replaced by a typed value or a pickle that would run a command,
or a Megatron ``ShardedObject`` (``mg``) replaced by a pickle that would, by an archive
of compressed records, or by garbage. Every reader of the three runs under an audit hook
(:mod:`tests.support.audit`): none may end otherwise than with plain data or a
CheckpointError, import a module the value names, start a process, look up a pickled
global or open a file outside the example.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import os
import pickle
import random
import zipfile
from pathlib import Path
from typing import Any

import torch

import distckpt
from distckpt.comm import SingleComm
from distckpt.testing.hostile import Crafted

TAG = "__distckpt_type__"
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
    "json.tool:main",
    "no_such_module:Thing",
    "",
]
#: The rows of DeepSpeed's table, each with fields an attacker adds or mistypes.
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


def payloads(marker: Path) -> dict[str, Any]:
    """What each form of a typed value may carry: commands, paths, constructor arguments."""
    return {
        "value": ["touch", str(marker)],
        "enum": "/etc/hostname",
        "fields": {"args": ["touch", str(marker)], "shell": False, "in_features": 2},
        "attributes": {"config": "/etc/hostname", "__class__": "x", "cur_scale": 1.0},
    }


class Evil:
    """Unpickled, it would run a command (touch ``marker``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def typed(tag: Any, form: str, payload: Any) -> Any:
    """A typed value as distckpt stores a DeepSpeed dict (values' typed JSON)."""
    return {"map": {TAG: tag, form: distckpt.values.encode(payload)}}


def pickled(obj: Any) -> dict[str, str]:
    """A stored value holding ``obj`` pickled (what ``allow_pickle`` writes)."""
    return {"pickle": base64.b64encode(pickle.dumps(obj)).decode()}


def named_modules(tag: Any) -> set[str]:
    """The modules a tag names (importing one is never right)."""
    if not isinstance(tag, str) or ":" not in tag:
        return set()
    module = tag.partition(":")[0]
    parts = module.split(".")
    return {".".join(parts[: k + 1]) for k in range(len(parts))} - {"deepspeed", "torch"}


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


def replace_first_typed(variables: dict[str, Any], replacement: Any) -> None:
    """Replace the first typed value of any stored value of an index's variables."""
    for entry in variables.values():
        path = first_typed(entry.get("value") if isinstance(entry, dict) else None)
        if path is None:
            continue
        keys = ["value", *path]
        parent = entry
        for k in keys[:-1]:
            parent = parent[k]
        parent[keys[-1]] = replacement
        return
    raise KeyError("no typed value to replace")


# ------------------------------------------------------------------ the checkpoints


def has_deepspeed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


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
    """A DeepSpeed engine's checkpoint holding every row of the table: ``root/t``."""
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


def megatron_archive(kind: str, marker: Path) -> bytes:
    """The bytes of a ShardedObject: a pickle that would run a command, the same records
    deflated (a record may then declare any size), or garbage."""
    if kind == "garbage":
        return random.Random(kind).randbytes(700)
    buffer = io.BytesIO()
    torch.save({"rng": Evil(marker)} if kind == "pickle" else {"tp": 1}, buffer)
    if kind == "pickle":
        return buffer.getvalue()
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as deflated:
        for record in source.infolist():
            deflated.writestr(record.filename, source.read(record))
    return out.getvalue()


def replace_object(root: Path, raw: bytes) -> None:
    """Replace the stored bytes of Megatron's checkpoint's ShardedObject (``root``)."""
    key = megatron_objects()["obj"].unique_key
    payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    distckpt.save(
        {"objects": {key: distckpt.Shard(payload, (len(raw),), (0,))}},
        root / "distckpt",
        overwrite=True,
    )


def build_typed(root: Path) -> None:
    """The family's checkpoints in the pristine tree: ``ds`` and ``mg``."""
    if has_deepspeed():
        deepspeed_save(root / "ds")
    megatron_save(root / "mg", {"tp": 1, "rng": torch.arange(4)})


# ------------------------------------------------------------------ the family


def damage_typed(rng: random.Random, root: Path) -> dict[str, Any]:
    marker = root / "ran"
    where = rng.choice(["ds", "ck", "mg"] if (root / "ds").exists() else ["ck", "mg"])
    if where == "mg":
        kind = rng.choice(["pickle", "deflated", "garbage"])
        replace_object(root / "mg", megatron_archive(kind, marker))
        return {"damage": f"mg ShardedObject: {kind}", "readers": "typed", "changed": "mg|"}
    if rng.random() < 0.3:
        tag, form, payload = rng.choice(ROW_CASES)
    else:
        tag = rng.choice([*HOSTILE_TAGS, 7, None])
        form = rng.choice(["value", "enum", "fields", "attributes", "__dict__"])
        payload = payloads(marker).get(form, {"__class__": "subprocess:Popen"})
    replacement: Any = typed(tag, form, payload)
    if where == "ck" and rng.random() < 0.5:
        replacement = pickled(Evil(marker))
    target = root / "ds" / "t" if where == "ds" else root / "ck"

    def edit(variables: dict[str, Any]) -> None:
        if where == "ck":
            variables["cfg"]["value"] = replacement
        else:
            replace_first_typed(variables, replacement)

    Crafted(target).edit_index(edit)
    named = ",".join(sorted(named_modules(tag)))
    return {"damage": f"{where}: {str(replacement)[:160]}", "readers": "typed",
            "changed": f"{where}|{named}"}  # fmt: skip


#: Types a loader may return: plain data, tensors, and DeepSpeed's table.
PLAIN = (type(None), bool, int, float, str, bytes, io.BytesIO)


def foreign(obj: Any, allowed: tuple[type, ...]) -> str | None:
    """The type of the first object in ``obj`` that is neither plain data nor allowed."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if type(item) in (list, tuple, torch.Size):
            stack.extend(item)
        elif type(item) is dict:
            stack.extend(item.keys())
            stack.extend(item.values())
        elif not (type(item) in PLAIN or isinstance(item, torch.Tensor) or type(item) in allowed):
            return f"{type(item).__module__}.{type(item).__qualname__}"
    return None


def allowed_types() -> tuple[type, ...]:
    if not has_deepspeed():
        return (torch.Size, torch.dtype, torch.device)
    from distckpt.integrations.deepspeed.types import table

    return tuple(row.cls for row in table().values())


def preload_typed() -> None:
    """Import what the family's readers use (no thread starts): a campaign's driver
    does it once, before it forks a child per example."""
    import distckpt.integrations.dcp  # noqa: F401
    import distckpt.integrations.megatron  # noqa: F401

    if has_deepspeed():
        import distckpt.integrations.deepspeed  # noqa: F401

        allowed_types()


def read_typed(root: Path, o: Any, changed: str | None) -> None:
    """Every loader of the example's ``ds``, ``ck`` and ``mg`` (``o``: the fuzzer's
    outcomes), watched: ``changed`` is ``<where>|<modules the damage names>``."""
    from distckpt.integrations.dcp import DistckptReader
    from tests.support import audit

    where, _, names = (changed or "|").partition("|")
    named = set(filter(None, names.split(",")))
    allowed = allowed_types()
    ck = root / "ck"
    ds = root / "ds" / "t"
    with audit.watching(root, named, code=False) as events:
        if ds.exists():
            from distckpt.integrations.deepspeed import DistckptCheckpointEngine

            engine = DistckptCheckpointEngine()
            if o.settle("deepspeed load", lambda: engine.load(str(ds / "model.pt"))):
                built = foreign(o.value, allowed)
                o.check(built is None, f"deepspeed built {built}")
            held = {"model.pt.structure": None}
            if o.settle("ds load values", lambda: distckpt.load(held, ds, strict=False)):
                o.check(foreign(held, allowed) is None, "ds values built an object")
        values: dict[str, Any] = {"cfg": None, "step": None}
        if o.settle("ck load values", lambda: distckpt.load(values, ck, strict=False)):
            o.check(foreign(values, allowed) is None, "ck values built an object")
        o.settle("dcp read_metadata", lambda: DistckptReader(ck).read_metadata())
        from distckpt.integrations.megatron import DistckptLoadStrategy

        strategy = DistckptLoadStrategy(comm=SingleComm())
        if o.settle("megatron load", lambda: strategy.load(megatron_objects(), root / "mg")):
            got = o.value["obj"]
            o.check(foreign(got, allowed) is None, "megatron built an object")
        for path in [ck, root / "mg" / "distckpt", *([ds] if ds.exists() else [])]:
            o.cli("inspect", path)
            o.cli("verify", path)
            o.cli("export", path, root / f"{path.name}.export.pt", "--overwrite")
            o.cli("diff", path, path)
        o.cli("ls", root)
    o.check(not events, f"{where}: side effects: {events[:5]}")
    o.check(not (root / "ran").exists(), f"{where}: a command ran")
