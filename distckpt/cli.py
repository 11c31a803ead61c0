"""The ``distckpt`` command (also ``python -m distckpt``).

    distckpt inspect CKPT [--json]   the variables of a checkpoint
    distckpt gc DIR                  remove leftovers of aborted saves, nothing else

Bad input gives a one-line error and a non-zero exit, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys

from distckpt.errors import CheckpointError


def _inspect(args: argparse.Namespace) -> int:
    from distckpt import dtypes
    from distckpt.storage import index as index_mod

    index = index_mod.read_index(args.checkpoint)
    rows = []
    for name, entry in sorted(index["variables"].items()):
        if entry["kind"] == "tensor":
            nbytes = math.prod(entry["shape"]) * dtypes.itemsize(entry["dtype"])
            slices = [p["box"] for p in entry["pieces"]]
            rows.append(
                {
                    "name": name,
                    "kind": "tensor",
                    "dtype": entry["dtype"],
                    "shape": entry["shape"],
                    "layout": entry["layout"],
                    "bytes": nbytes,
                    "slices": slices,
                }
            )
        else:
            rows.append({"name": name, "kind": entry["kind"]})
    if args.json:
        print(json.dumps({"world_size": index.get("world_size"), "variables": rows}, indent=1))
        return 0
    print(f"{args.checkpoint}: {len(rows)} variables, saved on {index.get('world_size')} ranks")
    for row in rows:
        if row["kind"] == "tensor":
            print(
                f"  {row['name']}  {row['dtype']}{row['shape']}  {row['layout']}, "
                f"{len(row['slices'])} slice(s), {row['bytes']} bytes"
            )
        else:
            print(f"  {row['name']}  ({row['kind']})")
    return 0


def _gc(args: argparse.Namespace) -> int:
    from distckpt.storage.staging import collect_garbage

    removed = collect_garbage(args.directory)
    for path in removed:
        print(f"removed {path}")
    if not removed:
        print("nothing to remove")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="distckpt", description="Inspect and tidy distckpt checkpoints."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="list the variables of a checkpoint")
    p.add_argument("checkpoint")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("gc", help="remove leftovers of aborted saves (and nothing else)")
    p.add_argument("directory")
    p.set_defaults(func=_gc)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="distckpt: %(message)s")
    try:
        return int(args.func(args))
    except (CheckpointError, OSError) as exc:
        print(f"distckpt {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
