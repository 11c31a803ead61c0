"""Hostile input at the command line: names read from storage never reach a terminal raw
(control characters, bidi overrides and line separators are escaped in every command's
output), and a location that names no store is one line and exit 2, like any bad input.
(Exports of checkpoints that declare more than they store are in
``tests/hostile/test_hostile_export.py``.)"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from distckpt import CheckpointError, LocationError
from distckpt.commit.staging import OWNER_FILE
from distckpt.storage import registry
from distckpt.storage.registry import open_store
from distckpt.terminal import printable
from distckpt.testing.hostile import reseal
from tests.hostile.test_hostile import cli, cli_process, one_error_line

pytestmark = pytest.mark.timeout(120)

#: A name as an attacker stores it: a colour escape, BEL, CR, DEL, a C1 CSI, a bidi
#: override, a line separator, a lone surrogate's neighbour (U+2029) and an ordinary tail.
BAD = "x\x1b[31m\x07\r\x7f\x9b\u202e\u2028\u2029y"


def raw_controls(text: str) -> list[str]:
    """The characters of ``text`` a terminal must not receive raw (a newline ends a line)."""
    return sorted({c for c in text if c != "\n" and not c.isprintable()})


def assert_printable(run: subprocess.CompletedProcess[str]) -> None:
    assert raw_controls(run.stdout) == [], (run.args, run.stdout)
    assert raw_controls(run.stderr) == [], (run.args, run.stderr)


def test_printable_escapes_what_a_terminal_would_act_on() -> None:
    assert printable("plain text, é 中 🙂") == "plain text, é 中 🙂"
    assert printable(BAD) == r"x\x1b[31m\x07\r\x7f\x9b\u202e\u2028\u2029y"
    assert printable("a\nb\tc\ud800") == r"a\nb\tc\ud800"
    assert raw_controls(printable("".join(map(chr, range(0x2100))))) == []


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run directory whose names hold :data:`BAD`: variables, values, a checkpoint, a
    leftover of a save, a damaged piece, and the pointer names one of them."""
    run = tmp_path / "run"
    state = {BAD: torch.arange(6.0), "v" + BAD: "text" + BAD, "n": {BAD: torch.ones(2)}}
    distckpt.save(state, run / "ckpt-1")
    distckpt.save({BAD: torch.zeros(6)}, run / f"ckpt{BAD}-2")
    distckpt.save({BAD: torch.zeros(6)}, run / "ckpt-3")
    piece = next(p for p in (run / "ckpt-3").rglob("c*") if p.is_file() and p.name != "zarr.json")
    data = bytearray(piece.read_bytes())
    data[0] ^= 0xFF  # a damaged piece: verify names its variable and file
    piece.write_bytes(bytes(data))
    leftover = run / f".ckpt{BAD}-4.staging-0123abcd"  # of a save whose process is gone
    leftover.mkdir()
    owner = {"host": socket.gethostname(), "pid": 2**22 + 12345, "started": 5.0}
    (leftover / OWNER_FILE).write_bytes(reseal(json.dumps(owner).encode()))
    pointer = {"format": "distckpt-pointer", "version": 1, "latest": f"ckpt{BAD}-2", "all": []}
    (run / "latest").write_bytes(reseal(json.dumps(pointer).encode()))
    return run


def test_no_command_prints_a_stored_control_character(run_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    ck, other, damaged = run_dir / "ckpt-1", run_dir / f"ckpt{BAD}-2", run_dir / "ckpt-3"
    weights = tmp_path / "weights"
    weights.mkdir()
    save_file({BAD: torch.ones(2), f"{BAD}/under": torch.ones(1)}, str(weights / "a.safetensors"))
    runs = [
        cli("ls", run_dir),
        cli("ls", run_dir, "--json"),
        cli("inspect", ck),
        cli("inspect", ck, "--json"),
        cli("verify", ck),
        cli("verify", damaged),
        cli("diff", ck, other),
        cli("diff", damaged, other),
        cli("export", ck, tmp_path / "m.safetensors"),
        cli("export", ck, tmp_path / "m.pt"),
        cli("export", ck, tmp_path / "hf", "--hf"),
        cli("export", damaged, tmp_path / "d.safetensors"),
        cli("import", tmp_path / "m.safetensors", tmp_path / "back"),
        cli("import", weights, tmp_path / "from-weights"),  # 'BAD' is also a prefix
        cli("gc", run_dir),
    ]
    for run in runs:
        assert_printable(run)
    codes = [run.returncode for run in runs]
    assert codes == [0, 0, 0, 0, 0, 1, 1, 2, 0, 0, 0, 2, 0, 2, 0], [
        (r.args[3:], r.returncode, r.stderr) for r in runs
    ]
    # What was escaped is still all there, and JSON keeps the names exactly.
    assert printable(BAD) in runs[2].stdout and printable(f"ckpt{BAD}-2") in runs[0].stdout
    assert {row["name"] for row in json.loads(runs[3].stdout)["variables"]} >= {BAD, "v" + BAD}
    listing = json.loads(runs[1].stdout)
    assert listing["latest"] == f"ckpt{BAD}-2" and "<- latest" in runs[0].stdout
    assert f"ckpt{BAD}-2" in {e["name"] for e in listing["checkpoints"]}
    assert printable(BAD) in runs[5].stderr and printable(BAD) in runs[7].stderr
    assert printable(f"ckpt{BAD}-4") in runs[0].stdout and printable(BAD) in runs[-1].stdout
    # An error message keeps the stored name whole, escaped, on one line.
    assert printable(f"run/ckpt-3/{BAD}/c.0") in runs[11].stderr


def test_a_logged_warning_is_printable(run_dir: Path) -> None:
    """The command's own log handler escapes what a library warning quotes."""
    script = (
        "import logging, sys; from distckpt.cli import main; "
        "code = main(['ls', sys.argv[2]]); "
        "logging.getLogger('distckpt').warning('stored name %s', sys.argv[1]); sys.exit(code)"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, BAD, str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0 and printable(BAD) in run.stderr, run.stderr
    assert_printable(run)


# ------------------------------------------------------------------ unknown locations


def test_an_unknown_scheme_is_a_location_error() -> None:
    with pytest.raises(LocationError, match="unsupported storage scheme 'mirorr'") as info:
        open_store("mirorr://b/c")
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, ValueError)
    with pytest.raises(LocationError, match="no bucket"):
        open_store("s3://")
    with pytest.raises(LocationError, match="mirorr"):
        distckpt.load({}, "mirorr://b/c")


def every_command(location: str, tmp_path: Path, ck: Path) -> list[list[str | Path]]:
    """Each command with ``location`` in each place that takes one."""
    file = tmp_path / "w.safetensors"
    return [
        ["ls", location],
        ["inspect", location],
        ["verify", location],
        ["export", location, tmp_path / "o.safetensors"],
        ["export", location, tmp_path / "hf", "--hf"],
        ["export", ck, location, "--hf"],
        ["import", location, tmp_path / "imported"],
        ["import", file, location],
        ["diff", location, ck],
        ["diff", ck, location],
        ["gc", location],
    ]


def test_an_unknown_scheme_is_one_line_and_exit_2_for_every_command(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    ck = tmp_path / "ck"
    distckpt.save({"w": torch.ones(2)}, ck)
    save_file({"w": torch.ones(2)}, str(tmp_path / "w.safetensors"))
    for argv in every_command("mirorr://b/c", tmp_path, ck):
        one_error_line(cli(*argv), "mirorr://b/c", "unsupported storage scheme 'mirorr'")
    run = cli_process("inspect", "mirorr://b/c")  # the installed command, as a user runs it
    one_error_line(run, "mirorr://b/c", "unsupported storage scheme 'mirorr'")
    assert "Traceback" not in run.stderr


def test_a_plugin_whose_url_parser_refuses_is_one_line_and_exit_2(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    def opener(url: str) -> Any:
        raise ValueError("no host in this URL")

    ck = tmp_path / "ck"
    distckpt.save({"w": torch.ones(2)}, ck)
    save_file({"w": torch.ones(2)}, str(tmp_path / "w.safetensors"))
    registry.register_store("picky", opener)
    try:
        with pytest.raises(LocationError, match="picky://b/c: no host in this URL"):
            open_store("picky://b/c")
        for argv in every_command("picky://b/c", tmp_path, ck):
            one_error_line(cli(*argv), "picky://b/c", "no host in this URL")
    finally:
        registry._openers.pop("picky")


def test_a_plugin_error_of_distckpts_own_passes_unchanged(tmp_path: Path) -> None:
    def opener(url: str) -> Any:
        raise distckpt.StorageError(f"{url}: no credentials")

    registry.register_store("denied", opener)
    try:
        with pytest.raises(distckpt.StorageError, match="denied://b: no credentials"):
            open_store("denied://b")
    finally:
        registry._openers.pop("denied")
