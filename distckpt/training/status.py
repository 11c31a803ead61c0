"""What ``Checkpoint.restore`` returns: a status to assert on, as in TensorFlow.

* :meth:`CheckpointLoadStatus.assert_consumed`: every value in the checkpoint was
  matched to an object of some rank, every object of this rank's graph received a
  value, and nothing waits for a lazy module.
* :meth:`CheckpointLoadStatus.assert_existing_objects_matched`: every object that exists
  in the graph now received a value (the checkpoint may hold more).
* :meth:`CheckpointLoadStatus.assert_nontrivial_match`: something besides the save
  counter was restored.
* :meth:`CheckpointLoadStatus.expect_partial`: do not warn about checkpoint values left
  unmatched. Without it, the Checkpoint logs one warning (``logging``, on rank 0)
  listing them at its next ``save``, ``write`` or ``restore``, or when it is garbage
  collected, whichever comes first.

The status is live: values applied later by delayed restores count when asserted.
Failed assertions raise :class:`UnmatchedError`, which is also an ``AssertionError``.

Consumption is over the job: with pipeline parallelism each rank's graph holds its own
stages, and a checkpoint value another rank matched is consumed; one no rank matched is
not, on every rank. The restore agrees on this as it runs (see
:mod:`distckpt.training.session`), so asserting needs no communication and any rank may
assert alone. Objects that received no value are this rank's own.
"""

from __future__ import annotations

from typing import Any

from distckpt.errors import CheckpointError
from distckpt.training.handlers import collect
from distckpt.training.session import SAVE_COUNTER, RestoreSession


class UnmatchedError(CheckpointError, AssertionError):
    """A restore status assertion failed; the message lists what did not match."""


def _listing(title: str, names: list[str]) -> str:
    return f"{title} ({len(names)}): " + ", ".join(names)


class CheckpointLoadStatus:
    """The status of :meth:`Checkpoint.restore <distckpt.training.Checkpoint.restore>`.

    Example::

        status = ckpt.restore(distckpt.latest_checkpoint("run"))
        status.assert_existing_objects_matched()   # the model got every value it has
    """

    def __init__(self, session: RestoreSession, root: Any) -> None:
        self._session = session
        self._root = root

    @property
    def path(self) -> str:
        """The checkpoint this status restores from."""
        return str(self._session.path)

    def _unmatched_objects(self) -> list[str]:
        leaves, aliases = collect(self._root, existing_only=True)
        names = set(leaves) | set(aliases)
        names.discard(SAVE_COUNTER)
        return sorted(names - self._session.matched)

    def assert_consumed(self) -> CheckpointLoadStatus:
        """Raise :class:`UnmatchedError` unless the checkpoint and the graph matched fully:
        every checkpoint value by an object of some rank of the job, every object of this
        rank's graph by a value."""
        problems = []
        unused = self._session.unused()
        if unused:
            problems.append(_listing("values in the checkpoint not matched to any object", unused))
        unmatched = self._unmatched_objects()
        if unmatched:
            problems.append(_listing("objects that received no value", unmatched))
        pending = sorted(self._session.pending)
        if pending:
            problems.append(_listing("values waiting for a lazy module's first call", pending))
        if problems:
            raise UnmatchedError(f"restore of {self.path} is not complete: " + "; ".join(problems))
        return self

    def assert_existing_objects_matched(self) -> CheckpointLoadStatus:
        """Raise :class:`UnmatchedError` if an object in the graph received no value."""
        unmatched = self._unmatched_objects()
        if unmatched:
            raise UnmatchedError(
                f"restore of {self.path}: " + _listing("objects that received no value", unmatched)
            )
        return self

    def assert_nontrivial_match(self) -> CheckpointLoadStatus:
        """Raise :class:`UnmatchedError` if nothing but the save counter was restored."""
        if not (self._session.matched - {SAVE_COUNTER}):
            raise UnmatchedError(f"restore of {self.path} matched no object of the graph")
        return self

    def expect_partial(self) -> CheckpointLoadStatus:
        """Silence the warning about checkpoint values left unmatched."""
        self._session.expect_partial = True
        return self


class InitializationOnlyStatus:
    """The status of ``restore(None)``: nothing was restored (a fresh start).

    Its assertions fail, as TensorFlow's do; ``expect_partial`` does nothing.
    """

    path = None

    def _fail(self) -> InitializationOnlyStatus:
        raise UnmatchedError("no checkpoint was given (path None): nothing was restored")

    def assert_consumed(self) -> InitializationOnlyStatus:
        return self._fail()

    def assert_existing_objects_matched(self) -> InitializationOnlyStatus:
        return self._fail()

    def assert_nontrivial_match(self) -> InitializationOnlyStatus:
        return self._fail()

    def expect_partial(self) -> InitializationOnlyStatus:
        return self
