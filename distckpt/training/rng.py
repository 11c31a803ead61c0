"""The random number generators of this process, as one trackable object."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from distckpt.errors import CorruptCheckpointError
from distckpt.items import PerRank
from distckpt.numbering import number


def _unwrap(value: Any) -> Any:
    return value.value if isinstance(value, PerRank) else value


class RNGState:
    """The global RNG states of torch (CPU, and CUDA when initialized), NumPy and Python.

    Each rank saves its own (:class:`distckpt.PerRank`), so every rank resumes its own
    random stream. Restored on another world size, rank ``r`` gets what rank
    ``r % saved_world_size`` saved, and distckpt logs a warning::

        ckpt = distckpt.Checkpoint(net=net, rng=distckpt.training.RNGState())

    Only the generators this object knows are captured: pass your own
    ``torch.Generator`` objects' states separately.
    """

    def state_dict(self) -> dict[str, Any]:
        """This rank's generator states: tensors and typed values, each per rank."""
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {
            "torch": PerRank(torch.get_rng_state()),
            "numpy": PerRank([kind, [int(k) for k in keys], int(pos), int(has_gauss), cached]),
            "python": PerRank([version, list(internal), gauss]),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, t in enumerate(torch.cuda.get_rng_state_all()):
                state[f"cuda{i}"] = PerRank(t)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set the generators from :meth:`state_dict`'s layout (entries may be missing).
        A stored state the generators refuse is a
        :class:`~distckpt.errors.CorruptCheckpointError` naming the generator."""
        try:
            self._load(state)
        except (
            TypeError,
            ValueError,
            OverflowError,
            RuntimeError,
            LookupError,
            AttributeError,
        ) as exc:
            raise CorruptCheckpointError(
                f"RNGState: a stored generator state is malformed ({type(exc).__name__}: "
                f"{str(exc)[:200]})"
            ) from None

    def _load(self, state: dict[str, Any]) -> None:
        if "torch" in state:
            torch.set_rng_state(_unwrap(state["torch"]).to(torch.uint8))
        if "numpy" in state:
            kind, keys, pos, has_gauss, cached = _unwrap(state["numpy"])
            np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        if "python" in state:
            version, internal, gauss = _unwrap(state["python"])
            random.setstate((version, tuple(internal), gauss))
        cuda = sorted(k for k in state if k.startswith("cuda"))
        if cuda and torch.cuda.is_available():
            for key in cuda:
                index = number(key[4:])
                if index is not None and index < torch.cuda.device_count():
                    torch.cuda.set_rng_state(_unwrap(state[key]), index)
