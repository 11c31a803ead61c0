"""Every code block of the README and the documentation site runs, or says why it cannot
(:mod:`tests.docs.blocks` says how): an example that breaks breaks the build."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from torch.utils.cpp_extension import get_default_build_root

from tests.docs.blocks import ROOT, Block, pages, read
from tests.support.launch_util import whole_lines_path
from tests.support.warm_ranks import SOCKET_VARIABLE, run_ranks, server_socket

#: A whole page's blocks get this long (multi-rank ones start their own processes).
PAGE_TIMEOUT = 900

#: Pages that need a package the test extra cannot hold: DeepSpeed builds against the
#: installed torch, so .ci/run installs it apart (see docs/development.md). Without it
#: the page is skipped (a failure under CI=true, where .ci/run has installed it).
NEEDS = {"docs/integrations/deepspeed.md": "deepspeed"}


def page_id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("path", pages(), ids=page_id)
def test_blocks_say_how_they_run(path: Path) -> None:
    read(path)


def runnable(path: Path) -> bool:
    try:
        return any(b.kind not in ("skip", "output") for b in read(path))
    except ValueError:
        return True  # test_page_runs names what is wrong


@pytest.mark.timeout(PAGE_TIMEOUT + 60)
@pytest.mark.parametrize("path", [p for p in pages() if runnable(p)], ids=page_id)
def test_page_runs(path: Path, tmp_path: Path) -> None:
    if page_id(path) in NEEDS:
        pytest.importorskip(NEEDS[page_id(path)])
    blocks = read(path)
    work = tmp_path / "page"
    work.mkdir()
    # The paths a page names from the checkout, as a reader in a clone has them.
    for name in ("examples", "benchmarks", "launch"):
        (work / name).symlink_to(ROOT / name)
    listing = tmp_path / "blocks.json"
    listing.write_text(json.dumps([dict(vars(b), where=b.where) for b in blocks]))
    env = dict(os.environ)
    env.pop("PYTHONUNBUFFERED", None)  # whole lines instead (see launch_util.WHOLE_LINES)
    # DeepSpeed builds a torch extension at its first start on a machine (minutes): the
    # pages share one build cache rather than build it again in each run's fresh HOME.
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(get_default_build_root(), "docs-pages"))
    bin_dir = str(Path(sys.executable).parent)
    env.update(
        PATH=bin_dir + os.pathsep + env.get("PATH", ""),
        PYTHONPATH=whole_lines_path(env.get("PYTHONPATH", "")),
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        HOME=str(tmp_path / "home"),
    )
    (tmp_path / "home").mkdir()
    for name in [n for n in env if n.startswith("DISTCKPT_")]:
        del env[name]
    # The page runs in a process forked from the suite's warm interpreter, as do the
    # ranks and the scripts of its blocks (tests/docs/run_page.py).
    env[SOCKET_VARIABLE] = server_socket()
    runner = ROOT / "tests" / "docs" / "run_page.py"
    done = run_ranks(
        1, runner, str(listing), timeout=PAGE_TIMEOUT, plain=True, cwd=work, environ=env
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-8000:]


def all_blocks() -> list[Block]:
    return [block for path in pages() for block in read(path)]


def test_every_command_named_exists() -> None:
    """Every ``distckpt <command>`` the pages show is a command of the CLI."""
    from distckpt import cli

    sub = next(a for a in cli._parser()._actions if a.dest == "command")
    commands = set(sub.choices)  # type: ignore[arg-type]
    named = set()
    for path in pages():
        # In running text (`distckpt verify DIR`) and in the command lines of blocks.
        named.update(re.findall(r"`distckpt ([a-z][\w-]*)", path.read_text()))
        for block in read(path):
            # A command starts a line of a bash block or follows a shell separator there;
            # in output (text) it starts a line (a prompt's `$ `, an error's prefix).
            if block.lang == "bash":
                line = r"(?:^|[|;&]\s*|\$\s*)distckpt ([a-z][\w-]*)"
            elif block.lang == "text":
                line = r"^\s*(?:\$\s*)?distckpt ([a-z][\w-]*)"
            else:
                continue
            named.update(re.findall(line, block.code, flags=re.M))
    assert named, "no command named"
    assert named <= commands, sorted(named - commands)
