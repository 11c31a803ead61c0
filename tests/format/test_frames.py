"""Compressed frames are checked before a decoder reads them (distckpt.format.frames):
every frame zstd and blosc make passes; a frame whose header lies about a size, a block
or a stream fails with FrameError; and no header byte, whatever its value, kills the
process (the sweep runs in a child and checks how it ended)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numcodecs
import numpy as np
import pytest

from distckpt.format import codecs, frames


def payloads() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for size in (1, 7, 127, 128, 1000, 65536, (1 << 20) + 3):
        out.append(rng.integers(0, 256, size, dtype=np.uint8))  # incompressible
        out.append(np.zeros(size, np.uint8))  # runs
        out.append((np.arange(size) % 251).astype(np.uint8))  # structure
        out.append(rng.standard_normal(-(-size // 2)).astype(np.float16).view(np.uint8)[:size])
    return out


CODECS = [
    codecs.Zstd(),
    codecs.Zstd(level=1),
    codecs.Zstd(level=9, checksum=True),
    *(codecs.make(choice, size) for choice in ("blosc-lz4", "blosc-zstd") for size in (1, 2, 4, 8)),
    codecs.Blosc(typesize=4, cname="lz4", shuffle="noshuffle"),
    codecs.Blosc(typesize=16, cname="zstd", clevel=1),
    codecs.Blosc(typesize=2, cname="lz4", blocksize=4096),
]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: repr(c)[:60])
def test_every_frame_the_codecs_make_passes_and_decodes_exactly(codec: codecs.Codec) -> None:
    for raw in payloads():
        stored = np.frombuffer(codec.encode(raw), np.uint8)
        out = np.full(raw.nbytes, 0xAB, np.uint8)
        codec.decode(stored, out)
        assert np.array_equal(out, raw)


def test_a_frame_of_fewer_bytes_than_the_chunk_is_refused() -> None:
    """A valid frame of 16 bytes in place of a 1 MiB chunk decoded "successfully" into the
    first 16 bytes of the output, leaving the rest as it was."""
    for codec in (codecs.Zstd(), codecs.make("blosc-lz4", 4), codecs.make("blosc-zstd", 2)):
        short = np.frombuffer(codec.encode(np.ones(16, np.uint8)), np.uint8)
        out = np.full(1 << 20, 0xAB, np.uint8)
        with pytest.raises(frames.FrameError, match="16 bytes of content, expected 1048576"):
            codec.decode(short, out)
        assert (out == 0xAB).all()  # nothing decoded


def zstd_frame(raw: bytes) -> bytearray:
    return bytearray(codecs.Zstd().encode(np.frombuffer(raw, np.uint8)))


@pytest.mark.parametrize(
    "lie, message",
    [
        (lambda f: f.__setitem__(slice(0, 4), b"\x50\x2a\x4d\x18"), "no magic"),  # skippable
        (lambda f: f.__setitem__(4, f[4] | 0x08), "reserved"),
        (lambda f: f.__setitem__(4, f[4] | 0x01), "dictionary"),
        (lambda f: f.extend(zstd_frame(b"x" * 10)), "ends at byte"),  # a second frame
        (lambda f: f.__delitem__(slice(-1, None)), "past the stored bytes|ends at byte"),
        (lambda f: f.extend(b"\0\0\0\0"), "ends at byte"),
    ],
)
def test_zstd_frames_that_lie_are_refused(lie, message) -> None:  # type: ignore[no-untyped-def]
    raw = bytes(range(256)) * 1024
    frame = zstd_frame(raw)
    lie(frame)
    with pytest.raises(frames.FrameError, match=message):
        frames.check_zstd(np.frombuffer(bytes(frame), np.uint8), len(raw))


def test_a_zstd_frame_without_its_content_size_is_refused() -> None:
    """numcodecs decodes a frame of unknown size into whatever the output holds."""
    import zlib  # noqa: F401  (only to show no other decoder is involved)

    # A raw block frame made by hand: magic, descriptor without a content size (a window
    # descriptor instead), one last raw block of 5 bytes.
    frame = (
        frames.ZSTD_MAGIC.to_bytes(4, "little")
        + bytes([0x00, 0x00])
        + ((5 << 3) | 1).to_bytes(3, "little")
        + b"hello"
    )
    with pytest.raises(frames.FrameError, match="content size"):
        frames.check_zstd(np.frombuffer(frame, np.uint8), 5)


def blosc_frame(raw: np.ndarray, cname: str = "lz4", typesize: int = 4) -> bytearray:
    return bytearray(codecs.Blosc(typesize=typesize, cname=cname).encode(raw))


@pytest.mark.parametrize(
    "offset, value, message",
    [
        (0, 1, "format version 1"),
        (2, 0x08, "from the future"),
        (4, 0, "0 bytes of content"),  # nbytes (low byte 0 and the rest: changed)
        (12, 0x7FFF0000, "says it is 2147418112 bytes"),  # cbytes beyond the buffer
        (8, 0, "block size 0"),
        (16, 0x40000000, "starts outside"),  # a block start far away
        (16, 4, "starts outside"),  # a block start inside the header
        (3, 2, "elements of 2 bytes, not 4"),  # the same streams, put back in another order
        (2, 0x04, "shuffle flags"),  # bit shuffle besides byte shuffle
    ],
)
def test_blosc_headers_that_lie_are_refused(offset: int, value: int, message: str) -> None:
    raw = np.random.default_rng(1).standard_normal(1 << 17).astype(np.float32).view(np.uint8)
    frame = blosc_frame(raw)
    if offset < 4:
        frame[offset] = value if offset != 2 else frame[offset] | value
    else:
        frame[offset : offset + 4] = value.to_bytes(4, "little")
    with pytest.raises(frames.FrameError, match=message):
        frames.check_blosc(np.frombuffer(bytes(frame), np.uint8), raw.nbytes, "lz4", 4, "shuffle")


def test_a_blosc_stream_length_that_runs_past_the_frame_is_refused() -> None:
    raw = np.random.default_rng(2).standard_normal(1 << 16).astype(np.float32).view(np.uint8)
    frame = blosc_frame(raw)
    first = int.from_bytes(frame[16:20], "little")
    frame[first : first + 4] = (len(frame)).to_bytes(4, "little")
    with pytest.raises(frames.FrameError, match="runs past"):
        frames.check_blosc(np.frombuffer(bytes(frame), np.uint8), raw.nbytes, "lz4", 4, "shuffle")


SWEEP = textwrap.dedent(
    """
    import numpy as np
    from distckpt.format import codecs

    rng = np.random.default_rng(3)
    raw = rng.standard_normal(1 << 16).astype(np.float32).view(np.uint8)
    cases = 0
    for codec in (codecs.make("blosc-lz4", 4), codecs.make("blosc-zstd", 4), codecs.Zstd()):
        frame = bytes(codec.encode(raw))
        span = 16 + 4 * 8 + 8 if codec.name == "blosc" else 24
        for at in range(min(span, len(frame))):
            for value in (0x00, 0x01, 0x7F, 0x80, 0xFF, frame[at] ^ 0x10):
                bad = bytearray(frame)
                bad[at] = value
                # a big-endian 0x7f.. at every 4-byte field start as well
                variants = [bad]
                if at % 4 == 0 and at + 4 <= len(frame):
                    wide = bytearray(frame)
                    wide[at : at + 4] = b"\\xff\\xff\\xff\\x7f"
                    variants.append(wide)
                if codec.name == "blosc" and at in (4, 8, 12):  # a size, and each block start
                    for start in range(16, 16 + 4 * 8, 4):
                        pair = bytearray(frame)
                        pair[at : at + 4] = (0x7FFF0000).to_bytes(4, "little")
                        pair[start : start + 4] = (0x40000000).to_bytes(4, "little")
                        variants.append(pair)
                for variant in variants:
                    out = np.empty(raw.nbytes, np.uint8)
                    cases += 1
                    try:  # (data bytes changed decode to other values: the crc32c's job)
                        codec.decode(np.frombuffer(bytes(variant), np.uint8), out)
                    except (ValueError, RuntimeError):
                        pass
    print("OK", cases, flush=True)
    """
)


def test_no_header_byte_kills_the_process() -> None:
    """Every byte of the first headers of a blosc-lz4, blosc-zstd and zstd frame set to
    edge values (0x7fffffff at each 4-byte field; a blosc size and a block start lying
    together), decoded without the crc32c that would stop most of them first: the child
    ends normally (before the checks, c-blosc read outside the frame and died by SIGSEGV)."""
    run = subprocess.run([sys.executable, "-c", SWEEP], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and run.stdout.startswith("OK"), (
        run.returncode,
        run.stdout,
        run.stderr[-2000:],
    )


def test_the_bounds_are_zstds_own() -> None:
    for size in (0, 1, 1000, 128 << 10, 1 << 20):
        assert frames.zstd_bound(size) >= len(
            numcodecs.Zstd(level=1).encode(
                np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            )
        )
