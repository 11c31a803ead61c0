"""Hugging Face weights: distckpt against the safetensors library and the raw limit.

One process on this machine, a synthetic Llama-like set of tensors (``--gib`` in total,
bfloat16) in ``save_pretrained``'s layout under ``--dir`` (default /dev/shm). Contenders
alternate over ``--rounds`` (each takes every position in turn); medians are compared:

* load: ``distckpt.load_hf`` into preallocated tensors; ``safetensors``: ``load_file`` of
  each file then ``copy_`` into the same tensors (what ``load_state_dict(load_file(f))``
  does); ``raw``: ``readinto`` of every file into one preallocated buffer;
* save, each into an emptied directory: ``distckpt.save_hf``; ``safetensors``:
  ``save_file`` of each file's tensors (what ``save_pretrained`` does); ``raw``: ``write``
  of the same bytes, fsynced like the others;
* import, in a fresh process each: growth of peak resident memory (file-backed pages
  included) of ``distckpt import`` (streamed: the staging slabs, 256 MiB by default,
  whatever the model's size) against the whole-model import (``load_file`` of every
  file, memory-mapped by safetensors, then ``distckpt.save``).

    python benchmarks/bench_hf.py --gib 1 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from harness import LOCK, MiB, exclusive, med, rotations

import distckpt
from distckpt.comm import SingleComm

COMM = SingleComm()


def make_state(gib: float) -> dict[str, torch.Tensor]:
    """Layers of attention and MLP weights (bfloat16) adding up to about ``gib``."""
    hidden = 2048
    per_layer = (4 * hidden * hidden + 3 * hidden * 5632) * 2
    layers = max(1, round(gib * (1 << 30) / per_layer))
    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(layers):
        for name, shape in [
            ("self_attn.q_proj", (hidden, hidden)),
            ("self_attn.k_proj", (hidden, hidden)),
            ("self_attn.v_proj", (hidden, hidden)),
            ("self_attn.o_proj", (hidden, hidden)),
            ("mlp.gate_proj", (5632, hidden)),
            ("mlp.up_proj", (5632, hidden)),
            ("mlp.down_proj", (hidden, 5632)),
        ]:
            t = torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
            state[f"model.layers.{i}.{name}.weight"] = t
    return state


def files_of(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def fsync_dir_files(directory: Path) -> None:
    for f in directory.iterdir():
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())


def load_contenders(src: Path, state: dict[str, torch.Tensor]) -> dict[str, Callable[[], None]]:
    from safetensors.torch import load_file

    total = sum(f.stat().st_size for f in files_of(src))
    buffer = bytearray(total)

    def distckpt_load() -> None:
        distckpt.load_hf(state, src, COMM)

    def safetensors_load() -> None:
        for f in files_of(src):
            for name, t in load_file(f).items():
                state[name].copy_(t)

    def raw() -> None:
        view, at = memoryview(buffer), 0
        for f in files_of(src):
            with open(f, "rb", buffering=0) as fh:
                at += fh.readinto(view[at:])

    return {"distckpt": distckpt_load, "safetensors": safetensors_load, "raw": raw}


def save_contenders(
    out: Path, state: dict[str, torch.Tensor], max_bytes: int
) -> dict[str, Callable[[], float]]:
    """Each writes into an emptied directory of its own (emptying it is not timed) and
    returns its seconds."""
    from safetensors.torch import save_file

    from distckpt.hf.directory import plan_files

    plan = plan_files([(n, "bfloat16", tuple(t.shape)) for n, t in state.items()], max_bytes)

    def emptied(name: str) -> Path:
        target = out / name
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        return target

    def distckpt_save() -> float:
        target = emptied("distckpt")
        t0 = time.perf_counter()
        distckpt.save_hf(state, target, COMM, max_shard_size=max_bytes)
        return time.perf_counter() - t0

    def safetensors_save() -> float:
        target = emptied("safetensors")
        t0 = time.perf_counter()
        for f in plan:
            save_file({t.name: state[t.name] for t in f.tensors}, target / f.name)
        fsync_dir_files(target)
        return time.perf_counter() - t0

    def raw() -> float:
        target = emptied("raw")
        t0 = time.perf_counter()
        for f in plan:
            with open(target / f.name, "wb", buffering=0) as fh:
                for t in f.tensors:
                    fh.write(state[t.name].view(torch.uint8).numpy().data)
                os.fsync(fh.fileno())
        return time.perf_counter() - t0

    return {"distckpt": distckpt_save, "safetensors": safetensors_save, "raw": raw}


_IMPORT = """
import sys, torch
from pathlib import Path
import distckpt
from distckpt.comm import SingleComm

def peak():  # bytes resident at most so far, file-backed pages included
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

src, out, how = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
base = peak()
if how == "streamed":
    from distckpt.tools.importer import import_checkpoint
    import_checkpoint(src, out, overwrite=True)
else:
    from safetensors.torch import load_file
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    distckpt.save(state, out, SingleComm(), overwrite=True)
print(peak() - base)
"""


def import_memory(src: Path, out: Path) -> dict[str, int]:
    peaks = {}
    for how in ("streamed", "whole"):
        proc = subprocess.run(
            [sys.executable, "-c", _IMPORT, str(src), str(out / how), how],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        peaks[how] = int(proc.stdout.split()[-1])
    return peaks


def timed_rounds(contenders: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds per round of each contender: what it returns, else its whole call."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for order in rotations(list(contenders), rounds):
        for name in order:
            t0 = time.perf_counter()
            own = contenders[name]()
            times[name].append(own if own is not None else time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="total bytes of weights (GiB)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--dir", default="/dev/shm", help="where to write (default /dev/shm)")
    p.add_argument("--file-mib", type=int, default=256, help="max size of one file (MiB)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    _lock = exclusive(LOCK)
    root = Path(tempfile.mkdtemp(prefix="bench_hf-", dir=args.dir))
    try:
        state = make_state(args.gib)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        src = root / "src"
        distckpt.save_hf(state, src, COMM, max_shard_size=args.file_mib * MiB)
        print(f"{len(state)} tensors, {nbytes / MiB:.0f} MiB in {len(files_of(src))} files")
        targets = {n: torch.empty_like(t) for n, t in state.items()}
        results: dict[str, dict[str, list[float]]] = {
            "load": timed_rounds(load_contenders(src, targets), args.rounds),
            "save": timed_rounds(save_contenders(root, state, args.file_mib * MiB), args.rounds),
        }
        assert all(torch.equal(targets[n], state[n]) for n in state)
        peaks = import_memory(src, root / "imported")
        print(f"{'':6} {'distckpt s':>11} {'/ safetensors':>14} {'/ raw':>8}")
        for op, times in results.items():
            d, s, r = (med(times[k]) for k in ("distckpt", "safetensors", "raw"))
            print(f"{op:6} {d:11.3f} {d / s:14.2f} {d / r:8.2f}")
        print(
            f"import peak RSS growth: streamed {peaks['streamed'] / MiB:.0f} MiB, whole "
            f"{peaks['whole'] / MiB:.0f} MiB "
            f"(ratio {peaks['streamed'] / max(1, peaks['whole']):.3f}) "
            f"for {nbytes / MiB:.0f} MiB of weights"
        )
        if args.json:
            doc = {"gib": args.gib, "bytes": nbytes, "times": results, "import_peak": peaks}
            Path(args.json).write_text(json.dumps(doc, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
