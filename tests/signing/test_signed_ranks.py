"""Signed checkpoints across ranks (``tests/scripts/signed_ranks.py`` under torchrun):
every rank hashes what it writes and rank 0 signs; a job of another size that requires
the signature reads each rank's rows, checked, bit for bit; once a chunk of one shard is
forged past its crc32c, every rank of that job refuses the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distckpt.signing import SigningKey
from tests.signing.test_signing import same_crc32c
from tests.support.launch_util import SCRIPTS, assert_all_ok, run_ranks

pytest.importorskip("cryptography")
SCRIPT = SCRIPTS / "signed_ranks.py"
TIMEOUT = 150


@pytest.mark.timeout(4 * TIMEOUT)
def test_a_signed_save_on_2_ranks_is_checked_on_3(tmp_path: Path) -> None:
    key, pub = tmp_path / "key.pem", tmp_path / "key.pub"
    SigningKey.generate().write(key, public=pub)
    env = {"DISTCKPT_SIGNING_KEY": str(key), "DISTCKPT_TRUSTED_KEYS": str(pub)}
    ck = str(tmp_path / "ck")
    assert_all_ok(run_ranks(2, SCRIPT, "save", ck, timeout=TIMEOUT, env=env), 2)
    index = json.loads((tmp_path / "ck" / "zarr.json").read_bytes())["attributes"]["distckpt"]
    assert index["signature"].startswith("ed25519:")
    assert {e["layout"] for e in index["variables"].values() if "layout" in e} >= {
        "regular",
        "boxes",
    }
    assert_all_ok(run_ranks(3, SCRIPT, "load", ck, timeout=TIMEOUT, env=env), 3)

    shard = tmp_path / "ck" / "w" / "c.1.0"  # rank 1's rows; its first inner chunk forged
    raw = shard.read_bytes()
    chunks = len(raw) // 4096
    head = chunks * (4 + 32)
    shard.write_bytes(raw[:head] + same_crc32c(raw[head : head + 4096], 0) + raw[head + 4096 :])
    job = run_ranks(3, SCRIPT, "refused", ck, timeout=TIMEOUT, env=env)
    assert job.returncode == 0, job.stdout + job.stderr
    for rank in range(3):
        assert f"REFUSED {rank} UntrustedCheckpointError" in job.stdout, job.stdout
