"""Hugging Face weights through distckpt with the real ``transformers`` library.

A small Llama is built from a config (no download) and written with ``save_pretrained``
in small files; ranks launched by torchrun (2, tied embeddings) and mpiexec (3, untied)
load it into an FSDP2-sharded copy, bit for bit (tests/scripts/hf_ranks.py), and write it
back with :func:`distckpt.save_hf` and as a checkpoint; here ``from_pretrained`` of what
they wrote, and of the checkpoint exported with :func:`distckpt.export_hf`, gives the
original model's logits exactly. The ranks also write the weights, and export the
checkpoint, to a bucket (Azure for torchrun, S3 for mpiexec): each object there must be
the file written here, byte for byte.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import distckpt
from distckpt.comm import SingleComm
from distckpt.storage.registry import open_store
from tests.support.launch_util import SCRIPTS, check, output, run_mpi_ranks, run_ranks

transformers = pytest.importorskip("transformers")


def _model(tied: bool) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(12)[None] % 96).logits


def _reopened(directory: Path) -> torch.Tensor:
    return _logits(transformers.LlamaForCausalLM.from_pretrained(directory).eval())


def _same_objects(directory: Path, url: str) -> None:
    """The store at ``url`` holds the weights files of ``directory``, byte for byte."""
    store = open_store(url)
    files = sorted(p.name for p in directory.iterdir() if p.name.startswith("model"))
    assert files and store.list() == files, (store.list(), files)
    for name in files:
        assert store.read(name) == (directory / name).read_bytes(), name


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("launcher", "ranks", "tied", "service"),
    [("torchrun", 2, True, "azure"), ("mpiexec", 3, False, "s3")],
)
def test_hf_weights_on_fsdp2_ranks(
    tmp_path: Path,
    launcher: str,
    ranks: int,
    tied: bool,
    service: str,
    request: pytest.FixtureRequest,
) -> None:
    model = _model(tied)
    source = tmp_path / "source"
    model.save_pretrained(source, max_shard_size="30KB")
    assert len(list(source.glob("*.safetensors"))) > 2  # several files and an index
    work = tmp_path / "work"
    server = request.getfixturevalue(service)
    run = run_ranks if launcher == "torchrun" else run_mpi_ranks
    env = dict(server.env)
    proc = run(
        ranks, SCRIPTS / "hf_ranks.py", str(source), str(work), server.url, timeout=300, env=env
    )
    check(proc)
    assert proc.stdout.count("OK ") == ranks, output(proc)

    expected = _logits(model)
    assert torch.equal(_reopened(work / "hf"), expected)
    exported = tmp_path / "exported"
    distckpt.export_hf(work / "ckpt", exported, SingleComm(), prefix="net/", max_shard_size="50KB")
    model.config.save_pretrained(exported)
    assert torch.equal(_reopened(exported), expected)
    # The column split, one box per rank, written back whole.
    up = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(
        load_file(work / "columns" / "model.safetensors")[up], model.state_dict()[up]
    )
    # What the ranks wrote to the bucket, each file by one writer from every rank's rows.
    for name, directory in [
        ("hf", work / "hf"),
        ("columns", work / "columns"),
        ("exported", exported),
    ]:
        _same_objects(directory, f"{server.url}/{name}")
