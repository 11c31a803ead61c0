"""CUDA tensors in and out: staging slabs, background and lazy saves, views, RNG, FSDP2 on
NCCL, DTensors of several ranks sharing one GPU.

These tests need a CUDA GPU and skip without one. ``DISTCKPT_TEST_CUDA_ON_CPU=1`` runs the
one-process ones on CPU tensors instead (streams become no-ops), to try the tests
themselves on a machine without a GPU; CI runs neither.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from distckpt.dtypes import SUPPORTED
from tests.engine.test_single_process import load1, random_tensor, save1
from tests.support.launch_util import SCRIPTS, check, output, run_ranks
from tests.support.make_golden import tensor_bytes

ON_CPU = os.environ.get("DISTCKPT_TEST_CUDA_ON_CPU") == "1"
HAVE_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAVE_CUDA else "cpu"
pytestmark = [
    pytest.mark.skipif(not (HAVE_CUDA or ON_CPU), reason="needs a CUDA GPU"),
    pytest.mark.timeout(300),
]
needs_gpu = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def small_slabs() -> Any:
    """Slabs of 64 KiB: every tensor here crosses several."""
    distckpt.set_staging(slab_bytes=64 << 10, slabs=3)
    yield
    distckpt.set_staging()


def other_stream() -> Any:
    return torch.cuda.stream(torch.cuda.Stream()) if HAVE_CUDA else contextlib.nullcontext()


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t.to(DEVICE)


def same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), what
    assert tensor_bytes(got.cpu()) == tensor_bytes(want.cpu()), what


def _state(seed: int) -> dict[str, torch.Tensor]:
    return {
        str(dtype).replace("torch.", ""): on_device(random_tensor(dtype, (67, 515), seed + i))
        for i, dtype in enumerate(SUPPORTED)
    }


@pytest.mark.parametrize("io_workers", [1, 4])
def test_every_dtype_to_and_from_the_gpu(tmp_path: Path, io_workers: int) -> None:
    state = _state(0)
    save1(state, tmp_path / "ck", small_bytes=1024, inner_bytes=8192, io_workers=io_workers)
    flat = {k: torch.empty_like(v) for k, v in state.items()}
    load1(flat, tmp_path / "ck", io_workers=io_workers)
    holders = {
        k: torch.empty(v.shape[::-1], dtype=v.dtype, device=DEVICE) for k, v in state.items()
    }
    views = {k: h.t() for k, h in holders.items()}  # non-contiguous GPU targets
    load1(views, tmp_path / "ck", io_workers=io_workers)
    for k, v in state.items():
        assert flat[k].device.type == DEVICE and views[k].device.type == DEVICE
        same_bits(flat[k], v, k)
        same_bits(views[k].contiguous(), v, k)


def test_gpu_views_as_sources_and_targets(tmp_path: Path) -> None:
    def views(base: torch.Tensor, cplx: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"t": base.t(), "strided": base[::7, 3::5], "conj": cplx.conj(), "row": base[17]}

    host = views(
        random_tensor(torch.float32, (300, 200), 1), random_tensor(torch.complex64, (40, 30), 2)
    )
    # resolved on the host: a conjugate is a sign flip there, NaN payloads kept, as distckpt
    # stores it on any device (CUDA's conj kernel, .cpu() of a view included, does not)
    want = {k: v.resolve_conj().contiguous() for k, v in host.items()}
    state = views(on_device(host["t"].t()), on_device(host["conj"].conj()))
    save1(state, tmp_path / "ck", small_bytes=256, inner_bytes=4096, io_workers=3)
    big = torch.zeros(400, 400, device=DEVICE)
    target = {
        "t": big[:200, :300],
        "strided": big[250:, 300:][: want["strided"].shape[0], : want["strided"].shape[1]],
        "conj": torch.zeros(30, 40, dtype=torch.complex64, device=DEVICE).t(),
        "row": torch.zeros(2, 200, device=DEVICE)[1],
    }
    load1(target, tmp_path / "ck", io_workers=3)
    for k, v in want.items():
        same_bits(target[k].contiguous(), v, k)
    assert not big[200:250].any()  # nothing written outside the targets


def test_conjugate_and_negative_views_are_sign_flips(tmp_path: Path) -> None:
    """Conjugate and negative views, as sources (blocking and background saves) and as
    targets, are sign flips: every NaN keeps its payload, as on the host. (CUDA's
    conjugation kernels make NaNs canonical: a checkpoint would depend on the device.)"""
    cplx = random_tensor(torch.complex64, (64, 48), 3)
    real = random_tensor(torch.float32, (64, 48), 4)
    assert cplx.imag.isnan().any() and real.isnan().any()

    def views(c: torch.Tensor, r: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "conj": c.conj(),
            "neg": torch._neg_view(r),
            "imag": c.conj().imag,  # a negative view of a conjugate's imaginary parts
            "small": c[:2, :3].conj(),  # small: comes over whole
        }

    want = {k: v.resolve_conj().resolve_neg().clone() for k, v in views(cplx, real).items()}
    state = views(on_device(cplx), on_device(real))
    kw: dict[str, Any] = {"small_bytes": 256, "inner_bytes": 4096}
    save1(state, tmp_path / "a", **kw)
    save1(state, tmp_path / "b", async_save=True, **kw).wait()
    for ck in ("a", "b"):
        flat = {k: torch.zeros_like(v, device=DEVICE) for k, v in want.items()}
        load1(flat, tmp_path / ck)
        for k, v in want.items():
            same_bits(flat[k], v, f"{ck} {k}")
        # targets with the bits (each its own memory): the memory gets the stored values
        c = [torch.zeros_like(cplx, device=DEVICE) for _ in range(3)]
        r = torch.zeros_like(real, device=DEVICE)
        targets = views(c[0], r)
        targets["imag"] = views(c[1], r)["imag"]
        targets["small"] = views(c[2], r)["small"]
        load1(targets, tmp_path / ck)
        same_bits(c[0], cplx, f"{ck} conj target")
        same_bits(c[1].imag, cplx.imag, f"{ck} imag target")
        same_bits(c[2][:2, :3], cplx[:2, :3], f"{ck} small target")
        same_bits(r, real, f"{ck} negative target")


def test_background_save_keeps_the_values_of_the_call(tmp_path: Path) -> None:
    state = _state(10)
    want = {k: v.clone() for k, v in state.items()}
    handle = distckpt.save(state, tmp_path / "ck", async_save=True, small_bytes=1024)
    with other_stream(), torch.no_grad():  # training goes on at once, on another stream
        for v in state.values():
            v.copy_(torch.zeros_like(v.view(torch.uint8)).view(v.dtype))
    handle.wait()
    got = {k: torch.empty_like(v) for k, v in state.items()}
    load1(got, tmp_path / "ck")
    for k, v in want.items():
        same_bits(got[k], v, k)


def test_lazy_saves_through_the_manager(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    model = model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 64, device=DEVICE), torch.randn(32, 4, device=DEVICE)

    def step() -> None:
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()

    step()
    ckpt = distckpt.Checkpoint(model=model, optimizer=opt)
    with distckpt.CheckpointManager(ckpt, tmp_path, prepare_async=True) as manager:
        for mode in ("async", "lazy"):
            want = {k: v.clone() for k, v in model.state_dict().items()}
            slots = {
                (i, k): v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()
            }
            path = manager.save(async_save=mode == "async", lazy=mode == "lazy").path
            step()  # waits for a lazy save's copies before changing anything
            with other_stream(), torch.no_grad():
                for p in model.parameters():
                    p.add_(1)
            manager.sync()
            fresh = torch.nn.Sequential(
                torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)
            ).to(DEVICE)
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
            distckpt.Checkpoint(model=fresh, optimizer=fresh_opt).restore(path).assert_consumed()
            for k, v in fresh.state_dict().items():
                same_bits(v, want[k], f"{mode} {k}")
            for i, s in enumerate(fresh_opt.state.values()):
                for k, v in s.items():
                    same_bits(v, slots[(i, k)], f"{mode} slot {i} {k}")


@needs_gpu
def test_cuda_rng_state_round_trips(tmp_path: Path) -> None:
    torch.cuda.manual_seed(123)
    torch.randn(10, device="cuda")
    ckpt = distckpt.Checkpoint(rng=distckpt.RNGState())
    path = ckpt.save(tmp_path / "ckpt")
    after = torch.randn(1000, device="cuda")
    torch.randn(77, device="cuda")  # move on
    ckpt.restore(path).assert_consumed()
    same_bits(torch.randn(1000, device="cuda"), after, "CUDA random stream")


# --------------------------------------------------------------------------- several ranks


@needs_gpu
def test_fsdp2_on_nccl_through_checkpoint(tmp_path: Path) -> None:
    proc = run_ranks(1, SCRIPTS / "cuda_ranks.py", "fsdp", str(tmp_path), timeout=240)
    check(proc)
    assert "OK fsdp 0" in proc.stdout, output(proc)


@needs_gpu
@pytest.mark.parametrize("saved,restored", [(2, [1, 3]), (3, [1, 2])])
def test_cuda_dtensors_of_ranks_sharing_a_gpu(
    tmp_path: Path, saved: int, restored: list[int]
) -> None:
    script = SCRIPTS / "cuda_ranks.py"
    proc = run_ranks(saved, script, "dtensor-save", str(tmp_path), timeout=240)
    check(proc)
    for world in restored:
        proc = run_ranks(world, script, "dtensor-restore", str(tmp_path), timeout=240)
        check(proc)
        for rank in range(world):
            assert f"OK dtensor-restore {rank}" in proc.stdout, output(proc)


def test_incremental_save_sees_a_change_made_on_another_stream(tmp_path: Path) -> None:
    """A frozen GPU tensor changed in place by a kernel queued late on another stream (no
    version counter moves), that stream then joined to the current one as CUDA asks,
    right before an incremental save: the save hashes the new bytes (its copies wait for
    the work queued on the current stream) and writes the piece, never the stale one."""
    layout = {"small_bytes": 1024, "inner_bytes": 8192}
    frozen = on_device(random_tensor(torch.float32, (256, 512), 3))
    trained = on_device(random_tensor(torch.float32, (64, 8), 4))
    state = {"frozen": frozen, "trained": trained}
    save1(state, tmp_path / "c1", **layout)
    unchanged = save1(state, tmp_path / "c2", base=tmp_path / "c1", **layout)
    assert unchanged.pieces_reused == 2
    if HAVE_CUDA:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # the change lands late on that stream
            frozen.data[-1, -1].add_(1.0)
        torch.cuda.current_stream().wait_stream(side)
    else:
        frozen.data[-1, -1].add_(1.0)
    changed = save1(state, tmp_path / "c3", base=tmp_path / "c2", **layout)
    assert changed.pieces_reused == 1  # trained only: frozen was written
    back = {k: torch.empty_like(v) for k, v in state.items()}
    load1(back, tmp_path / "c3")
    for k, v in state.items():
        same_bits(back[k], v, k)


def test_dcp_bridge_with_gpu_tensors(tmp_path: Path) -> None:
    """``dcp.save`` of GPU tensors through the bridge, and ``dcp.load`` into GPU targets of
    the stored dtype and of another (cast through a host buffer of the stored dtype, as
    DCP's own reader casts: a cast on the GPU gives other NaN payloads), bit for bit as
    through DCP's own files."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from distckpt.integrations.dcp import DistckptReader, DistckptWriter

    state = {"w": on_device(random_tensor(torch.float32, (129, 77), 5)), "step": 3}
    got = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is running
        for writer, reader in (
            (dcp.FileSystemWriter(tmp_path / "fs"), dcp.FileSystemReader(tmp_path / "fs")),
            (DistckptWriter(tmp_path / "ours"), DistckptReader(tmp_path / "ours")),
        ):
            dcp.save(state, storage_writer=writer)
            same = {"w": torch.zeros_like(state["w"]), "step": 0}
            dcp.load(same, storage_reader=reader)
            cast = {"w": torch.zeros(129, 77, dtype=torch.bfloat16, device=DEVICE), "step": 0}
            reader.reset()
            dcp.load(cast, storage_reader=reader)
            assert same["step"] == cast["step"] == 3 and cast["w"].device == state["w"].device
            got.append((same["w"], cast["w"]))
    same_bits(got[1][0], state["w"], "same dtype")
    same_bits(got[1][1], got[0][1], "cast, as DCP's own")
    same_bits(got[1][1], state["w"].cpu().bfloat16(), "cast on the host")


@needs_gpu
def test_device_tensors_get_at_most_the_device_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a count from the user, a save and a load of GPU tensors use at most
    DEVICE_WORKERS workers, and say so."""
    from distckpt.transfer import workers

    for name in (workers.ENV, *workers.LOCAL_SIZE_VARS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4 * workers.DEVICE_WORKERS)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4 * workers.DEVICE_WORKERS)))
    state = _state(3)
    saved = distckpt.save(state, tmp_path / "c")
    back = {k: torch.empty_like(v) for k, v in state.items()}
    loaded = distckpt.load(back, tmp_path / "c")
    for result in (saved, loaded):
        assert result.io_workers == workers.DEVICE_WORKERS
        assert result.io_workers_reason.startswith("at most 8 for device tensors")
    for k, v in state.items():
        same_bits(back[k], v, k)
