"""Fuzzing what distckpt reads from storage: a property test over damaged checkpoints.

Each example copies a small real run (an engine checkpoint with sharded, compressed and
small tensors and values; a manager's run directory with persistent checkpoints, a
pointer and node-local steps) and a directory *outside* it, damages one to three things
the library reads (the index, a piece file, the pointer, a local manifest or data file,
the run directory's entries), then runs every reader: ``load``, ``list_variables``,
``distckpt inspect / verify / export / ls / gc`` and a ``CheckpointManager`` that restores
and saves twice (so retention runs). Each must, within a time bound:

* give the right values (tensors bit for bit; a value only when its stored text was
  left alone), or raise a :class:`distckpt.CheckpointError` (the CLI: exit 1 or 2, with
  one line on stderr for 2), and never another exception;
* touch nothing outside the run: the outside directory, which holds a committed
  checkpoint the damage may point at, is unchanged byte for byte.

The suite runs :data:`EXAMPLES` derandomized examples (the same ones every run, so it
cannot flake); ``DISTCKPT_FUZZ_EXAMPLES=2000 python -m pytest tests/hostile/test_fuzz.py`` runs
more, with fresh randomness.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.hostile_util import run_manager, run_model
from tests.support.launch_util import bounded

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import distckpt  # noqa: E402
from distckpt import cli  # noqa: E402
from distckpt.format import seal  # noqa: E402
from distckpt.testing.hostile import HOSTILE_VALUES, edit_json  # noqa: E402

EXAMPLES = int(os.environ.get("DISTCKPT_FUZZ_EXAMPLES", "40"))
#: Seconds any one reader may take on a damaged checkpoint (generous: a loaded machine).
BOUND = 30

# ---------------------------------------------------------------- the pristine tree


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 48, generator=g),  # regular, 12 inner chunks of 1 KiB
        "z": torch.randint(0, 3, (40, 50), generator=g).to(torch.int16),  # zstd
        "b": torch.randn(3, generator=g).to(torch.bfloat16),  # one plain chunk
        "cfg": {"lr": 0.5, "betas": (0.9, 0.99), "ids": {1: "one"}},
        "step": 7,
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine")
    distckpt.save(
        _state(0), root / "ck", small_bytes=64, inner_bytes=1024, compression={"z": "zstd"}
    )
    outside = root / "outside"
    distckpt.save(
        _state(1), outside / "victim", small_bytes=64, inner_bytes=1024, compression={"z": "zstd"}
    )
    (outside / "precious.txt").write_text("not the run's")
    ckpt = run_model()
    manager = run_manager(root, ckpt)
    for step in range(1, 6):  # persistent at 1 and 4, local at 2, 3, 5
        ckpt.step.fill_(step)
        ckpt.w.fill_(step)
        manager.save()
    manager.close()
    return root


def _fingerprint(top: Path) -> dict[str, str]:
    """Every entry under ``top``: its kind, and a regular file's bytes (hashed)."""
    out = {}
    for dirpath, dirs, files in os.walk(top):
        for name in dirs + files:
            path = Path(dirpath, name)
            mode = path.lstat().st_mode
            if stat.S_ISREG(mode):
                out[str(path.relative_to(top))] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                out[str(path.relative_to(top))] = stat.filemode(mode)
    return out


# ---------------------------------------------------------------- damage


def _seal_holds(raw: bytes) -> bool:
    """Whether a metadata document's checksum, if it has one, matches its bytes."""
    at = raw.find(seal.MARK)
    if at < 0:
        return True
    at += len(seal.MARK)
    return raw[at : at + seal.DIGITS] == b"%08x" % seal.crc_of(raw, at)


def _files(top: Path) -> list[Path]:
    """The regular files under ``top``, reached through no link (the damage stays inside)."""
    if top.is_symlink():
        return []
    return sorted(
        Path(d, f)
        for d, _, names in os.walk(top)
        for f in names
        if Path(d, f).is_file() and not Path(d, f).is_symlink()
    )


def _damage_file(path: Path, how: str, at: int, root: Path) -> None:
    if how == "truncate":
        size = path.stat().st_size
        os.truncate(path, at % max(size, 1))
    elif how == "flip":
        data = bytearray(path.read_bytes())
        if data:
            data[at % len(data)] ^= 1 << (at % 8)
            path.write_bytes(bytes(data))
    elif how == "append":
        with open(path, "ab") as f:
            f.write(b"\0" * (1 + at % 100))
    elif how == "delete":
        path.unlink()
    elif how == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif how == "link-out":  # the same bytes, outside the run: still never read
        twin = root / "outside" / "victim" / path.relative_to(path.parents[1])
        path.unlink()
        os.symlink(twin if twin.exists() else root / "outside" / "precious.txt", path)
    elif how == "link-zero":
        path.unlink()
        os.symlink("/dev/zero", path)
    elif how == "dir-link-out":  # the file's directory becomes a link to the outside
        parent = path.parent
        shutil.rmtree(parent)
        os.symlink(root / "outside" / "victim" / "w", parent)


FILE_DAMAGE = [
    "truncate",
    "flip",
    "append",
    "delete",
    "fifo",
    "link-out",
    "link-zero",
    "dir-link-out",
]


def _damage_run(root: Path, how: str) -> None:
    run = root / "run"
    if how == "checkpoint-link":  # a committed checkpoint replaced by a link out
        shutil.rmtree(run / "ckpt-4")
        os.symlink(root / "outside" / "victim", run / "ckpt-4")
    elif how == "extra-link":  # a link named like a checkpoint, and one like a leftover
        os.symlink(root / "outside" / "victim", run / "ckpt-3")
        os.symlink(root / "outside", run / ".ckpt-9.staging-abc123")
    elif how == "pointer-fifo":
        (run / "latest").unlink()
        os.mkfifo(run / "latest")
    elif how == "pointer-link":
        (run / "latest").unlink()
        os.symlink("/dev/zero", run / "latest")


damage = st.one_of(
    st.tuples(
        st.just("json"),
        st.sampled_from(["ck/zarr.json", "run/latest", "run/ckpt-4/zarr.json", "manifest"]),
        st.integers(0, 10_000),
        st.sampled_from(HOSTILE_VALUES),
    ),
    st.tuples(
        st.just("file"),
        st.sampled_from(["ck", "run/ckpt-4", "local"]),
        st.integers(0, 10_000),
        st.sampled_from(FILE_DAMAGE),
    ),
    st.tuples(
        st.just("run"),
        st.just(""),
        st.just(0),
        st.sampled_from(["checkpoint-link", "extra-link", "pointer-fifo", "pointer-link"]),
    ),
)


def _apply(root: Path, kind: str, target: str, at: int, how: Any) -> str | None:
    """Apply one damage; returns the variable whose stored *value* it may have changed
    (a value's text is not checksummed), else None."""
    if kind == "run":
        _damage_run(root, how)
        return None
    if kind == "json":
        if target == "manifest":
            manifests = sorted((root / "local").rglob("*.json"))
            if not manifests:
                return None
            path = manifests[at % len(manifests)]
        else:
            path = root / target
        if not path.is_file() or os.path.realpath(path) != str(path):
            return None  # reached through a link another damage made: that is outside
        # Resealing a document that an earlier damage flipped hides that flip too.
        laundered = not _seal_holds(path.read_bytes())
        where = edit_json(path, at, how)
        if laundered:
            return "*"
        parts = where.split("/")
        if {"value", "values", "per_rank_values", "name"} & set(parts):
            return "*"  # a value or a name (in a manifest), not checksummed: any is right
        if how == "delete" and (parts[-2:-1] in (["tensors"], ["variables"])):
            return "*"  # a whole entry gone: a well-formed document that holds less
        if parts[-1:] in (["tensors"], ["variables"]) and how in ([], {}):
            return "*"  # all of them gone, likewise
        return None
    top = root / target
    files = [p for p in _files(top) if p.name not in ("latest", ".distckpt-run")]
    if not files:
        return None
    path = files[at % len(files)]
    _damage_file(path, how, at, root)
    # A metadata document carries its checksum: a flipped bit in it is detected, unless
    # the bit was in the checksum's own name, which leaves a document without one (read
    # as an older distckpt's, unchecked): then a second flip in it goes unseen.
    metadata = path.suffix == ".json" or path.name.startswith("done.")
    unsealed = metadata and how == "flip" and seal.MARK not in path.read_bytes()
    return "*" if unsealed else None


# ---------------------------------------------------------------- the readers


def _settles(what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``'s result, or None when it raised a CheckpointError; anything else fails."""
    with bounded(BOUND, what):
        try:
            return fn()
        except distckpt.CheckpointError:
            return None


def _cli(*argv: str) -> int:
    err = io.StringIO()
    with (
        bounded(BOUND, f"distckpt {' '.join(argv)}"),
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        rc = cli.main(list(argv))
    lines = err.getvalue().strip().splitlines()
    assert rc in (0, 1, 2), (argv, rc)
    if rc == 2:
        errors = [line for line in lines if ": error: " in line]
        assert len(errors) == 1, (argv, lines)
    return rc


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit."""

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(-1).view(torch.uint8)

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def _check_load(root: Path, value_changed: str | None) -> None:
    want = _state(0)
    got: dict[str, Any] = {
        "w": torch.zeros(64, 48),
        "z": torch.zeros(40, 50, dtype=torch.int16),
        "b": torch.zeros(3, dtype=torch.bfloat16),
        "cfg": None,
        "step": None,
    }
    if _settles("load", lambda: distckpt.load(got, root / "ck")) is None:
        return
    for name in ("w", "z", "b"):
        assert _same(got[name], want[name]), f"{name} loaded wrong values without an error"
    if value_changed is None:
        assert got["cfg"] == want["cfg"] and got["step"] == want["step"]


def _checkrun_manager(root: Path, changed: str | None) -> None:
    ckpt = run_model()
    holder: list[distckpt.CheckpointManager] = []

    def restore() -> Any:
        manager = run_manager(root, ckpt)
        holder.append(manager)
        return manager.restore_or_initialize()

    try:
        restored = _settles("CheckpointManager restore", restore)
        if holder and restored is not None and changed is None:
            step = int(ckpt.step)
            assert 1 <= step <= 5, step
            assert torch.equal(ckpt.w, torch.full((40, 30), float(step))), "restored wrong values"
        if holder:
            for step in (6, 7):
                ckpt.step.fill_(step)
                _settles("CheckpointManager save", holder[0].save)
    finally:
        for manager in holder:
            with contextlib.suppress(distckpt.CheckpointError):
                manager.close()


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="DISTCKPT_FUZZ_EXAMPLES" not in os.environ,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(damages=st.lists(damage, min_size=1, max_size=3))
def test_damaged_storage_gives_right_values_or_one_clear_error(
    pristine: Path, tmp_path_factory: pytest.TempPathFactory, damages: list[Any]
) -> None:
    root = tmp_path_factory.mktemp("fuzz").resolve()
    shutil.copytree(pristine, root, dirs_exist_ok=True, symlinks=True)
    # The run directory's identity and lock are absolute-path free; the local tier's
    # directory moved with the copy, so the manager finds it under the new root.
    outside = _fingerprint(root / "outside")
    changed = None
    for kind, target, at, how in damages:
        # A damage that does not apply after another (a file gone, a document too deep).
        with contextlib.suppress(OSError, ValueError, RecursionError):
            changed = _apply(root, kind, target, at, how) or changed
    try:
        _check_load(root, changed)
        _settles("list_variables", lambda: distckpt.list_variables(root / "ck"))
        for argv in (
            ("inspect", str(root / "ck")),
            ("verify", str(root / "ck")),
            ("export", str(root / "ck"), str(root / "out.safetensors")),
            ("ls", str(root / "run")),
            ("verify", str(root / "run" / "ckpt-4")),
            ("diff", str(root / "ck"), str(root / "run" / "ckpt-1")),
            ("gc", str(root / "run")),
        ):
            _cli(*argv)
        _checkrun_manager(root, changed)
        assert _fingerprint(root / "outside") == outside, "something outside the run changed"
    finally:
        shutil.rmtree(root, ignore_errors=True)
