#!/usr/bin/env python
"""Megatron-core and DeepSpeed: distckpt's strategies and engine against each framework's
own checkpoint path, on the same model, ranks and directory.

* ``megatron`` (one torchrun launch of ``--world`` ranks, tensor-parallel ``--tp``): a
  ``GPTModel`` from megatron-core's local layer spec (CPU initialisation) of ``--hidden``,
  ``--layers``, ``--vocab``, with a torch Adam whose state is made sharded by
  ``optim_state_to_sharding_state`` (as megatron-core's ``FP32Optimizer`` does).
  Contenders: ``torch_dist``, ``dist_checkpointing.save(state, dir)`` with megatron-core's
  default save strategy (``torch_dist``: DCP files, 2 writer threads per rank), against
  ``distckpt``, the same call with ``sharded_strategy=DistckptSaveStrategy()``; each
  loaded with ``dist_checkpointing.load(state, dir)`` (the backend read from the
  checkpoint's ``metadata.json``) onto the same layout.
* ``deepspeed`` (one launch of ``--world`` ranks, ``DS_ACCELERATOR=cpu``): an MLP of
  ``--ds-layers`` square linear layers of ``--ds-width``, Adam, ZeRO stage ``--ds-stage``.
  Contenders: ``torch``, ``engine.save_checkpoint`` / ``load_checkpoint`` with the engine
  ``deepspeed.initialize`` made (a ``TorchCheckpointEngine`` of the config: ``torch.save``'s
  zip format, DeepSpeed's default ``checkpoint_serialization``), ``torch-legacy``
  (``TorchCheckpointEngine()`` made without a config, as DeepSpeed's own tools do:
  ``torch.save``'s older format, no zip and no CRC-32), and ``distckpt``, the engine of
  ``use_distckpt(engine)`` (``engine.checkpoint_engine`` switched before each operation).

Per launch: an untimed warm-up round, then ``--rounds`` rounds; in each, the contenders
save in that round's order (``harness.rotations``), each into a fresh directory, then
load in the same order, then the round's checkpoints are removed. Every operation is a
``harness.timed`` section (barrier, operation, barrier; the wall time until the slowest
rank is done). Before each load the state it fills is overwritten with NaN; afterwards
every tensor this rank owns (Megatron: its main replicas; DeepSpeed: the module's
parameters, the optimizer's fp32 partition and moments) is compared bit for bit with the
values saved (``VERIFY FAILED`` otherwise). Printed: medians and time ratios distckpt /
the framework's own path (of medians, of mins, paired per round).

    python benchmarks/bench_stacks.py                        # both stacks, /dev/shm, 5 rounds
    python benchmarks/bench_stacks.py --stack deepspeed --ds-width 1024   # 64 MiB per rank
    python benchmarks/bench_stacks.py --stack deepspeed --ds-width 4096   # 1 GiB per rank
    python benchmarks/bench_stacks.py --stack megatron --hidden 512 --rounds 2   # smoke
"""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path
from typing import Any

import harness as h

#: Per stack: the framework's own paths, then distckpt (compared with each of them).
CONTENDERS = {
    "megatron": ("torch_dist", "distckpt"),
    "deepspeed": ("torch", "torch-legacy", "distckpt"),
}
TAG = "t"


def tree_bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def cpu_torch_dist(torch: Any) -> None:
    """megatron-core 0.16's ``torch_dist`` save calls ``torch.cuda.synchronize()`` after
    copying the tensors to host memory and puts its failure flag on
    ``torch.cuda.current_device()``; without CUDA both raise. On a CPU-only torch they
    become a no-op and ``"cpu"`` (nothing else of the save changes)."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


class Worker(h.RankWorker):
    def run(self) -> None:
        stack = self.spec["stack"]
        ops = self.megatron() if stack == "megatron" else self.deepspeed()
        save, load, scrub, verify = ops
        d = Path(self.spec["dir"])
        contenders = CONTENDERS[stack]
        warm_up = [list(contenders)]
        rounds = warm_up + h.rotations(contenders, self.spec["rounds"])
        for rnd, order in enumerate(rounds, start=-1):
            paths = {who: d / f"{stack}-{who}-{rnd}" for who in order}
            for who in order:
                self.barrier()
                if self.rank == 0:
                    paths[who].mkdir(parents=True)
                s = h.timed(self, lambda who=who, p=paths[who]: save(who, p))
                size = tree_bytes(paths[who]) if self.rank == 0 else 0
                self.event(stack, "save", who, rnd, s, size)
            for who in order:
                scrub()
                s = h.timed(self, lambda who=who, p=paths[who]: load(who, p))
                self.check(verify(s.results[0]), f"{stack} load of {who}")
                self.event(stack, "load", who, rnd, s, 0)
            self.rmtree(*paths.values())

    def event(self, stack: str, op: str, who: str, rnd: int, s: h.Section, size: int) -> None:
        if rnd < 0:
            return
        if self.rank == 0:
            print(f"  {stack} round {rnd} {op} {who}: {s.marks[-1]:.3f}s", flush=True)
        self.out["events"].append(
            {"stack": stack, "op": op, "who": who, "round": rnd, "span": s.marks[-1], "bytes": size}
            | s.fields()
        )

    # ----------------------------------------------------------------------- megatron

    def megatron(self) -> tuple[Any, ...]:
        import warnings

        warnings.filterwarnings("ignore")
        torch = self.torch
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        from distckpt.integrations.megatron import DistckptSaveStrategy

        if not torch.cuda.is_available():
            cpu_torch_dist(torch)
        spec = self.spec
        tp = spec["tp"]
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        torch.manual_seed(1234)  # the same master weights on every rank (CPU init splits them)
        config = TransformerConfig(
            num_layers=spec["layers"],
            hidden_size=spec["hidden"],
            num_attention_heads=spec["heads"],
            use_cpu_initialization=True,
            tensor_model_parallel_size=tp,
            params_dtype=torch.float32,
        )
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=spec["vocab"],
            max_sequence_length=spec["seq"],
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(self.rank)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()  # Adam's moments, with values
        model.zero_grad(set_to_none=True)

        def state() -> dict[str, Any]:
            model_state = model.sharded_state_dict()
            params = itertools.chain.from_iterable(grp["params"] for grp in optimizer.param_groups)
            id_map = get_param_id_to_sharded_param_map(model_state, params)
            optim_state = optimizer.state_dict()
            optim_state_to_sharding_state(optim_state, id_map, exclude_keys=("step",))
            return {"model": model_state, "optimizer": optim_state, "iteration": 7}

        def leaves(st: Any) -> list[Any]:
            return [x for x in nested_values(st) if isinstance(x, ShardedTensor)]

        # The tensors behind the leaves (parameters, Adam's moments) and their saved values.
        live = [x.data for x in leaves(state())]
        mine = [is_main_replica(x.replica_id) for x in leaves(state())]
        saved = [t.detach().clone() for t in live]
        stored = sum(t.numel() * t.element_size() for t, m in zip(live, mine) if m)
        self.out["megatron"] = {"state_bytes": self.gather(stored), "leaves": len(live)}
        target: dict[str, Any] = {}

        def save(who: str, path: Path) -> None:
            if who == "distckpt":
                dist_checkpointing.save(state(), str(path), sharded_strategy=DistckptSaveStrategy())
            else:
                dist_checkpointing.save(state(), str(path))

        def scrub() -> None:
            with torch.no_grad():
                for t in live:
                    t.fill_(float("nan"))
            target["state"] = state()

        def load(_who: str, path: Path) -> Any:
            return dist_checkpointing.load(target["state"], str(path))

        def walk(sharded: Any, plain: Any) -> Any:
            if isinstance(sharded, dict):
                for k in sharded:
                    yield from walk(sharded[k], plain[k])
            elif isinstance(sharded, list):
                for a, b in zip(sharded, plain, strict=True):
                    yield from walk(a, b)
            elif isinstance(sharded, ShardedTensor):
                yield sharded, plain

        def verify(loaded: Any) -> str | None:
            bad = None
            got = [t for _, t in walk(state(), loaded)]
            for t, want, m, back in zip(got, saved, mine, live, strict=True):
                if m and bad is None and not torch.equal(t.reshape(want.shape), want):
                    bad = "a loaded tensor differs from the saved one"
                with torch.no_grad():
                    back.copy_(want)  # this rank's own values (replicas included) again
            return bad

        return save, load, scrub, verify

    # ----------------------------------------------------------------------- deepspeed

    def deepspeed(self) -> tuple[Any, ...]:
        torch = self.torch
        import deepspeed
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        from distckpt.integrations.deepspeed import use_distckpt

        spec = self.spec
        deepspeed.init_distributed(dist_backend="gloo")
        torch.manual_seed(0)
        width = spec["ds_width"]
        layers: list[Any] = []
        for _ in range(spec["ds_layers"]):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": spec["ds_stage"]},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
            "steps_per_print": 1 << 30,
        }
        model = torch.nn.Sequential(*layers)
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        g = torch.Generator().manual_seed(self.rank)
        loss = engine(torch.randn(2, width, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()  # Adam's moments, with values
        own = engine.checkpoint_engine  # the config's: torch.save's zip format by default
        assert isinstance(own, TorchCheckpointEngine), type(own)
        engines = {
            "torch": own,
            "torch-legacy": TorchCheckpointEngine(),
            "distckpt": use_distckpt(engine),
        }

        def owned() -> list[Any]:
            out = [p.data for p in engine.module.parameters()]
            opt = engine.optimizer
            out += list(getattr(opt, "single_partition_of_fp32_groups", []))
            inner = getattr(opt, "optimizer", opt)
            for st in inner.state.values():
                out += [v for k, v in st.items() if k != "step" and torch.is_tensor(v)]
            return out

        live = owned()
        saved = [t.detach().clone() for t in live]
        module = len(list(engine.module.parameters()))  # saved once, by rank 0
        stored = sum(t.numel() * t.element_size() for t in live[0 if self.rank == 0 else module :])
        self.out["deepspeed"] = {"state_bytes": self.gather(stored), "tensors": len(live)}

        def save(who: str, path: Path) -> None:
            engine.checkpoint_engine = engines[who]
            engine.save_checkpoint(str(path), tag=TAG)

        def scrub() -> None:
            with torch.no_grad():
                for t in owned():
                    t.fill_(float("nan"))

        def load(who: str, path: Path) -> None:
            engine.checkpoint_engine = engines[who]
            engine.load_checkpoint(str(path), tag=TAG)

        def verify(_: Any) -> str | None:
            now = owned()
            if len(now) != len(saved):
                return f"{len(now)} tensors after the load, {len(saved)} saved"
            same = all(torch.equal(a, b) for a, b in zip(now, saved, strict=True))
            return None if same else "a loaded tensor differs from the saved one"

        return save, load, scrub, verify


class Driver(h.Driver):
    name = "bench_stacks"

    def describe(self) -> str:
        a = self.args
        return f"stacks {a.stack}, {a.world} ranks, {a.rounds} rounds, {a.dir}"

    def env(self) -> dict[str, Any]:
        return {"fs": {self.args.dir: h.fs_type(Path(self.args.dir))}}

    def run(self) -> None:
        a = self.args
        stacks = ["megatron", "deepspeed"] if a.stack == "both" else [a.stack]
        fs = h.fs_type(Path(a.dir))
        with h.run_dir(a.dir) as d:
            for stack in stacks:
                spec = {
                    "stack": stack,
                    "dir": str(d),
                    "rounds": a.rounds,
                    **{k: getattr(a, k) for k in ("tp", "hidden", "layers", "vocab", "heads")},
                    **{k: getattr(a, k) for k in ("seq", "ds_width", "ds_layers", "ds_stage")},
                }
                env = {**h.TORCHRUN_ENV, "DS_ACCELERATOR": "cpu"}
                busy = self.wait_idle()
                out, wall, _ = self.launch_worker(h.torchrun(a.world), __file__, spec, stack, env)
                total = sum(out[stack]["state_bytes"])
                per = total / a.world / h.MiB
                print(
                    f" {stack}: {total / h.MiB:.0f} MiB of state ({per:.0f} MiB per rank), "
                    f"{wall:.1f}s launch",
                    flush=True,
                )
                self.events += [
                    {"busy_before": busy, "fs": fs, "state_bytes": total, **e}
                    for e in out["events"]
                ]


def summarize(args: argparse.Namespace, events: list[dict[str, Any]]) -> dict[str, Any]:
    rows, ratios = [], []
    for stack, contenders in CONTENDERS.items():
        ours = contenders[-1]
        for op in ("save", "load"):
            mine = [e for e in events if e["stack"] == stack and e["op"] == op]
            if not mine:
                continue
            series = {
                who: {e["round"]: e["span"] for e in mine if e["who"] == who} for who in contenders
            }
            for who in contenders:
                es = [e for e in mine if e["who"] == who]
                if not es:  # a results file from before this contender
                    continue
                sizes = [e["bytes"] for e in es if e["bytes"]]
                rows.append(
                    {
                        "stack": stack,
                        "op": op,
                        "who": who,
                        **h.spread(list(series[who].values())),
                        "state_bytes": es[0]["state_bytes"],
                        "stored_bytes": h.med(sizes) if sizes else None,
                        "oth": h.med([e["foreign_cpu"] for e in es]),
                    }
                )
            for own in contenders[:-1]:
                q = h.ratio(series[ours], series[own])
                if q is not None:
                    label = f"{stack} {op} {ours}/{own}"
                    goal = h.target(q["paired_median"], None)
                    ratios.append({"label": label, "fs": mine[0]["fs"], **q, **goal})
    return {"rows": rows, "ratios": ratios}


def print_report(summary: dict[str, Any]) -> None:
    print(
        f"\n{'stack':9} {'op':4} {'who':10} {'n':>2} {'median s':>9} {'min s':>7} {'max s':>7} "
        f"{'MiB/s':>6} {'stored MiB':>10} {'oth%':>5}"
    )
    for r in summary["rows"]:
        rate = r["state_bytes"] / h.MiB / r["median_s"]
        stored = "" if r["stored_bytes"] is None else f"{r['stored_bytes'] / h.MiB:10.0f}"
        print(
            f"{r['stack']:9} {r['op']:4} {r['who']:10} {r['n']:2d} {r['median_s']:9.3f} "
            f"{r['min_s']:7.3f} {r['max_s']:7.3f} {rate:6.0f} {stored:>10} {r['oth'] * 100:5.0f}"
        )
    print("\n(MiB/s: the state's tensor bytes, main replicas, over the median time)\n")
    h.print_fs_ratios(summary["ratios"])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.common_args(p)
    p.add_argument("--stack", choices=["megatron", "deepspeed", "both"], default="both")
    p.add_argument("--dir", default="/dev/shm/distckpt-bench")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tp", type=int, default=2, help="Megatron's tensor-parallel size")
    p.add_argument("--hidden", type=int, default=1024, help="Megatron: hidden size")
    p.add_argument("--layers", type=int, default=4, help="Megatron: transformer layers")
    p.add_argument("--vocab", type=int, default=8192, help="Megatron: vocabulary")
    p.add_argument("--heads", type=int, default=16, help="Megatron: attention heads")
    p.add_argument("--seq", type=int, default=512, help="Megatron: max sequence length")
    p.add_argument("--ds-width", type=int, default=2048, help="DeepSpeed: width of the MLP")
    p.add_argument("--ds-layers", type=int, default=8, help="DeepSpeed: linear layers")
    p.add_argument("--ds-stage", type=int, default=1, help="DeepSpeed: ZeRO stage")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    h.main(args, Driver, summarize, print_report, Worker.main)
