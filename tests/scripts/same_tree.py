"""Bit-for-bit equality of two checkpoint dicts, for the trainer integration jobs."""

from __future__ import annotations

from typing import Any

import torch


def assert_same(a: Any, b: Any, where: str = "checkpoint") -> None:
    """``a`` and ``b`` hold the same containers (types, keys in order, key types) and the
    same tensors bit for bit (dtype, shape and bytes: NaNs compare by their bits)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: {a!r} {b!r}"
        sides = f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {sides}"
        bits_a = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        bits_b = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(bits_a, bits_b), f"{where}: tensors differ"
        return
    if isinstance(a, dict):
        assert isinstance(b, dict), f"{where}: dict vs {type(b).__name__}"
        keys_a, keys_b = [(type(k), k) for k in a], [(type(k), k) for k in b]
        assert keys_a == keys_b, f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r:.200} vs {b!r:.200}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
        return
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    assert a == b or (a != a and b != b), f"{where}: {a!r:.200} vs {b!r:.200}"
