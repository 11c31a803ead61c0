"""Signed checkpoints (:mod:`distckpt.signing`): a save given a private key signs; a reader
given trusted keys refuses anything else.

One small checkpoint holds every layout a save writes on one process: a regular array of
several shards and inner chunks, a compressed one, a plain chunk, a per-rank tensor and
values. Against it:

* every stored byte: one bit flipped anywhere in any file (sampled across every file,
  headers, tables, chunks and indexes included) is refused by a load and by ``verify``;
* every index field: each node of the index document changed and the seal recomputed, as
  an attacker would, is refused;
* a piece swapped for the same piece of another checkpoint signed by the same key is
  refused;
* an unsigned checkpoint, or one signed by another key, is refused by every reader given
  trusted keys: ``load``, ``Checkpoint.restore``, the manager, ``load_tree``, the DCP
  reader and ``distckpt verify --key``;
* incremental saves stay signed (a reused piece keeps its hash), and take nothing from a
  base whose signature they cannot check.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from distckpt.errors import UntrustedCheckpointError
from distckpt.signing import KeyFileError, SigningKey, TrustedKeys
from distckpt.testing.hostile import json_paths, reseal
from distckpt.tools.verify import verify
from tests.support.hostile_util import cli

pytest.importorskip("cryptography")
pytestmark = pytest.mark.timeout(240)

LAYOUT = {"small_bytes": 256, "inner_bytes": 4096, "compression": {"z": "zstd"}}


def make_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(24, 96, generator=g),  # regular: shards of 3 inner chunks
        "z": torch.randint(0, 4, (40, 64), generator=g).to(torch.int16),  # compressed
        "b": torch.randn(5, generator=g),  # a plain chunk
        "r": distckpt.PerRank(torch.arange(6) + seed),
        "v": {"lr": 0.5 + seed, "betas": (0.9, 0.99)},
    }


def targets(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.full_like(v, 7)
        elif isinstance(v, distckpt.PerRank):
            out[k] = distckpt.PerRank(torch.zeros_like(v.value))
        else:
            out[k] = None
    return out


def assert_loaded(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
        elif isinstance(v, distckpt.PerRank):
            assert torch.equal(got[k].value, v.value), k
        else:
            assert got[k] == v, k


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    where = tmp_path_factory.mktemp("keys")
    SigningKey.generate().write(where / "key.pem", public=where / "key.pub")
    return where / "key.pem", where / "key.pub"


@pytest.fixture
def signed(tmp_path: Path, keys: tuple[Path, Path]) -> Path:
    distckpt.save(make_state(0), tmp_path / "ck", signing_key=keys[0], **LAYOUT)  # type: ignore[arg-type]
    return tmp_path / "ck"


def load(path: Path, pub: Any, seed: int = 0) -> dict[str, Any]:
    state = targets(make_state(seed))
    distckpt.load(state, path, trusted_keys=pub)
    return state


def distckpt_form(doc: dict[str, Any]) -> bytes:
    """``doc`` serialised as distckpt writes an index (the checksum and signature members
    in their one byte form), resealed: what an attacker who edits it writes."""
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw = raw.replace(b'"checksum":"crc32c:', b'"checksum": "crc32c:', 1)
    return reseal(raw.replace(b'"signature":"ed25519:', b'"signature": "ed25519:', 1))


def verify_refuses(path: Path, trusted: TrustedKeys) -> bool:
    """Whether ``verify`` finds a problem, or cannot read the index at all."""
    try:
        return not verify(path, trusted=trusted).ok
    except distckpt.CheckpointError:
        return True


def files_of(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def test_a_signed_checkpoint_loads_bit_for_bit_and_verifies(signed: Path, keys) -> None:
    assert_loaded(load(signed, keys[1]), make_state(0))
    report = verify(signed, trusted=TrustedKeys.from_file(keys[1]))
    assert report.ok and report.trusted, report.problems
    assert_loaded(load(signed, None), make_state(0))  # readers that do not check still read it
    index = json.loads((signed / "zarr.json").read_bytes())["attributes"]["distckpt"]
    assert list(index)[:2] == ["checksum", "signature"]
    assert index["format_version"] == 5 and index["hash_algorithm"] in ("blake3", "sha256")
    assert set(index["files"]) == {
        str(p.relative_to(signed)) for p in files_of(signed) if p.name == "zarr.json"
    } - {"zarr.json"}


def test_every_stored_byte_is_covered(signed: Path, keys) -> None:
    """A bit flipped anywhere (sampled in every file: its first and last bytes and a
    spread between, every table and index among them) is refused by a load that requires
    the signature and by verify; the pristine checkpoint loads again after each."""
    trusted = TrustedKeys.from_file(keys[1])
    flips = 0
    for path in files_of(signed):
        raw = path.read_bytes()
        step = max(1, len(raw) // 24)
        for at in sorted({*range(0, len(raw), step), len(raw) - 1}):
            damaged = bytearray(raw)
            damaged[at] ^= 0x10
            path.write_bytes(damaged)
            try:
                with pytest.raises(distckpt.CheckpointError):
                    load(signed, trusted)
                assert verify_refuses(signed, trusted), (path, at)
            finally:
                path.write_bytes(raw)
            flips += 1
    assert flips > 150
    assert_loaded(load(signed, trusted), make_state(0))


def test_every_index_field_is_signed(signed: Path, keys) -> None:
    """Each node of the index document changed and the seal recomputed: refused, naming
    the signature (the attacker's best edit of each field)."""
    trusted = TrustedKeys.from_file(keys[1])
    index = signed / "zarr.json"
    raw = index.read_bytes()
    doc = json.loads(raw)
    paths = [p for p in json_paths(doc) if p and p[-1] not in ("checksum", "signature")]
    for at in paths:
        edited = json.loads(raw)
        parent = edited
        for k in at[:-1]:
            parent = parent[k]
        old = parent[at[-1]]
        parent[at[-1]] = old + 1 if type(old) is int else [old] if old is not None else 0
        index.write_bytes(distckpt_form(edited))
        inside = at[:2] == ("attributes", "distckpt") and len(at) > 2
        try:  # (an edit above the index may leave no index at all to check)
            with pytest.raises(UntrustedCheckpointError if inside else distckpt.CheckpointError):
                load(signed, trusted)
        finally:
            index.write_bytes(raw)
    assert len(paths) > 60


def test_a_piece_from_another_signed_checkpoint_is_refused(tmp_path: Path, keys) -> None:
    """Two checkpoints signed by the same key, of the same shapes: a shard or a plain
    chunk of one put in the other is refused, by the load and by verify; with the
    index's crc and size of the piece made to match (resealed), the signature refuses."""
    for seed in (0, 1):
        distckpt.save(make_state(seed), tmp_path / f"ck{seed}", signing_key=keys[0], **LAYOUT)  # type: ignore[arg-type]
    trusted = TrustedKeys.from_file(keys[1])
    index = tmp_path / "ck0" / "zarr.json"
    kept_index = index.read_bytes()
    donor = json.loads((tmp_path / "ck1" / "zarr.json").read_bytes())
    for piece, variable in (("w/c.0.0", "w"), ("b/c.0", "b"), ("z/c.0.0", "z")):
        target = tmp_path / "ck0" / piece
        kept = target.read_bytes()
        shutil.copyfile(tmp_path / "ck1" / piece, target)
        with pytest.raises(distckpt.CheckpointError):
            load(tmp_path / "ck0", trusted)
        assert verify_refuses(tmp_path / "ck0", trusted)
        doc = json.loads(kept_index)
        entry = doc["attributes"]["distckpt"]["variables"][variable]
        theirs = donor["attributes"]["distckpt"]["variables"][variable]
        for field in ("crc", "size", "pieces"):
            if field in entry:
                entry[field] = theirs[field]
        index.write_bytes(distckpt_form(doc))
        with pytest.raises(UntrustedCheckpointError, match="signature"):
            load(tmp_path / "ck0", trusted)
        assert verify_refuses(tmp_path / "ck0", trusted)
        target.write_bytes(kept)
        index.write_bytes(kept_index)
    assert_loaded(load(tmp_path / "ck0", trusted), make_state(0))


def test_an_unsigned_or_foreign_checkpoint_is_refused_by_every_reader(tmp_path: Path, keys) -> None:
    from distckpt.integrations.dcp import DistckptReader
    from distckpt.integrations.trees import load_tree, save_tree

    distckpt.save(make_state(0), tmp_path / "plain", **LAYOUT)  # type: ignore[arg-type]
    other = SigningKey.generate()
    distckpt.save(make_state(0), tmp_path / "foreign", signing_key=other, **LAYOUT)  # type: ignore[arg-type]
    save_tree({"w": torch.ones(3)}, tmp_path / "tree")
    for path, why in (("plain", "not signed"), ("foreign", "not among")):
        with pytest.raises(UntrustedCheckpointError, match=why):
            load(tmp_path / path, keys[1])
        ckpt = distckpt.Checkpoint(w=torch.zeros(24, 96))
        with pytest.raises(UntrustedCheckpointError, match=why):
            ckpt.restore(tmp_path / path, trusted_keys=keys[1])
        with pytest.raises(UntrustedCheckpointError, match=why):
            DistckptReader(tmp_path / path, trusted_keys=keys[1]).read_metadata()
        run = cli("verify", tmp_path / path, "--key", keys[1])
        assert run.returncode == 1 and why in run.stderr
    with pytest.raises(UntrustedCheckpointError, match="not signed"):
        load_tree(tmp_path / "tree", trusted_keys=keys[1])
    # The manager: a run directory of an unsigned checkpoint
    run_dir = tmp_path / "run"
    saving = distckpt.CheckpointManager(distckpt.Checkpoint(w=torch.ones(3)), run_dir)
    saving.save()
    saving.close()
    options = distckpt.CheckpointOptions(trusted_keys=str(keys[1]))
    manager = distckpt.CheckpointManager(
        distckpt.Checkpoint(w=torch.zeros(3)), run_dir, options=options
    )
    with pytest.raises(UntrustedCheckpointError, match="not signed"):
        manager.restore_or_initialize()
    manager.close()


def test_the_environment_names_the_keys(tmp_path: Path, keys, monkeypatch) -> None:
    monkeypatch.setenv("DISTCKPT_SIGNING_KEY", str(keys[0]))
    distckpt.save(make_state(0), tmp_path / "ck", **LAYOUT)  # type: ignore[arg-type]
    monkeypatch.delenv("DISTCKPT_SIGNING_KEY")
    distckpt.save(make_state(0), tmp_path / "plain", **LAYOUT)  # type: ignore[arg-type]
    monkeypatch.setenv("DISTCKPT_TRUSTED_KEYS", str(keys[1]))
    assert_loaded(load(tmp_path / "ck", None), make_state(0))
    with pytest.raises(UntrustedCheckpointError, match="not signed"):
        load(tmp_path / "plain", None)


def test_key_files_follow_the_conventions(tmp_path: Path) -> None:
    """A private key as PEM (PKCS #8) or OpenSSH; a trusted-keys file of PEM blocks and
    ssh-ed25519 lines with comments; anything else a KeyFileError naming the file."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

    pem_key, ssh_key = ed25519.Ed25519PrivateKey.generate(), ed25519.Ed25519PrivateKey.generate()
    (tmp_path / "a.pem").write_bytes(
        pem_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (tmp_path / "b").write_bytes(
        ssh_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    a, b = SigningKey.from_file(tmp_path / "a.pem"), SigningKey.from_file(tmp_path / "b")
    ssh_line = ssh_key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    (tmp_path / "trusted").write_bytes(
        b"# the team's keys\n" + a.public_pem() + b"\n" + ssh_line + b" alice@cluster\n\n"
    )
    trusted = TrustedKeys.from_file(tmp_path / "trusted")
    assert set(trusted.keys) == {a.id, b.id}
    for key in (a, b):
        distckpt.save({"w": torch.ones(4)}, tmp_path / key.id, signing_key=key)
        got = {"w": torch.zeros(4)}
        distckpt.load(got, tmp_path / key.id, trusted_keys=tmp_path / "trusted")
        assert torch.equal(got["w"], torch.ones(4))
    rsa_pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (tmp_path / "rsa.pem").write_bytes(rsa_pem)
    (tmp_path / "empty").write_bytes(b"# no keys\n")
    os.mkfifo(tmp_path / "fifo")
    for bad, kind in (("rsa.pem", SigningKey), ("empty", TrustedKeys), ("fifo", TrustedKeys)):
        with pytest.raises(KeyFileError, match=bad):
            kind.from_file(tmp_path / bad)  # type: ignore[attr-defined]
    with pytest.raises(KeyFileError, match="missing"):
        SigningKey.from_file(tmp_path / "missing")


def test_a_save_without_a_key_hashes_nothing(tmp_path: Path, keys) -> None:
    distckpt.save(make_state(0), tmp_path / "plain", **LAYOUT)  # type: ignore[arg-type]
    distckpt.save(make_state(0), tmp_path / "signed", signing_key=keys[0], **LAYOUT)  # type: ignore[arg-type]
    index = json.loads((tmp_path / "plain" / "zarr.json").read_bytes())["attributes"]["distckpt"]
    assert "signature" not in index and "hash_algorithm" not in index and "files" not in index
    assert "hash" not in json.dumps(index["variables"])
    plain = (tmp_path / "plain" / "w" / "c.0.0").stat().st_size
    signed = (tmp_path / "signed" / "w" / "c.0.0").stat().st_size
    assert signed - plain == 3 * 32  # the hash table: three inner chunks


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_either_hash_is_recorded_and_checked(tmp_path: Path, keys, monkeypatch, algorithm) -> None:
    monkeypatch.setenv("DISTCKPT_SIGNING_HASH", algorithm)
    distckpt.save(make_state(0), tmp_path / "ck", signing_key=keys[0], **LAYOUT)  # type: ignore[arg-type]
    index = json.loads((tmp_path / "ck" / "zarr.json").read_bytes())["attributes"]["distckpt"]
    assert index["hash_algorithm"] == algorithm
    assert_loaded(load(tmp_path / "ck", keys[1]), make_state(0))


def test_incremental_signed_saves_stay_signed(tmp_path: Path, keys) -> None:
    """A manager that signs saves incrementally: the second save takes the unchanged
    pieces from the first (their hashes with them) and loads, checked, bit for bit; a
    signed save on an unsigned base takes nothing from it."""
    options = distckpt.CheckpointOptions(signing_key=str(keys[0]), **LAYOUT)  # type: ignore[arg-type]
    frozen, moving = torch.randn(64, 96), torch.zeros(8)
    ckpt = distckpt.Checkpoint(frozen=frozen, moving=moving)
    with distckpt.CheckpointManager(ckpt, tmp_path / "run", options=options) as manager:
        manager.save()
        moving.add_(1)
        second = manager.save()
    index = json.loads((Path(second) / "zarr.json").read_bytes())["attributes"]["distckpt"]
    assert "reused" in json.dumps(index["variables"]["frozen"])
    got = {"frozen": torch.zeros(64, 96), "moving": torch.zeros(8)}
    distckpt.load(got, second, trusted_keys=keys[1], strict=False)
    assert torch.equal(got["frozen"], frozen) and torch.equal(got["moving"], moving)
    assert verify(second, trusted=TrustedKeys.from_file(keys[1])).ok

    distckpt.save({"w": frozen}, tmp_path / "unsigned", **LAYOUT)  # type: ignore[arg-type]
    result = distckpt.save(
        {"w": frozen},
        tmp_path / "next",
        base=tmp_path / "unsigned",
        signing_key=keys[0],
        **LAYOUT,  # type: ignore[arg-type]
    )
    assert result.bytes_reused == 0
    got = {"w": torch.zeros(64, 96)}
    distckpt.load(got, tmp_path / "next", trusted_keys=keys[1])
    assert torch.equal(got["w"], frozen)


def test_the_command_line_signs_and_verifies(tmp_path: Path) -> None:
    """keygen, sign an unsigned checkpoint in place (its values unchanged), verify --key;
    a damaged checkpoint is not signed and stays as it was."""
    key, pub = tmp_path / "k.pem", tmp_path / "k.pem.pub"
    assert cli("keygen", key).returncode == 0 and pub.exists()
    assert cli("keygen", key).returncode == 2  # never overwrites a key
    distckpt.save(make_state(0), tmp_path / "ck", **LAYOUT)  # type: ignore[arg-type]
    assert cli("verify", tmp_path / "ck", "--key", pub).returncode == 1
    signed = cli("sign", tmp_path / "ck", "--key", key)
    assert signed.returncode == 0, signed.stderr
    run = cli("verify", tmp_path / "ck", "--key", pub)
    assert run.returncode == 0 and "signed by trusted key" in run.stdout, run
    assert "signed by key" in cli("inspect", tmp_path / "ck").stdout
    assert_loaded(load(tmp_path / "ck", pub), make_state(0))
    # readers that do not check read the shards with their hash tables as any other
    assert cli("export", tmp_path / "ck", tmp_path / "ck.safetensors").returncode == 0
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "ck.safetensors"))
    assert torch.equal(exported["w"], make_state(0)["w"])
    distckpt.save(make_state(0), tmp_path / "twin", **LAYOUT)  # type: ignore[arg-type]
    assert cli("diff", tmp_path / "ck", tmp_path / "twin").returncode == 0
    assert cli("sign", tmp_path / "ck", "--key", key).returncode == 0  # again: still whole
    assert_loaded(load(tmp_path / "ck", pub), make_state(0))

    distckpt.save(make_state(1), tmp_path / "bad", **LAYOUT)  # type: ignore[arg-type]
    chunk = tmp_path / "bad" / "w" / "c.0.0"
    raw = bytearray(chunk.read_bytes())
    raw[20] ^= 1  # a data byte of the first inner chunk
    chunk.write_bytes(raw)
    before = {p: p.read_bytes() for p in files_of(tmp_path / "bad")}
    run = cli("sign", tmp_path / "bad", "--key", key)
    assert run.returncode == 2 and "crc32c" in run.stderr
    assert {p: p.read_bytes() for p in files_of(tmp_path / "bad")} == before
    assert not [p for p in tmp_path.iterdir() if "staging" in p.name]


def same_crc32c(data: bytes, start: int) -> bytes:
    """``data`` with bits flipped from byte ``start`` on and the same crc32c: crc32c is
    affine, so a set of flips whose effects cancel (found by elimination over GF(2))
    leaves it unchanged. What an attacker does to pass a checksum without recomputing it."""
    import crc32c

    zero = crc32c.crc32c(bytes(len(data)))
    rows: list[tuple[int, int]] = []  # (effect on the crc, flips as a bit mask)
    for bit in range(64):
        flipped = bytearray(len(data))
        flipped[start + bit // 8] ^= 1 << (bit % 8)
        effect, mask = crc32c.crc32c(bytes(flipped)) ^ zero, 1 << bit
        for row_effect, row_mask in rows:
            if effect ^ row_effect < effect:
                effect, mask = effect ^ row_effect, mask ^ row_mask
        if effect == 0:  # these flips cancel
            out = bytearray(data)
            for b in range(64):
                if mask >> b & 1:
                    out[start + b // 8] ^= 1 << (b % 8)
            assert crc32c.crc32c(bytes(out)) == crc32c.crc32c(data) and bytes(out) != data
            return bytes(out)
        rows.append((effect, mask))
        rows.sort(reverse=True)
    raise AssertionError("no cancelling flips")


def test_bytes_forged_past_their_crc32c_are_refused_by_their_hash(signed: Path, keys) -> None:
    """Data changed so that every crc32c still holds (no index edit, so the signature
    holds too): only the signed hash of the chunk (or plain chunk) catches it; a reader
    that does not check hashes reads the forged values."""
    trusted = TrustedKeys.from_file(keys[1])
    # The first inner chunk of w's shard (after its checksum and hash tables), and the
    # data of b's plain chunk; each keeps its stored crc32c.
    for piece, start, length in (("w/c.0.0", 3 * 4 + 3 * 32, 4096), ("b/c.0", 0, 5 * 4)):
        path = signed / piece
        raw = path.read_bytes()
        forged = same_crc32c(raw[start : start + length], 4)
        path.write_bytes(raw[:start] + forged + raw[start + length :])
        with pytest.raises(UntrustedCheckpointError, match="does not match its signed hash"):
            load(signed, trusted)
        assert not verify(signed, trusted=trusted).ok
        unchecked = targets(make_state(0))
        distckpt.load(unchecked, signed)  # no key: the crc32c cannot tell
        assert not all(torch.equal(unchecked[k], make_state(0)[k]) for k in ("w", "b"))
        path.write_bytes(raw)


def test_signed_checkpoints_on_an_object_store(s3, keys) -> None:
    """On S3 (a local S3-compatible server): a signed save, a checked load, a piece
    replaced by its signed twin's refused, and ``distckpt sign`` of an unsigned one."""
    trusted = TrustedKeys.from_file(keys[1])
    distckpt.save(make_state(0), f"{s3.url}/signed", signing_key=keys[0], **LAYOUT)  # type: ignore[arg-type]
    distckpt.save(make_state(1), f"{s3.url}/twin", signing_key=keys[0], **LAYOUT)  # type: ignore[arg-type]
    assert_loaded(load(f"{s3.url}/signed", trusted), make_state(0))  # type: ignore[arg-type]
    assert verify(f"{s3.url}/signed", trusted=trusted).ok
    client, bucket = s3.client(), "distckpt"
    prefix = s3.url.removeprefix("s3://distckpt/")
    client.copy_object(
        Bucket=bucket,
        Key=f"{prefix}/signed/w/c.0.0",
        CopySource={"Bucket": bucket, "Key": f"{prefix}/twin/w/c.0.0"},
    )
    with pytest.raises(distckpt.CheckpointError):
        load(f"{s3.url}/signed", trusted)  # type: ignore[arg-type]
    distckpt.save(make_state(0), f"{s3.url}/plain", **LAYOUT)  # type: ignore[arg-type]
    run = cli("sign", f"{s3.url}/plain", "--key", keys[0])
    assert run.returncode == 2 and "--out" in run.stderr  # never in place on an object store
    signed = cli("sign", f"{s3.url}/plain", "--key", keys[0], "--out", f"{s3.url}/copy")
    assert signed.returncode == 0, signed.stderr
    assert_loaded(load(f"{s3.url}/copy", trusted), make_state(0))  # type: ignore[arg-type]
    with pytest.raises(UntrustedCheckpointError):
        load(f"{s3.url}/plain", trusted)  # type: ignore[arg-type]


def test_background_and_managed_saves_sign(tmp_path: Path, keys) -> None:
    """A background save signs as a blocking one does; a manager that requires
    signatures restores the newest signed persistent checkpoint, never a local step
    (local steps are not signed), and says why."""
    handle = distckpt.save(
        make_state(0),
        tmp_path / "bg",
        signing_key=keys[0],
        async_save=True,
        **LAYOUT,  # type: ignore[arg-type]
    )
    handle.wait()
    assert_loaded(load(tmp_path / "bg", keys[1]), make_state(0))

    options = distckpt.CheckpointOptions(signing_key=str(keys[0]), trusted_keys=str(keys[1]))
    step, w = torch.tensor(0), torch.zeros(4)
    ckpt = distckpt.Checkpoint(step=step, w=w)
    local = distckpt.LocalTier(str(tmp_path / "local"), interval=1)
    kw = {"step_counter": step, "checkpoint_interval": 10, "local": local, "options": options}
    with distckpt.CheckpointManager(ckpt, tmp_path / "run", **kw) as manager:  # type: ignore[arg-type]
        for _ in range(12):
            step.add_(1)
            w.add_(1)
            manager.save()
    again = distckpt.Checkpoint(step=torch.tensor(0), w=torch.zeros(4))
    with distckpt.CheckpointManager(again, tmp_path / "run", **kw) as manager:  # type: ignore[arg-type]
        manager.restore_or_initialize()
        restored = manager.restored
        assert restored is not None and restored.tier == "persistent"
        assert "not signed" in restored.reason
    assert int(again.step) == restored.number < 12  # the local step 12 was not taken
    assert torch.equal(again.w, torch.full((4,), float(restored.number)))
