"""Test support that ships with distckpt: the conformance suite of storage backends.

Import it in tests only: it needs pytest, which distckpt itself never does.

    from distckpt.testing import StoreTests

    class TestMyStore(StoreTests):
        capabilities = MyStore.capabilities

        @pytest.fixture
        def store(self, tmp_path):
            return MyStore(tmp_path / "store")   # a fresh, empty store

See :class:`StoreTests` for the optional hooks.
"""

from distckpt.testing.store_helpers import MiB, needs, payload, write_out_of_order
from distckpt.testing.store_suite import StoreTests

__all__ = ["MiB", "StoreTests", "needs", "payload", "write_out_of_order"]
