#!/usr/bin/env python
"""Save / resharded-load benchmark on an S3-compatible object store: distckpt vs
torch.distributed.checkpoint (fsspec / s3fs) vs raw multipart uploads and ranged GETs.

The driver (``python benchmarks/bench_s3.py ...``) starts a local S3-compatible server
(moto's stand-alone server, ``tests/support/s3_server.py``, on 127.0.0.1 and a free port, with a
bucket ``bench``), passes its endpoint and test credentials (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ...) to torchrun workers (this same file, ``--worker SPEC``; gloo,
``OMP_NUM_THREADS=1``, ``GLOO_SOCKET_IFNAME=lo``), collects what rank 0 of each launch
reports and prints a table and ratios (see benchmarks/README.md).

Contenders, all on identical data (case A of bench_engine.py: float32 DTensors Shard(0)):

* ``distckpt``: ``distckpt.save(state, "s3://bench/...", comm)`` / ``distckpt.load``;
* ``dcp``: ``torch.distributed.checkpoint.save/load`` with ``FsspecWriter`` /
  ``FsspecReader`` on ``s3://bench/...`` (s3fs; it finds the endpoint in
  ``AWS_ENDPOINT_URL`` through botocore); one file per rank, ``thread_count`` = distckpt's
  I/O worker count;
* ``obstore``: distckpt with obstore's S3 client (:class:`distckpt.storage.cloud.CloudStore`,
  the store of ``az://`` and ``gs://``) in place of boto3, to compare the two clients;
* ``raw``: the limit of this server. Save: every rank uploads its local shards back to
  back as ONE object with a multipart upload of 8 MiB parts (``--part-mib``) sent by as
  many threads as distckpt uses (its default against an object store, or --io-workers), no
  checksums (botocore's default CRC32 of each request body is switched off). Load on M
  ranks: reader j fetches the j-th 1/M byte range of the concatenation of the writers'
  objects with parallel ranged GETs of at most one part each, read straight into a
  pre-touched buffer (the same total bytes, no checksum, no reshaping).

Case A: 16 tensors of (4096 * gib) x 4096 float32 (``--gib``, default 1 GiB) saved on
4 ranks, loaded on 2 and on 3 ranks (resharded). Each round: a save launch (4 ranks;
untimed warm-up save of every contender, then one timed save of each, order rotated
every round; a contender's warm-up copy is deleted right before its timed save) -> a
load launch on 2 ranks -> one on 3 ranks (each: an untimed verified warm-up load of every
contender, then timed loads, rotated order) -> the round's objects are deleted.

Timing and correctness as in bench_engine.py (:func:`harness.timed`; the same closed-form
values and verify helpers: every load is checked, any mismatch aborts the run).
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import bench_engine as be
import harness as h

# distckpt through boto3 (its s3:// store), DCP, raw; and distckpt through obstore's S3
# client (the client of its az:// and gs:// store), to choose the client by measurement.
CONTENDERS = (*be.CONTENDERS, "obstore")
BUCKET = "bench"

# --------------------------------------------------------------------------- raw S3


def raw_client() -> Any:
    """A boto3 client like distckpt's (pool, retries) without request checksums."""
    import boto3
    from botocore.config import Config

    cfg = Config(
        max_pool_connections=64,
        retries={"mode": "standard", "max_attempts": 8},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.session.Session().client("s3", config=cfg)


def split_url(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key.rstrip("/")


def raw_save(state: dict[str, Any], url: str, rank: int, workers: int, part: int) -> int:
    """This rank's shards, concatenated, as one object: a multipart upload of ``part``
    bytes per part, ``workers`` threads. Returns the bytes uploaded."""
    from distckpt.transfer.arrays import host_array

    cli = raw_client()
    bucket, prefix = split_url(url)
    key = f"{prefix}/rank{rank:05d}.bin"
    views = [memoryview(host_array(dt.to_local()).reshape(-1).view("u1")) for dt in state.values()]
    total = sum(v.nbytes for v in views)
    starts = []
    pos = 0
    for v in views:
        starts.append(pos)
        pos += v.nbytes

    def body(n: int) -> Any:
        lo, hi = n * part, min(total, (n + 1) * part)
        pieces = []
        for v, s in zip(views, starts, strict=True):
            a, b = max(lo, s), min(hi, s + v.nbytes)
            if a < b:
                pieces.append(v[a - s : b - s])
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    nparts = max(1, -(-total // part))
    up = cli.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

    def send(n: int) -> dict[str, Any]:
        r = cli.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=n + 1, Body=body(n))
        return {"PartNumber": n + 1, "ETag": r["ETag"]}

    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(send, range(nparts)))
    cli.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=up, MultipartUpload={"Parts": parts}
    )
    return total


def raw_load(
    spec: dict[str, Any], url: str, writers: int, rank: int, world: int, buf, workers: int
) -> int:
    """This reader's byte range of the writers' objects into ``buf`` (uint8) with parallel
    ranged GETs of at most ``spec['part']`` bytes. Returns the bytes read."""
    cli = raw_client()
    bucket, prefix = split_url(url)
    part = spec["part"]
    start, end = be.raw_share(spec, rank, world)
    sizes = [
        sum(n * spec["cols"] * 4 for _, _, n in lay) for lay in be.writer_layout(spec, writers)
    ]
    gets = []  # (key, offset in object, offset in buf, length)
    pos = 0
    for w, size in enumerate(sizes):
        lo, hi = max(start, pos), min(end, pos + size)
        off = lo
        while off < hi:
            n = min(part, hi - off)
            gets.append((f"{prefix}/rank{w:05d}.bin", off - pos, off - start, n))
            off += n
        pos += size
    mv = memoryview(buf)

    def get(g: tuple[str, int, int, int]) -> int:
        key, at, dst, n = g
        r = cli.get_object(Bucket=bucket, Key=key, Range=f"bytes={at}-{at + n - 1}")
        stream, filled = r["Body"], 0
        while filled < n:
            k = stream.readinto(mv[dst + filled : dst + n])
            if not k:
                raise OSError(f"short ranged GET of {key} at {at + filled}")
            filled += k
        return filled

    with ThreadPoolExecutor(workers) as pool:
        return sum(pool.map(get, gets))


def delete_prefix(cli: Any, url: str) -> int:
    """Delete every object (and pending multipart upload) under ``url``'s prefix."""
    bucket, prefix = split_url(url)
    prefix += "/"
    n = 0
    for page in cli.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        objs = [{"Key": o["Key"]} for o in page.get("Contents", ())]
        for i in range(0, len(objs), 1000):
            cli.delete_objects(Bucket=bucket, Delete={"Objects": objs[i : i + 1000]})
            n += len(objs[i : i + 1000])
    for u in cli.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", ()):
        cli.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
    return n


# --------------------------------------------------------------------------- worker


class Worker(h.RankWorker):
    """A save launch or a load launch of case A against s3://bench/..."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__(spec)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        self.FsspecReader, self.FsspecWriter = FsspecReader, FsspecWriter
        # What distckpt uses against an object store (its default, or --io-workers); DCP
        # and raw get as many threads.
        from distckpt.transfer.workers import resolve_io_workers

        self.workers = resolve_io_workers(None, network=True)
        self.out["io_workers"] = self.workers

    def run(self) -> None:
        {"save": self.run_save, "load": self.run_load}[self.spec["mode"]]()

    @staticmethod
    def location(who: str, url: str) -> Any:
        if who != "obstore":
            return url
        from distckpt.storage.cloud import CloudStore

        bucket, key = split_url(url)
        return CloudStore("s3", bucket, key)

    def save(self, who: str, state: dict[str, Any], url: str) -> Any:
        if who in ("distckpt", "obstore"):
            res = self.distckpt.save(state, self.location(who, url), comm=self.comm)
            return {"timings": res.timings, "bytes": res.bytes_written, "files": res.files_written}
        if who == "dcp":
            writer = self.FsspecWriter(url, thread_count=self.workers)
            self.dcp.save(state, storage_writer=writer)
            return None
        raw_save(state, url, self.rank, self.workers, self.spec["part"])
        return None

    def load(self, who: str, state: dict[str, Any], url: str, buf, writers: int) -> Any:
        if who in ("distckpt", "obstore"):
            res = self.distckpt.load(state, self.location(who, url), comm=self.comm)
            return {"timings": res.timings, "bytes": res.bytes_read}
        if who == "dcp":
            self.dcp.load(state, storage_reader=self.FsspecReader(url))
            return None
        got = raw_load(self.spec, url, writers, self.rank, self.world, buf, self.workers)
        return {"bytes": got}

    def verify_load(self, who: str, state, buf, writers: int, salt: int) -> None:
        if who == "raw":
            err = be.raw_verify(self.spec, writers, self.rank, self.world, buf, salt)
        else:
            err = be.verify(self.spec, state, self.rank, self.world, salt)
        self.check(err, f"{who} load on {self.world} ranks")

    def raw_buffer(self) -> Any:
        import numpy as np

        start, end = be.raw_share(self.spec, self.rank, self.world)
        buf = np.empty(end - start, dtype=np.uint8)
        buf.fill(0)  # touched, like the DTensor targets
        return buf

    def reset_for(self, who: str, state, buf) -> None:
        if who == "raw":
            buf.fill(0)
        else:
            for dt in state.values():
                dt.to_local().fill_(-1.0)

    def delete(self, *urls: str) -> None:
        """Rank 0 deletes everything under ``urls`` between two barriers."""
        self.barrier()
        if self.rank == 0:
            cli = raw_client()
            for u in urls:
                delete_prefix(cli, u)
        self.barrier()

    def run_save(self) -> None:
        spec = self.spec
        src = be.make_state(spec, self.mesh, fill=True)
        warm = {c: f"{spec['base']}/warmup-{c}" for c in CONTENDERS}
        if spec["warmup"]:
            for who in spec["order"]:
                self.save(who, src, warm[who])
                self.barrier()
        for who in spec["order"]:
            if spec["warmup"]:
                self.delete(warm[who])  # untimed; bounds the server's memory
            sec = h.timed(self, lambda who=who: self.save(who, src, spec["paths"][who]))
            ev = {"op": "save", "who": who, "world": self.world, "span": sec.marks[-1]}
            ev.update(sec.fields(), io_workers=self.workers)
            res = sec.results[0]
            if res is not None:
                ev["timings_max"] = self.allmax(res["timings"])
                ev["timings_rank0"] = res["timings"]
                ev["files_rank0"] = res["files"]
            self.out["events"].append(ev)

    def run_load(self) -> None:
        spec = self.spec
        writers = spec["saved_world"]
        paths = spec["paths"]
        state = be.make_state(spec, self.mesh, fill=False)
        buf = self.raw_buffer()
        if spec["warmup"]:
            for who in spec["order"]:  # warm-up, verified too
                self.reset_for(who, state, buf)
                self.load(who, state, paths[who], buf, writers)
                self.verify_load(who, state, buf, writers, salt=spec["round"] + 101)
        for who in spec["order"]:
            self.reset_for(who, state, buf)
            sec = h.timed(self, lambda who=who: self.load(who, state, paths[who], buf, writers))
            self.verify_load(who, state, buf, writers, spec["round"])
            ev = {"op": f"load{writers}->{self.world}", "who": who, "world": self.world}
            ev.update(span=sec.marks[-1], **sec.fields(), io_workers=self.workers)
            res = sec.results[0]
            if res is not None:
                ev["bytes_max"] = self.allmax({"b": float(res["bytes"])})["b"]
                if "timings" in res:
                    ev["timings_max"] = self.allmax(res["timings"])
            self.out["events"].append(ev)


# --------------------------------------------------------------------------- driver


class Driver(h.Driver):
    """Starts the S3 server; per round a save launch and a load launch per world size."""

    name = "bench_s3"

    def describe(self) -> str:
        a = self.args
        return (
            f"case A {a.a_tensors} x {a.a_rows}x{a.a_cols} f32 ({a.gib:g} GiB), "
            f"save {a.a_save_world} -> load {a.a_load_worlds}, {a.rounds} rounds, "
            f"{a.part_mib} MiB parts"
        )

    def env(self) -> dict[str, Any]:
        import importlib.metadata as md

        vers = {}
        for m in ("boto3", "botocore", "s3fs", "fsspec", "moto"):
            try:
                vers[m] = md.version(m)
            except md.PackageNotFoundError:
                vers[m] = None
        return {"server": "moto stand-alone (tests/support/s3_server.py) on 127.0.0.1", **vers}

    def launch(self, nproc: int, spec: dict[str, Any], label: str) -> list[dict[str, Any]]:
        busy = self.wait_idle()
        # obstore's S3 client: plain http to the local server, conditional puts by ETag.
        env = {**h.TORCHRUN_ENV, **self.server.env, "AWS_CONDITIONAL_PUT": "etag"}
        env["DISTCKPT_CLOUD_ALLOW_HTTP"] = "1"
        if self.args.io_workers:
            env["DISTCKPT_IO_WORKERS"] = str(self.args.io_workers)
        out, wall, m = self.launch_worker(h.torchrun(nproc), __file__, spec, label, env)
        events = out["events"]
        for e in events:
            e["busy_before_launch"] = busy
        print(
            f"  {label}: {wall:.1f}s launch, {out.get('io_workers')} io workers; "
            + ", ".join(f"{e['op']} {e['who']} {e['span']:.2f}s" for e in events)
            + f"  [avail {m['MemAvailable']:.1f} GiB, other CPU before {busy:.0%}, "
            f"during timed max {max((e['foreign_cpu'] for e in events), default=0):.0%}]",
            flush=True,
        )
        return events

    def run(self) -> None:
        sys.path.insert(0, str(h.ROOT))
        from tests.support.s3_server import S3Server

        a = self.args
        with S3Server(buckets=[BUCKET]) as server:
            self.server = server
            cli = server.client()
            print(f"== S3 server {server.endpoint} (moto), bucket {BUCKET}", flush=True)
            orders = h.rotations(CONTENDERS, a.rounds)
            for rnd in range(a.rounds):
                base = f"s3://{BUCKET}/r{rnd}"
                paths = {c: f"{base}/{c}-A" for c in CONTENDERS}
                spec0 = {
                    "ntensors": a.a_tensors,
                    "rows": a.a_rows,
                    "cols": a.a_cols,
                    "base": base,
                    "paths": paths,
                    "saved_world": a.a_save_world,
                    "part": a.part_mib << 20,
                    "warmup": a.warmup,
                    "round": rnd,
                }
                print(f" case A round {rnd + 1}/{a.rounds} order {orders[rnd]}", flush=True)
                spec = {**spec0, "mode": "save", "order": orders[rnd]}
                events = self.launch(a.a_save_world, spec, f"A-r{rnd}-save")
                for k, m in enumerate(a.a_load_worlds):
                    order = orders[(rnd + 1 + k) % len(orders)]
                    spec = {**spec0, "mode": "load", "order": order}
                    events += self.launch(m, spec, f"A-r{rnd}-load{m}")
                self.events += [
                    {"case": "A", "dir": "s3", "fs": "s3", "round": rnd, **e} for e in events
                ]
                delete_prefix(cli, base)


# --------------------------------------------------------------------------- report


def summarize(args: argparse.Namespace, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (op, world, contender): the spread of the times; ratios and targets."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for e in events:
        groups.setdefault((e["op"], e["world"], e["who"]), []).append(e)
    nbytes = args.a_tensors * args.a_rows * args.a_cols * 4
    rows = []
    for (op, world, who), es in sorted(groups.items()):
        spans = [e["span"] for e in es]
        row = {"case": "A", "fs": "s3", "op": op, "world": world, "who": who}
        row.update(h.spread(spans), bytes=nbytes, GiBps=nbytes / h.GiB / h.med(spans))
        row.update(spans=spans, other_cpu_median=h.med([e.get("foreign_cpu", 0.0) for e in es]))
        row["io_workers"] = sorted({e.get("io_workers") for e in es} - {None})
        tm = [e["timings_max"] for e in es if "timings_max" in e]
        if tm:
            keys = [k for k in tm[0] if all(k in t for t in tm)]
            row["phases_median_max_over_ranks"] = {k: h.med([t[k] for t in tm]) for k in keys}
        rows.append(row)

    s = args.a_save_world
    ops = [("save", s)] + [(f"load{s}->{m}", m) for m in args.a_load_worlds]
    specs = []  # (label, op, world, denominator, target)
    for op, m in ops:
        specs.append((f"A {op} thr distckpt/dcp", op, m, "dcp", (">=", 2.0)))
    for op, m in ops:
        specs.append((f"A {op} thr distckpt/raw", op, m, "raw", None))
    for op, m in ops:
        specs.append((f"A {op} thr dcp/raw", op, m, "raw", None, "dcp"))
    for op, m in ops:
        specs.append((f"A {op} thr obstore/boto3", op, m, "distckpt", None, "obstore"))
    ratios = []
    for label, op, world, den, goal, *num in specs:
        per_round = [
            {e.get("round"): e["span"] for e in groups.get((op, world, who), [])}
            for who in (num[0] if num else "distckpt", den)
        ]
        q = h.ratio(*per_round, throughput=True)
        if q is not None:
            ratios.append({"label": label, "fs": "s3", **q, **h.target(q["value"], goal)})
    return {"rows": rows, "ratios": ratios}


def print_report(summary: dict[str, Any]) -> None:
    rows, ratios = summary["rows"], summary["ratios"]
    print()
    print(
        f"{'op':10} {'world':>5} {'who':9} {'n':>2} {'median s':>9} {'min s':>8} {'max s':>8} "
        f"{'MiB/s':>7} {'oth%':>5}"
    )
    for r in rows:
        print(
            f"{r['op']:10} {r['world']:>5} {r['who']:9} {r['n']:>2} {r['median_s']:9.3f} "
            f"{r['min_s']:8.3f} {r['max_s']:8.3f} {1024 * r['GiBps']:7.1f} "
            f"{100 * r['other_cpu_median']:5.0f}"
        )
    print()
    print("throughput ratios (>= 1: the first is faster); target: distckpt >= 2x DCP")
    h.print_fs_ratios(ratios)
    h.print_phases(
        rows, lambda r: f"{r['op']:10} world {r['world']:>2}:", "phases_median_max_over_ranks"
    )


# --------------------------------------------------------------------------- main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    h.common_args(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--gib", type=float, default=1.0, help="data size: 16 tensors of (4096*gib) x 4096 f32"
    )
    p.add_argument("--a-tensors", type=int, default=16)
    p.add_argument("--a-cols", type=int, default=4096)
    p.add_argument("--a-save-world", type=int, default=4)
    p.add_argument("--a-load-worlds", type=int, nargs="+", default=[2, 3])
    p.add_argument("--part-mib", type=int, default=8, help="raw multipart part size (MiB)")
    p.add_argument(
        "--io-workers",
        type=int,
        default=0,
        help="set DISTCKPT_IO_WORKERS for the workers (all contenders use that count); "
        "default: distckpt's own default per rank",
    )
    p.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the untimed warm-up save/load of each contender in each launch",
    )
    args = p.parse_args(argv)
    args.a_rows = max(1, round(4096 * args.gib * 4096 / args.a_cols * 16 / args.a_tensors))
    return args


if __name__ == "__main__":
    h.main(parse(), Driver, summarize, print_report, Worker.main)
