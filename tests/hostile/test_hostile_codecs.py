"""Compressed chunks crafted to lie, every checksum recomputed after the edit
(distckpt.testing.hostile): each reader of a checkpoint refuses them with
CorruptCheckpointError, none dies by a signal, and none hands out values it did not
decode (a short frame used to leave the target's old values, or another variable's from a
reused scratch buffer). The entry points run in one child process, whose end is checked."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent(
    """
    import io, json, struct, sys, tempfile
    from contextlib import redirect_stderr, redirect_stdout
    from pathlib import Path

    import numcodecs
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp

    import distckpt
    from distckpt.cli import main as cli
    from distckpt.integrations.dcp import DistckptReader
    from distckpt.testing.hostile import Crafted

    N = 1 << 19  # two inner chunks of 1 MiB (float32)

    def blosc_lies(chunks):
        head = bytearray(chunks[0])
        head[12:16] = (0x7FFF0000).to_bytes(4, "little")  # its compressed size
        head[16:20] = (0x40000000).to_bytes(4, "little")  # the first block's start
        return [bytes(head), *chunks[1:]]

    def short(codec):
        return lambda chunks: [bytes(codec.encode(np.ones(16, np.uint8))), *chunks[1:]]

    def zstd_unsized(chunks):
        # a frame of one raw block of the chunk's bytes that does not say its size
        raw = b"\\x07" * (128 << 10)
        frame = (0xFD2FB528).to_bytes(4, "little") + bytes([0x00, 0x50])
        for k in range(8):
            frame += (((len(raw) << 3) | (k == 7))).to_bytes(3, "little") + raw
        return [frame, *chunks[1:]]

    RECIPES = {
        "blosc-lies": ("blosc-lz4", blosc_lies),
        "blosc-short": ("blosc-lz4", short(numcodecs.Blosc(cname="lz4"))),
        "zstd-short": ("zstd", short(numcodecs.Zstd())),
        "zstd-unsized": ("zstd", zstd_unsized),
    }

    def values(seed):
        return torch.randn(N, generator=torch.Generator().manual_seed(seed))

    def outcome(call):
        try:
            call()
        except distckpt.CheckpointError as exc:
            return type(exc).__name__
        except dcp.api.CheckpointException as exc:  # DCP wraps what its reader raised
            failure = next(iter(exc.failures.values()))
            return type(failure[0] if isinstance(failure, tuple) else failure).__name__
        return "ok"

    def cli_rc(*args):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            return f"rc={cli([str(a) for a in args])}"

    root = Path(sys.argv[1])
    for name, (compression, edit) in RECIPES.items():
        top = root / name
        a, b = values(1), values(2)
        ckpt = distckpt.Checkpoint(a=a.clone(), b=b.clone())
        options = distckpt.CheckpointOptions(compression=compression)
        with distckpt.CheckpointManager(ckpt, top / "run", options=options) as manager:
            manager.save()
        ck = top / "run" / "ckpt-1"
        Crafted(ck).edit_chunks("b", 0, edit)
        results = {}

        full = {"a": torch.zeros(N), "b": torch.full((N,), 5.0)}
        results["load"] = outcome(lambda: distckpt.load(full, ck, strict=False))
        # a resharded load: a box of each, read through one worker's scratch buffer,
        # a's chunk first
        part = {
            "a": distckpt.Shard(torch.zeros(1000), (N,), (10,)),
            "b": distckpt.Shard(torch.full((1000,), 5.0), (N,), (10,)),
        }
        results["load-box"] = outcome(lambda: distckpt.load(part, ck, io_workers=1, strict=False))
        got = part["b"].tensor
        results["box-b-has-a"] = bool(torch.equal(got, a[10:1010]))
        results["box-b-wrong"] = not (torch.equal(got, b[10:1010]) or bool((got == 5).all()))
        results["restore"] = outcome(
            lambda: distckpt.Checkpoint(a=torch.zeros(N), b=torch.zeros(N)).restore(ck)
        )
        fresh = distckpt.Checkpoint(a=torch.zeros(N), b=torch.zeros(N))
        results["restore_or_initialize"] = outcome(
            lambda: distckpt.CheckpointManager(fresh, top / "run").restore_or_initialize()
        )
        results["dcp"] = outcome(
            lambda: dcp.load(
                {"a": torch.zeros(N), "b": torch.zeros(N)}, storage_reader=DistckptReader(ck)
            )
        )
        results["verify"] = cli_rc("verify", ck)
        results["export"] = cli_rc("export", ck, top / "out.safetensors")
        results["export-pt"] = cli_rc("export", ck, top / "out.pt")
        results["exported"] = (top / "out.safetensors").exists() or (top / "out.pt").exists()
        print(json.dumps({name: results}), flush=True)
    print("DONE", flush=True)
    """
)

EXPECTED = {
    "load": "CorruptCheckpointError",
    "load-box": "CorruptCheckpointError",
    "box-b-has-a": False,
    "box-b-wrong": False,
    "restore": "CorruptCheckpointError",
    "restore_or_initialize": "CorruptCheckpointError",
    "dcp": "CorruptCheckpointError",
    "verify": "rc=1",
    "export": "rc=2",
    "export-pt": "rc=2",
    "exported": False,
}


def test_every_reader_refuses_a_lying_compressed_chunk_and_none_dies(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", **__import__("os").environ},
    )
    assert run.returncode == 0, (
        f"the child ended with {run.returncode} (a negative code is a signal) after:\n"
        f"{run.stdout}\n{run.stderr[-3000:]}"
    )
    assert run.stdout.rstrip().endswith("DONE"), run.stdout
    found = {}
    for line in run.stdout.splitlines()[:-1]:
        found.update(json.loads(line))
    assert set(found) == {"blosc-lies", "blosc-short", "zstd-short", "zstd-unsized"}
    problems = {
        (recipe, entry): (got, EXPECTED[entry])
        for recipe, results in found.items()
        for entry, got in results.items()
        if got != EXPECTED[entry]
    }
    assert not problems, problems


@pytest.mark.parametrize("compression", ["zstd", "blosc-lz4", "blosc-zstd"])
def test_an_honest_compressed_checkpoint_still_loads_bit_for_bit(
    tmp_path: Path, compression: str
) -> None:
    import torch

    import distckpt

    state = {
        "w": torch.randn(300, 1000, generator=torch.Generator().manual_seed(0)),
        "h": torch.arange(70000, dtype=torch.int16),
        "q": torch.randint(0, 255, (5000,), dtype=torch.uint8),
    }
    distckpt.save(state, tmp_path / "ck", compression=compression, inner_bytes=64 << 10)
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    distckpt.load(back, tmp_path / "ck")
    for k in state:
        assert torch.equal(back[k], state[k]), k


def test_a_compressed_inner_chunk_may_not_declare_more_than_a_reader_allocates(
    tmp_path: Path,
) -> None:
    """A few stored bytes may declare an inner chunk of gigabytes (within the ratio a codec
    allows): every reader would decompress it whole. Saves never write one over 64 MiB,
    and an index that declares one is refused before anything is allocated."""
    import numcodecs
    import numpy as np
    import torch

    import distckpt
    from distckpt.format.wellformed import MAX_CODEC_CHUNK
    from distckpt.testing.hostile import Crafted, build_shard

    with pytest.raises(ValueError, match="at most 67108864 bytes"):
        distckpt.CheckpointOptions(compression="zstd", inner_bytes=MAX_CODEC_CHUNK + 1)
    distckpt.CheckpointOptions(compression=None, inner_bytes=MAX_CODEC_CHUNK + 1)  # raw: fine
    ck = tmp_path / "ck"
    distckpt.save({"w": torch.zeros(1 << 17)}, ck, compression="zstd", inner_bytes=1 << 12)
    crafted = Crafted(ck)
    noise = numcodecs.Zstd().encode(np.random.default_rng(0).integers(0, 256, 8192, np.uint8))

    def declare(variables: dict) -> None:  # type: ignore[type-arg]
        variables["w"].update(shape=[1 << 26], chunks=[1 << 26], inner=[1 << 25])

    crafted.edit_index(declare)
    crafted.write_piece("w", 0, build_shard([bytes(noise), bytes(noise)]))  # stored: 16 KiB
    with pytest.raises(distckpt.CorruptCheckpointError, match="compressed inner chunks"):
        distckpt.load({"w": torch.zeros(1 << 26)}, ck)
