"""The ``distckpt`` command (also ``python -m distckpt``).

    distckpt ls DIR [--json]            the checkpoints of a run directory
    distckpt inspect CKPT [--json]      the variables of a checkpoint
    distckpt verify CKPT [--key PUB]    re-read every byte and check every checksum (and
                                        with --key, that it is signed by a trusted key)
    distckpt sign CKPT --key KEY [--out NEW]  sign a checkpoint with a private key
    distckpt keygen KEY                 a new Ed25519 signing key (KEY, and KEY.pub)
    distckpt export CKPT OUT            one .safetensors or .pt file (streamed)
    distckpt export CKPT DIR --hf       Hugging Face weights: safetensors files and an index
    distckpt import SRC OUT             a DCP or Hugging Face directory, .pt/.pth/.bin or
                                        .safetensors file (safetensors streamed)
    distckpt diff A B                   which variables differ, and how
    distckpt gc DIR                     remove leftovers of aborted saves, nothing else

Exit status: 0 on success; 1 when ``verify`` finds a problem or ``diff`` a difference;
2 on an error (bad input: not a checkpoint, an unreadable index, a missing file), which
is reported as one line on stderr, ``distckpt CMD: error: ...``, never a traceback;
141 (128 + SIGPIPE), silently, when the reader of its output goes away (``| head``).
Everything printed that may hold text from storage (names, paths, messages) has its
control characters escaped (:func:`distckpt.terminal.printable`); ``--json`` output is
ASCII, JSON's own escapes.
On a terminal, ``verify`` and ``export`` show a progress line on stderr
(``DISTCKPT_PROGRESS=0`` turns it off).
Every DIR and CKPT may be ``s3://bucket/prefix`` (``pip install 'distckpt[s3]'``).
The work is done in :mod:`distckpt.tools`; this module parses arguments and prints.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import TextIO

from distckpt.errors import CheckpointError
from distckpt.progress import progress
from distckpt.terminal import printable

OK, NEGATIVE, ERROR = 0, 1, 2
BROKEN_PIPE = 141  # 128 + SIGPIPE: what a tool killed by the signal reports


def _ls(args: argparse.Namespace) -> int:
    from distckpt.tools.runs import list_run

    listing = list_run(args.directory)
    if listing.warning:
        _say(f"distckpt ls: warning: {listing.warning}", sys.stderr)
    if args.json:
        doc = {
            "directory": str(listing.directory),
            "latest": listing.latest,
            "checkpoints": [e.to_json() for e in listing.entries],
        }
        print(json.dumps(doc, indent=1))  # ASCII: JSON escapes every control character
        return OK
    if not listing.entries:
        _say(f"{listing.directory}: no checkpoints")
        return OK
    print(f"{'NUMBER':>8}  {'CREATED':<19}  {'BYTES':>12}  {'WORLD':>5}  {'STATE':<11}  NAME")
    for e in listing.entries:
        step = "-" if e.number is None else str(e.number)
        created = _when(e.created)
        world = "-" if e.world_size is None else str(e.world_size)
        mark = "  <- latest" if e.latest else ""
        note = f"  ({e.note})" if e.note else ""
        _say(
            f"{step:>8}  {created:<19}  {e.bytes:>12}  {world:>5}  {e.state:<11}  "
            f"{e.name}{mark}{note}"
        )
    return OK


def _inspect(args: argparse.Namespace) -> int:
    from distckpt.tools.summary import describe, format_summary

    summary = describe(args.checkpoint)
    if args.json:
        print(json.dumps(summary, indent=1))  # ASCII, as for ls
    else:
        for line in format_summary(args.checkpoint, summary):
            _say(line)
    return OK


def _verify(args: argparse.Namespace) -> int:
    from distckpt.signing.keys import trusted_keys
    from distckpt.tools.catalog import open_catalog
    from distckpt.tools.verify import stored_bytes, verify

    trusted = trusted_keys(args.key)
    total = stored_bytes(open_catalog(args.checkpoint, tiling=False))
    with progress(f"verifying {args.checkpoint}", total, threshold=0) as bar:
        report = verify(args.checkpoint, on_bytes=bar.update, trusted=trusted)
    for problem in report.problems:
        _say(f"distckpt verify: {problem}", sys.stderr)
    notes = "".join(f"; {note}" for note in report.notes)
    if not report.ok:
        _say(f"{args.checkpoint}: {len(report.problems)} problem(s) found{notes}")
        return NEGATIVE
    _say(
        f"{args.checkpoint}: ok, {report.variables} variables, {report.pieces} pieces, "
        f"{report.bytes_read} bytes read and verified{notes}"
    )
    return OK


def _sign(args: argparse.Namespace) -> int:
    from distckpt.signing.keys import SigningKey
    from distckpt.tools.catalog import open_catalog
    from distckpt.tools.sign import sign
    from distckpt.tools.verify import stored_bytes

    key = SigningKey.from_file(args.key)
    total = stored_bytes(open_catalog(args.checkpoint, tiling=False))
    with progress(f"signing {args.checkpoint}", total, threshold=0) as bar:
        report = sign(args.checkpoint, key, out=args.out, on_bytes=bar.update)
    _say(
        f"{args.out or args.checkpoint}: signed by key {report.signer} ({report.pieces} pieces, "
        f"{report.bytes_read} bytes checked and hashed with {report.algorithm})"
    )
    return OK


def _keygen(args: argparse.Namespace) -> int:
    from distckpt.signing.keys import SigningKey

    public = args.public or f"{args.key}.pub"
    key = SigningKey.generate()
    key.write(args.key, public=public)
    _say(f"wrote {args.key} (private: keep it secret) and {public} (key {key.id})")
    return OK


def _export(args: argparse.Namespace) -> int:
    from distckpt.tools.catalog import open_catalog
    from distckpt.tools.export import export

    if args.hf:
        return _export_hf(args)
    if args.prefix or args.max_shard_size:
        raise CheckpointError("--prefix and --max-shard-size apply to --hf exports only")

    total = sum(var.nbytes for var in open_catalog(args.checkpoint).tensors.values())
    with progress(f"exporting {args.out}", total, threshold=0) as bar:
        report = export(
            args.checkpoint,
            args.out,
            max_slab_bytes=args.slab_mib * 1024 * 1024,
            overwrite=args.overwrite,
            allow_pickle=args.allow_pickle,
            on_bytes=bar.update,
        )
    for skipped in report.skipped:
        _say(f"distckpt export: skipped {skipped}", sys.stderr)
    _say(
        f"wrote {report.path}: {report.tensors} tensors ({report.bytes_written} bytes), "
        f"{report.values} values"
    )
    return OK


def _export_hf(args: argparse.Namespace) -> int:
    from distckpt.comm import SingleComm
    from distckpt.hf.directory import DEFAULT_MAX_BYTES
    from distckpt.tools.export_hf import export_hf

    try:
        result = export_hf(
            args.checkpoint,
            args.out,
            SingleComm(),
            prefix=args.prefix,
            max_shard_size=args.max_shard_size or DEFAULT_MAX_BYTES,
            overwrite=args.overwrite,
        )
    except ValueError as exc:  # a bad --max-shard-size
        raise CheckpointError(str(exc)) from None
    _say(f"wrote {result.path}: {result.files_written} file(s), {result.bytes_written} bytes")
    return OK


def _import(args: argparse.Namespace) -> int:
    from distckpt.tools.importer import import_checkpoint

    result = import_checkpoint(
        args.source,
        args.out,
        allow_pickle=args.allow_pickle,
        overwrite=args.overwrite,
        prefix=args.prefix,
    )
    _say(f"saved {result.path}")
    return OK


def _diff(args: argparse.Namespace) -> int:
    from distckpt.tools.diff import diff

    differences = diff(args.a, args.b, max_slab_bytes=args.slab_mib * 1024 * 1024)
    for difference in differences:
        _say(str(difference))
    if differences:
        print(f"{len(differences)} variable(s) differ")
        return NEGATIVE
    print("identical")
    return OK


def _gc(args: argparse.Namespace) -> int:
    from distckpt.commit.transaction import collect_garbage, skipped

    removed = collect_garbage(args.directory)
    for path in removed:
        _say(f"removed {path}")
    if not removed:
        print("nothing to remove")
    for path, why in skipped(args.directory):
        print(f"skipped {path!r}: {why}")  # the name as stored, escaped
    return OK


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distckpt",
        description="Inspect, check, convert and tidy distckpt checkpoints.",
        epilog="Exit status: 0 ok; 1 verify found a problem or diff a difference; 2 error.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list the checkpoints of a run directory")
    p.add_argument("directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_ls)
    p = sub.add_parser("inspect", help="list the variables of a checkpoint")
    p.add_argument("checkpoint")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_inspect)
    p = sub.add_parser(
        "verify", help="re-read every stored byte; check checksums, sizes and coverage"
    )
    p.add_argument("checkpoint")
    p.add_argument(
        "--key",
        default=None,
        help="trusted public keys (PEM or ssh-ed25519 lines; default $DISTCKPT_TRUSTED_KEYS): "
        "the checkpoint must be signed by one of them",
    )
    p.set_defaults(func=_verify)
    p = sub.add_parser("sign", help="sign a committed checkpoint (replaces it, atomically)")
    p.add_argument("checkpoint")
    p.add_argument("--key", required=True, help="the private key file (PEM or OpenSSH)")
    p.add_argument(
        "--out", default=None, help="write the signed checkpoint there instead (object stores)"
    )
    p.set_defaults(func=_sign)
    p = sub.add_parser("keygen", help="write a new Ed25519 signing key and its public key")
    p.add_argument("key", help="the private key file to create (PEM)")
    p.add_argument("--public", default=None, help="the public key file (default KEY.pub)")
    p.set_defaults(func=_keygen)
    p = sub.add_parser(
        "export",
        help="write one consolidated file, streamed with bounded memory: .safetensors or "
        ".pt/.pth (torch.save of a flat dict; held in memory with torch older than 2.6)",
    )
    p.add_argument("checkpoint")
    p.add_argument(
        "out", help="the file to write (its suffix picks the format), or with --hf a directory"
    )
    p.add_argument(
        "--hf",
        action="store_true",
        help="write Hugging Face weights into the directory OUT: safetensors files of at most "
        "--max-shard-size, with model.safetensors.index.json when there are several "
        "(streamed, bounded memory)",
    )
    p.add_argument(
        "--prefix",
        default="",
        help="--hf: export the variables under this prefix, without it (e.g. 'net/')",
    )
    p.add_argument(
        "--max-shard-size", default=None, help="--hf: bytes per file, e.g. 5GB (the default)"
    )
    p.add_argument("--slab-mib", type=_positive, default=64, help="MiB read at once (default 64)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument(
        "--allow-pickle", action="store_true", help=".pt: include pickled values (runs code)"
    )
    p.set_defaults(func=_export)
    p = sub.add_parser(
        "import",
        help="save a DCP directory, a Hugging Face weights directory, a torch.save file or a "
        ".safetensors file as a checkpoint",
    )
    p.add_argument("source")
    p.add_argument("out", help="the checkpoint to create")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="unpickle the source (DCP metadata, torch.load(weights_only=False)): this runs "
        "code from the file, so use it only for files you trust",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--prefix", default="", help="put every name under this prefix (e.g. net/)")
    p.set_defaults(func=_import)
    p = sub.add_parser("diff", help="which variables of two checkpoints differ")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument(
        "--slab-mib", type=_positive, default=64, help="MiB compared at once, per side (default 64)"
    )
    p.set_defaults(func=_diff)
    p = sub.add_parser("gc", help="remove leftovers of aborted saves (and nothing else)")
    p.add_argument("directory")
    p.set_defaults(func=_gc)
    return parser


class _PrintableFormatter(logging.Formatter):
    """Log records as one printable line: a logged message may quote stored names."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(_PrintableFormatter("distckpt: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # The reader went away (`distckpt inspect CKPT | head`): stop quietly, as the
        # shell's own tools do, with their status (128 + SIGPIPE); stdout goes nowhere
        # from here, so the flush at exit raises nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
    except (CheckpointError, OSError, ImportError) as exc:  # (an extra not installed)
        _say(f"distckpt {args.command}: error: {_one_line(exc)}", sys.stderr)
        return ERROR


def _say(line: str, stream: TextIO | None = None) -> None:
    """Print one line whose text may come from storage, every control character escaped
    (:func:`distckpt.terminal.printable`): a stored name never reaches a terminal raw."""
    print(printable(line), file=stream or sys.stdout)


def _when(seconds: float | None) -> str:
    """A time read from storage, as local time ("-" when unknown or not a time)."""
    if seconds is None:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))
    except (TypeError, ValueError, OverflowError, OSError):
        return "-"


def _one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line: its lines joined. Only newlines are joined:
    other whitespace may be part of a stored name, and is escaped when printed."""
    text = " ".join(line.strip(" \t") for line in str(exc).split("\n") if line.strip(" \t"))
    return text or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
