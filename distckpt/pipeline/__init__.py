"""One save pipeline and one restore pipeline, which every kind of save and restore plugs
into.

A *kind* knows one format and nothing of the others: the engine's checkpoints
(:mod:`distckpt.engine.save`, :mod:`distckpt.engine.load`), Hugging Face weights
(:mod:`distckpt.hf.save`, :mod:`distckpt.tools.export_hf`, :mod:`distckpt.hf.load`) and
the node-local tier (:mod:`distckpt.local.save`, :mod:`distckpt.local.restore`). The
pipeline does what all of them need: it runs the stages in the same order on every rank,
makes a failure on any rank the same error on every rank (no rank is left waiting in a
collective that the others have abandoned), runs a save in the background, times the
stages, shows progress where someone watches, and lets the kind clean up after a
failure. A new kind of save is a :class:`SaveKind` (a planner and a writer, in four
stages); a new kind of restore is a :class:`RestoreKind`.

**Save** (:func:`save`, :func:`save_blocking`); every rank makes every call, in this
order (collectives marked *):

0. *Capture*: ``kind.check()`` (this rank's arguments refused?), then
   ``kind.capture(state)`` on the calling thread; or, with ``async_save``, a snapshot into
   reusable host buffers on the calling thread and ``kind.hosted(snapped)`` on a
   background thread (:mod:`distckpt.pipeline.background`), where the stages below run.
1. *Describe*: ``kind.describe(local)``, without communication.
2. *Plan* (*): ``kind.plan(comm, described, error)``: the ranks agree on a plan (the
   coordinator validates and decides, or every rank decides alike from what all sent),
   and every rank returns it or raises the same error. ``described`` is the
   :class:`~distckpt.comm.outcome.Failure` of this rank's ``error`` when step 0 or 1
   failed: the plan step reports it on every rank before a byte is written.
3. *Write*: ``kind.write(comm, plan, clock)``: this rank's share; returns its report.
   An exception becomes the :class:`~distckpt.comm.outcome.Failure` the commit reports.
4. *Commit* (*): ``kind.commit(comm, plan, report, error)``: once every rank's report
   is in, the save is made durable and visible; else every rank raises the first failure
   (and the kind removes what the save wrote).
5. ``kind.finish(comm, plan, committed, timings)``, with what the commit returned: this rank's
   :class:`~distckpt.pipeline.results.SaveResult`.

An exception that escapes steps 2 to 4 (a dead rank, a time-out in a collective) goes
through ``kind.abort(exc)``, which undoes what this rank began and says what to raise.

A new kind of save, in outline: the coordinator plans and publishes through
:func:`~distckpt.comm.outcome.coordinate`, which gives every rank the decision or the
same error::

    class Mine(SaveKind[dict, list]):
        def __init__(self, store, options):
            self.store, self.options, self.where = store, options, store.url

        def capture(self, state):                     # every rank, no communication
            return state

        def describe(self, local):                    # every rank, no communication
            return describe_mine(local)

        def plan(self, comm, described, error):       # collective
            return coordinate(comm, described, plan_on_coordinator, error=error)

        def write(self, comm, plan, clock):           # every rank, its share
            return write_mine(self.store, plan[comm.rank])

        def commit(self, comm, plan, report, error):  # collective
            coordinate(comm, report, publish, error=error, settle=remove_unless_published)

        def finish(self, comm, plan, committed, timings):
            return SaveResult(self.store.url, timings=timings)

    pipeline.save(Mine(store, options), state, comm)

**Restore** (:func:`restore`); every rank, collectives marked *:

1. *Metadata* (*): ``kind.read_metadata(comm)``: the source, what is stored, read once
   and shared (an error is the same on every rank, and raised once the ranks agree,
   step 5).
2. *Match*: ``kind.match(comm, source, state, result)`` checks every name, kind, shape
   and dtype before anything is read (None: a name is missing under ``strict``), then
   ``kind.offer(comm, matched)`` is what this rank tells the others.
3. *Agree* (*): one :func:`~distckpt.pipeline.matching.agree_names`: every rank's offer,
   and the names that no rank restores (of ``source.stored``; an error under ``strict``).
4. *Read*: ``kind.read(comm, source, matched, offers, result)``, only when every rank
   can read.
   ``kind.again(comm)`` may ask for steps 2 to 4 once more (a copy failed its checksum
   and another holds one).
5. *Settle* (*): every rank raises if any rank failed; else the result, timed and logged.
"""

from __future__ import annotations

from distckpt.pipeline.clock import Clock, communicator
from distckpt.pipeline.restore import RestoreKind, restore
from distckpt.pipeline.save import SaveKind, save, save_blocking

__all__ = [
    "RestoreKind",
    "SaveKind",
    "Clock",
    "communicator",
    "restore",
    "save",
    "save_blocking",
]
