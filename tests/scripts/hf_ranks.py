"""Hugging Face weights into an FSDP2-sharded transformers model on N ranks, and back.

Usage (under torchrun or mpiexec, gloo on CPU)::

    hf_ranks.py HF_DIR WORK_DIR [STORE_URL]

Each rank builds the model from ``HF_DIR/config.json`` (random weights), shards every
decoder layer and the root with FSDP2, loads ``HF_DIR`` with :func:`distckpt.load_hf` and
checks its own shards and the full tensors bit for bit against the files (read whole with
the safetensors library); loads and checks a column split of one weight (a box that is one
run per row); then writes the sharded state back with :func:`distckpt.save_hf`
(``WORK_DIR/hf``, small files), the column split alone (``WORK_DIR/columns``), and a
distckpt checkpoint of ``{"net": state}`` (``WORK_DIR/ckpt``), which the test exports and
opens with ``from_pretrained``. With ``STORE_URL`` (``s3://...``, ``az://...``) the ranks
also write the sharded state and the column split there (``STORE_URL/hf``,
``STORE_URL/columns``), and export the checkpoint there (``STORE_URL/exported``), which
the test compares with the files, byte for byte. Each rank prints ``OK <rank>`` last when
every check passed.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
from rank import finish_job, start_job
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

import distckpt
from distckpt.slices import chunk_bounds

COLUMNS = "model.layers.0.mlp.up_proj.weight"


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    hf_dir, work = Path(sys.argv[1]), Path(sys.argv[2])
    rank, world = start_job()
    mesh = init_device_mesh("cpu", (world,))
    config = AutoConfig.from_pretrained(hf_dir)
    torch.manual_seed(1000 + rank)  # every rank's random start differs from the files
    model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    expected: dict[str, torch.Tensor] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        expected.update(load_file(file))

    state = model.state_dict()
    result = distckpt.load_hf(state, hf_dir)
    tied = bool(config.tie_word_embeddings)
    assert result.missing == [] and result.unexpected == [], (result.missing, result.unexpected)
    assert ("lm_head.weight" in expected) != tied, sorted(expected)
    for name, value in state.items():
        full = value.full_tensor()
        reference = expected["model.embed_tokens.weight" if name not in expected else name]
        assert torch.equal(full, reference), name
        start, size = chunk_bounds(reference.shape[0], world, rank)
        assert torch.equal(value.to_local(), reference[start : start + size]), name

    weight = expected[COLUMNS]
    start, size = chunk_bounds(weight.shape[1], world, rank)
    columns = {
        COLUMNS: distckpt.Shard(torch.zeros(weight.shape[0], size), weight.shape, (0, start))
    }
    distckpt.load_hf(columns, hf_dir, strict=False)
    assert torch.equal(columns[COLUMNS].tensor, weight[:, start : start + size])

    written = distckpt.save_hf(state, work / "hf", max_shard_size="40KB")
    distckpt.save_hf(columns, work / "columns")
    distckpt.save({"net": state}, work / "ckpt")
    if len(sys.argv) > 3:
        url = sys.argv[3]
        distckpt.save_hf(state, f"{url}/hf", max_shard_size="40KB")
        distckpt.save_hf(columns, f"{url}/columns")
        distckpt.export_hf(work / "ckpt", f"{url}/exported", prefix="net/", max_shard_size="50KB")
    if rank == 0:
        config.save_pretrained(work / "hf")
        assert written.files_written > 2, written
    finish_job(rank)


if __name__ == "__main__":
    main()
