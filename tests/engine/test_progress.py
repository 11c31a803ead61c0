"""Progress lines (only on rank 0, only on a terminal, off with DISTCKPT_PROGRESS=0) and
the one INFO log line, timings and byte counts of each save and load."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from distckpt import cli
from distckpt import progress as progress_mod
from distckpt.comm import SingleComm
from distckpt.progress import Progress, human, progress

pytestmark = pytest.mark.timeout(60)


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def _progress_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(progress_mod.ENV, raising=False)


def test_human() -> None:
    assert human(0) == "0 B"
    assert human(1023) == "1023 B"
    assert human(1536) == "1.5 KiB"
    assert human(3 * 1024**3) == "3.0 GiB"
    assert human(2 * 1024**5) == "2048.0 TiB"


def test_renders_on_a_terminal() -> None:
    tty = FakeTTY()
    with progress("saving ck", 1000, stream=tty, threshold=0) as bar:
        assert bar.enabled
        bar.update(500)
    out = tty.getvalue()
    assert out.startswith("\rsaving ck: 500 B of 1000 B (50%)")
    assert "\rsaving ck: 500 B of 1000 B (50%)" in out and "B/s" in out
    assert out.endswith("\n") and out.count("\n") == 1


def test_redraws_at_most_ten_times_a_second() -> None:
    tty, clock = FakeTTY(), Clock()
    bar = Progress("x", 10_000, tty, clock=clock)
    for _ in range(100):
        bar.update(10)  # all within the same instant: one draw
    assert tty.getvalue().count("\r") == 1
    clock.now = 0.05
    bar.update(10)
    assert tty.getvalue().count("\r") == 1
    clock.now = 0.2
    bar.update(10)
    assert tty.getvalue().count("\r") == 2
    assert "1020 B of 9.8 KiB (10%)" in tty.getvalue()
    bar.close()
    bar.close()  # once only
    assert tty.getvalue().count("\n") == 1
    # a shorter line than the last one still overwrites it all
    lines = tty.getvalue().split("\r")[1:]
    assert len(lines[-1].rstrip("\n")) >= len(lines[-2])


@pytest.mark.parametrize(
    ("stream", "rank", "env", "total"),
    [
        (io.StringIO(), 0, None, 1000),  # not a terminal
        (FakeTTY(), 1, None, 1000),  # not rank 0
        (FakeTTY(), 0, "0", 1000),  # switched off
        (FakeTTY(), 0, None, 0),  # nothing to do
    ],
    ids=["not-a-tty", "rank-1", "DISTCKPT_PROGRESS=0", "empty"],
)
def test_silent(
    monkeypatch: pytest.MonkeyPatch, stream: io.StringIO, rank: int, env: str | None, total: int
) -> None:
    if env is not None:
        monkeypatch.setenv(progress_mod.ENV, env)
    with progress("x", total, rank=rank, stream=stream, threshold=0) as bar:
        bar.update(total)
    assert not bar.enabled
    assert stream.getvalue() == ""


def test_below_the_threshold_is_silent() -> None:
    tty = FakeTTY()
    with progress("x", progress_mod.THRESHOLD - 1, stream=tty) as bar:
        bar.update(10)
    assert tty.getvalue() == ""
    with progress("x", progress_mod.THRESHOLD, stream=tty) as bar:
        bar.update(10)
    assert tty.getvalue().endswith("\n")


def test_closed_stream_is_not_a_terminal() -> None:
    closed = io.StringIO()
    closed.close()  # isatty() raises ValueError
    assert not progress("x", 10, stream=closed, threshold=0).enabled


def _state() -> dict[str, Any]:
    return {"w": torch.arange(512 * 256, dtype=torch.float32).reshape(512, 256), "step": 3}


def test_save_and_load_show_rank_0_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    monkeypatch.setattr(progress_mod, "THRESHOLD", 1024)
    distckpt.save(_state(), tmp_path / "ck", SingleComm(), io_workers=2)
    shown = "(rank 0's share, 2 I/O workers: io_workers=): 512.0 KiB of 512.0 KiB (100%)"
    assert f"saving ck {shown}" in tty.getvalue()
    target = {"w": torch.zeros(512, 256), "step": 0}
    distckpt.load(target, tmp_path / "ck", SingleComm(), io_workers=2)
    assert f"loading ck {shown}" in tty.getvalue()
    monkeypatch.setenv(progress_mod.ENV, "0")
    before = tty.getvalue()
    distckpt.load(target, tmp_path / "ck", SingleComm())
    assert tty.getvalue() == before


def test_background_saves_show_no_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    monkeypatch.setattr(progress_mod, "THRESHOLD", 0)
    distckpt.save(_state(), tmp_path / "ck", SingleComm(), async_save=True).wait()
    assert tty.getvalue() == ""


def test_cli_verify_and_export_show_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    distckpt.save(_state(), tmp_path / "ck", SingleComm(), compression="zstd")
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    assert cli.main(["verify", str(tmp_path / "ck")]) == cli.OK
    line = tty.getvalue().rsplit("\r", 1)[-1]
    assert line.startswith(f"verifying {tmp_path / 'ck'}: ") and "(100%)" in line, line
    assert cli.main(["export", str(tmp_path / "ck"), str(tmp_path / "w.safetensors")]) == 0
    line = tty.getvalue().rsplit("\r", 1)[-1]
    assert "512.0 KiB of 512.0 KiB (100%)" in line and line.endswith("\n"), line


def test_save_and_load_log_one_info_line_with_timings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="distckpt")
    saved = distckpt.save(_state(), tmp_path / "ck", SingleComm(), compression="zstd")
    assert set(saved.timings) == {"plan", "exchange", "write", "commit", "total"}
    assert all(v >= 0 for v in saved.timings.values())
    files = [p for p in (tmp_path / "ck").rglob("*") if p.is_file() and p.name != "zarr.json"]
    assert saved.bytes_written == sum(p.stat().st_size for p in files) > 0
    lines = [r for r in caplog.records if r.name == "distckpt" and r.levelno == logging.INFO]
    assert len(lines) == 1
    text = lines[0].getMessage()
    assert text.startswith(f"saved {tmp_path / 'ck'}: 2 variables, {saved.bytes_written} bytes")
    assert "write " in text and "commit " in text

    caplog.clear()
    target = {"w": torch.zeros(512, 256), "step": 0}
    loaded = distckpt.load(target, tmp_path / "ck", SingleComm())
    assert set(loaded.timings) == {"plan", "read", "total"}
    assert loaded.timings["total"] >= loaded.timings["plan"] + loaded.timings["read"]
    assert loaded.bytes_read == saved.bytes_written  # one process reads every stored byte
    lines = [r for r in caplog.records if r.name == "distckpt" and r.levelno == logging.INFO]
    assert len(lines) == 1
    text = lines[0].getMessage()
    assert text.startswith(f"restored {tmp_path / 'ck'}: 2 variables, {loaded.bytes_read} bytes")
    assert "plan " in text and "read " in text
