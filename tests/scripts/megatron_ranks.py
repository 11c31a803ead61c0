"""One rank of a Megatron-core save or load through the distckpt strategies (CPU, gloo).

    torchrun --standalone --nproc-per-node N megatron_ranks.py save CKPT REF TP PP [async]
    torchrun --standalone --nproc-per-node N megatron_ranks.py load CKPT REF TP PP [...]

A small GPT model built from Megatron-core's own layers (local spec, CPU initialisation)
with a torch Adam optimizer, whose sharded state dict is made by Megatron's own helpers
(``optim_state_to_sharding_state``, as its ``FP32Optimizer`` does). ``save`` trains one
step, saves with ``DistckptSaveStrategy`` and writes each rank's own boxes to ``REF``;
``load`` (any other layout) loads through ``dist_checkpointing.load`` and compares every
loaded box with the saved boxes that overlap it, bit for bit; one launch may load several
checkpoints, each under its own layout (model parallelism set up again for each).
"""

from __future__ import annotations

import itertools
import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

mode = sys.argv[1]
use_async = mode == "save" and sys.argv[6:] == ["async"]
jobs = [
    (sys.argv[i], sys.argv[i + 1], int(sys.argv[i + 2]), int(sys.argv[i + 3]))
    for i in range(2, 6 if mode == "save" else len(sys.argv), 4)
]

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.dist_checkpointing import serialization  # noqa: E402
from megatron.core.dist_checkpointing.dict_utils import nested_values  # noqa: E402
from megatron.core.dist_checkpointing.mapping import (  # noqa: E402
    ShardedObject,
    ShardedTensor,
    is_main_replica,
)
from megatron.core.dist_checkpointing.optimizer import (  # noqa: E402
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.dist_checkpointing.validation import StrictHandling  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from distckpt.integrations.megatron import DistckptSaveStrategy  # noqa: E402


def say(line: str) -> None:
    """One write(2) per line: the ranks share the pipe."""
    os.write(1, f"{line}\n".encode())


def build(tp: int, pp: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        ffn_hidden_size=32,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=8,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


#: Parameter bounds in a bucket of 37 elements, for :func:`bucket`.
BUCKET_PARAMS = (0, 5, 12, 13, 20, 31, 37)


def bucket() -> list[ShardedTensor]:
    """One bucket of the distributed optimizer's state as megatron-core's ``dp_reshardable``
    format gives it (``DistributedOptimizer.sharded_param_state_dp_reshardable``, which
    needs CUDA to run): the bucket, padded to a multiple of the data-parallel size (here
    every rank), split evenly over the ranks; the padding past its end not stored; each
    rank's range cut at the parameters' bounds into several ShardedTensors of the bucket's
    key, each a tensor of its own, with replica id (0, 0, 0) on every rank."""
    unpadded = BUCKET_PARAMS[-1]
    local = -(-unpadded // world)
    start, end = rank * local, min((rank + 1) * local, unpadded)
    cuts = sorted({start, end, *(b for b in BUCKET_PARAMS if start < b < end)})
    key = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_torch.float32.bucket_idx_0"
    return [
        ShardedTensor(
            f"{key}.exp_avg",
            torch.randn(hi - lo),
            torch.float32,
            (hi - lo,),
            (unpadded,),
            (lo,),
            axis_fragmentations=None,
            replica_id=(0, 0, 0),
        )
        for lo, hi in zip(cuts, cuts[1:])
    ]


def sharded_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tp: int,
    pp: int,
) -> dict:
    model_state = model.sharded_state_dict()
    id_to_sharded = get_param_id_to_sharded_param_map(
        model_state, itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)
    )
    optim_state = optimizer.state_dict()
    optim_state_to_sharding_state(optim_state, id_to_sharded, exclude_keys=("step",))
    return {
        "model": model_state,
        "optimizer": optim_state,
        "layout": ShardedObject(
            "layout", {"tp": tp, "pp": pp, "rng": torch.arange(4)}, (1,), (0,), replica_id=rank
        ),
        "iteration": 7,
        "bucket": bucket(),
    }


def boxes(state: dict) -> list[tuple[str, tuple, tuple, torch.Tensor]]:
    out = []
    for leaf in nested_values(state):
        if isinstance(leaf, ShardedTensor) and is_main_replica(leaf.replica_id):
            shape = (1,) * leaf.prepend_axis_num + tuple(leaf.local_shape)
            out.append(
                (
                    leaf.key,
                    tuple(leaf.global_offset),
                    shape,
                    leaf.data.detach().clone().reshape(shape),
                )
            )
    return out


def run(ckpt: str, ref: str, tp: int, pp: int) -> None:
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    torch.manual_seed(1234 + rank)
    model, optimizer = build(tp, pp)
    # Values that differ by rank, so that a misplaced box shows (replicas differ too: only the
    # main replica's are saved, and only those are compared).
    for p in model.parameters():
        with torch.no_grad():
            p.copy_(torch.randn_like(p))

    if mode == "save":
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        state = sharded_state(model, optimizer, tp, pp)
        saved = boxes(state)
        os.makedirs(ckpt, exist_ok=True)
        os.makedirs(ref, exist_ok=True)
        strategy = DistckptSaveStrategy()
        if use_async:
            request = dist_checkpointing.save(
                state, ckpt, sharded_strategy=strategy, async_sharded_save=True
            )
            request.execute_sync()
            assert not strategy.pending() and strategy.result is not None
        else:
            dist_checkpointing.save(state, ckpt, sharded_strategy=strategy)
        torch.save(saved, os.path.join(ref, f"rank{rank}.pt"))
        dist.barrier()
        if rank == 0:
            say(f"SAVED {len(saved)} boxes {sorted(os.listdir(ckpt))}")
    else:
        for p in model.parameters():  # create Adam's state for the load to fill
            p.grad = torch.zeros_like(p)
        optimizer.step()
        state = sharded_state(model, optimizer, tp, pp)
        with torch.no_grad():  # so that nothing passes by being left as it was
            for leaf in nested_values(state):
                if isinstance(leaf, ShardedTensor):
                    leaf.data.fill_(float("nan") if leaf.data.is_floating_point() else -1)
        # RAISE_ALL: Megatron compares the keys with the strategy's load_sharded_metadata.
        loaded = dist_checkpointing.load(state, ckpt, strict=StrictHandling.RAISE_ALL)
        reference = [b for f in sorted(os.listdir(ref)) for b in torch.load(os.path.join(ref, f))]
        checked = 0

        def walk(sharded, plain):
            if isinstance(sharded, dict):
                for k in sharded:
                    yield from walk(sharded[k], plain[k])
            elif isinstance(sharded, list):
                for a, b in zip(sharded, plain):
                    yield from walk(a, b)
            elif isinstance(sharded, ShardedTensor):
                yield sharded, plain

        # the same structure, to walk with the loaded one
        state2 = sharded_state(model, optimizer, tp, pp)
        for sh, tensor in walk(state2, loaded):
            shape = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
            mine = tensor.reshape(shape)
            covered = torch.zeros(shape, dtype=torch.bool)
            for key, offset, rshape, rdata in reference:
                if key != sh.key:
                    continue
                lo = [max(a, b) for a, b in zip(offset, sh.global_offset)]
                ends = zip(offset, rshape, sh.global_offset, shape)
                hi = [min(a + n, b + m) for a, n, b, m in ends]
                if any(end <= start for start, end in zip(lo, hi)):
                    continue
                mine_idx = tuple(slice(s - o, e - o) for s, e, o in zip(lo, hi, sh.global_offset))
                ref_idx = tuple(slice(s - o, e - o) for s, e, o in zip(lo, hi, offset))
                a, b = mine[mine_idx], rdata[ref_idx]
                assert a.dtype == b.dtype, (sh.key, a.dtype, b.dtype)
                assert torch.equal(
                    a.view(torch.uint8) if a.dtype.is_floating_point else a,
                    b.view(torch.uint8) if b.dtype.is_floating_point else b,
                ), sh.key
                covered[mine_idx] = True
            assert bool(covered.all()), f"{sh.key}: part of the box is in no saved box"
            checked += 1
        # The metadata Megatron's strict checks and load_plain_tensors use.
        tensors_meta = dist_checkpointing.load_tensors_metadata(ckpt)
        sharded_meta = serialization.load_sharded_metadata(ckpt)
        for sh, _ in walk(state2, loaded):
            meta = tensors_meta[sh.key]
            assert tuple(meta.global_shape) == tuple(sh.global_shape), (sh.key, meta, sh)
            assert meta.dtype == sh.dtype and sh.key in sharded_meta
        assert "layout/shard_0_1" in sharded_meta, sorted(sharded_meta)[:5]
        assert loaded["iteration"] == 7
        assert loaded["layout"]["rng"].tolist() == [0, 1, 2, 3]
        dist.barrier()
        say(f"rank {rank}: LOADED {checked} boxes of {ckpt} under TP {tp} PP {pp} bit for bit")
    parallel_state.destroy_model_parallel()


for job in jobs:
    run(*job)
dist.destroy_process_group()
say(f"OK {rank}")
