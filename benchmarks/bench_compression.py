"""Compression choices per dtype: ratio and speed of each, on weights and Adam state.

One process. For each dtype (bfloat16, float16, float32, float8_e4m3fn) and each kind of
data (``weights``: normal, std 0.02, as initialised layers are; ``exp_avg``: Adam's first
moment, normal of std 1e-3; ``exp_avg_sq``: its second moment, squares of those), it
compresses ``--mib`` MiB cut into 1 MiB inner chunks, as a save does, with each choice
of :data:`distckpt.format.codecs.CHOICES`, and decompresses them again (checking the
bytes). It prints, per case, the ratio (raw bytes / stored bytes) and the encode and
decode speed of one core (medians of ``--rounds``), then the time of a whole
``distckpt.save`` and ``distckpt.load`` of a bf16 state with each choice against a raw
one (``--dir``, default /dev/shm), as ratios. Results with ``--json FILE``.

    python benchmarks/bench_compression.py                 # ~2 min on 2 cores
    python benchmarks/bench_compression.py --mib 64 --rounds 5 --json /tmp/compression.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import distckpt
from distckpt.comm import SingleComm
from distckpt.format import codecs

CHUNK = 1 << 20
DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def data(kind: str, dtype: torch.dtype, nbytes: int, seed: int = 0) -> np.ndarray:
    """``nbytes`` of ``kind`` values of ``dtype``, as raw bytes."""
    n = nbytes // torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    if kind == "weights":
        values = torch.randn(n, generator=gen) * 0.02
    elif kind == "exp_avg":
        values = torch.randn(n, generator=gen) * 1e-3
    else:
        values = (torch.randn(n, generator=gen) * 1e-3) ** 2
    return values.to(dtype).view(torch.uint8).numpy()


def codec_case(raw: np.ndarray, choice: str, itemsize: int, rounds: int) -> dict[str, float]:
    codec = codecs.make(choice, itemsize)
    assert codec is not None
    chunks = [raw[i : i + CHUNK] for i in range(0, raw.size, CHUNK)]
    enc_s, dec_s = [], []
    stored: list[bytes] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        stored = [codec.encode(c) for c in chunks]
        enc_s.append(time.perf_counter() - t0)
        out = np.empty(CHUNK, np.uint8)
        t0 = time.perf_counter()
        for c, s in zip(chunks, stored, strict=True):
            view = out[: c.size]
            codec.decode(np.frombuffer(s, np.uint8), view)
        dec_s.append(time.perf_counter() - t0)
        if not np.array_equal(view, chunks[-1]):
            raise AssertionError(f"{choice}: decoded bytes differ")
    size = sum(len(s) for s in stored)
    return {
        "ratio": raw.nbytes / size,
        "encode_gbs": raw.nbytes / statistics.median(enc_s) / 1e9,
        "decode_gbs": raw.nbytes / statistics.median(dec_s) / 1e9,
    }


def engine_case(where: Path, mib: int, rounds: int) -> dict[str, dict[str, float]]:
    """Whole saves and loads of a bf16 state (weights and moments) with each choice, the
    choices alternated within each round; medians, and ratios against raw."""
    comm = SingleComm()
    per = (mib << 20) // 3
    state = {
        kind: torch.from_numpy(data(kind, torch.bfloat16, per, seed=i).copy()).view(torch.bfloat16)
        for i, kind in enumerate(("weights", "exp_avg", "exp_avg_sq"))
    }
    choices: list[str | None] = [None, *codecs.CHOICES]
    times: dict[str, dict[str, list[float]]] = {str(c): {"save": [], "load": []} for c in choices}
    sizes: dict[str, int] = {}
    for r in range(rounds + 1):  # round 0 warms up
        order = choices[r % len(choices) :] + choices[: r % len(choices)]
        for choice in order:
            path = where / f"ck-{choice}"
            shutil.rmtree(path, ignore_errors=True)
            t0 = time.perf_counter()
            result = distckpt.save(state, path, comm, compression=choice)
            t1 = time.perf_counter()
            target = {k: torch.empty_like(v) for k, v in state.items()}
            distckpt.load(target, path, comm)
            t2 = time.perf_counter()
            for k in state:
                if not torch.equal(target[k].view(torch.int16), state[k].view(torch.int16)):
                    raise AssertionError(f"{choice}: {k} differs after a load")
            if r:
                times[str(choice)]["save"].append(t1 - t0)
                times[str(choice)]["load"].append(t2 - t1)
            sizes[str(choice)] = result.bytes_written
            shutil.rmtree(path, ignore_errors=True)
    raw = {op: statistics.median(times["None"][op]) for op in ("save", "load")}
    return {
        c: {
            "ratio": sizes["None"] / sizes[c],
            "save_vs_raw": statistics.median(t["save"]) / raw["save"],
            "load_vs_raw": statistics.median(t["load"]) / raw["load"],
        }
        for c, t in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=32, help="MiB per codec case")
    parser.add_argument("--engine-mib", type=int, default=192, help="MiB of the saved state")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm", help="where the engine case saves")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"codecs": {}, "engine": {}}
    print(
        f"{'dtype':14s} {'data':11s} {'choice':11s} {'ratio':>6s} {'enc GB/s':>9s} {'dec GB/s':>9s}"
    )
    for name, dtype in DTYPES.items():
        itemsize = torch.tensor([], dtype=dtype).element_size()
        for kind in ("weights", "exp_avg", "exp_avg_sq"):
            raw = data(kind, dtype, args.mib << 20)
            for choice in codecs.CHOICES:
                got = codec_case(raw, choice, itemsize, args.rounds)
                results["codecs"][f"{name}/{kind}/{choice}"] = got
                print(
                    f"{name:14s} {kind:11s} {choice:11s} {got['ratio']:6.3f} "
                    f"{got['encode_gbs']:9.2f} {got['decode_gbs']:9.2f}"
                )
    with tempfile.TemporaryDirectory(dir=args.dir) as where:
        engine = engine_case(Path(where), args.engine_mib, args.rounds)
    results["engine"] = engine
    print(f"\nbf16 state of {args.engine_mib} MiB, distckpt.save / load, against raw (medians):")
    print(f"{'choice':11s} {'ratio':>6s} {'save/raw':>9s} {'load/raw':>9s}")
    for choice, got in engine.items():
        print(
            f"{choice:11s} {got['ratio']:6.3f} {got['save_vs_raw']:9.2f} {got['load_vs_raw']:9.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
