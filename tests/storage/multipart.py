"""What the object stores add to the shipped conformance suite, written once for the S3
suite (tests/storage/test_storage.py) and the Azure one (tests/storage/test_cloud.py)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from distckpt.testing import MiB, payload, write_out_of_order


class MultipartTests:
    """A piece written in parts, out of order, reads back whole and by ranges: one
    request when it fits in one part, else a multipart upload (the suites set the part
    size to 5 MiB). A suite adds what its service shows of the upload in
    :meth:`check_upload`."""

    @pytest.mark.parametrize("size", [1000, 5 * MiB, 13 * MiB + 12345])
    def test_multipart_out_of_order(self, store: Any, size: int) -> None:
        data = payload(size, seed=size)
        handle = store.create("x/piece.bin", size_hint=size)
        write_out_of_order(handle, data, random.Random(size))
        handle.finish()
        assert store.read("x/piece.bin") == data
        with store.open("x/piece.bin", size) as reader:
            runs = [(0, 10), (size - 7, 7), (size // 2, 4096)]
            reader.will_need(runs)
            for offset, length in runs:
                assert reader.read(offset, length) == data[offset : offset + length]
            assert reader.read(size - 3, 100) == data[-3:]  # a short read at the end
            assert reader.read(size + 5, 10) == b""
        self.check_upload(store, handle, size)

    def check_upload(self, store: Any, handle: Any, size: int) -> None:
        """What the service shows of the upload of ``size`` bytes just finished."""
