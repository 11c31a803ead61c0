"""distckpt's tests, one folder per part of the package.

======================  =============================================================
``storage/``            stores: POSIX, S3 (moto), Azure (Azurite), GCS, plug-ins
``format/``             what is on disk: golden checkpoints, seals, frames, codecs,
                        zarr data types, typed values and names
``commit/``             how a save commits: crash states, racing saves of one name
``planning/``           slices and pure save and read plans
``transfer/``           a rank's data path: workers, slabs, I/O priority
``engine/``             save and load end to end, one process and N x M ranks
``training/``           Checkpoint, CheckpointManager, preemption, elastic resume
``local/``              the node-local tier
``hf/``                 Hugging Face weights
``integrations/``       DCP, torchtitan, Lightning, Accelerate, HF Trainer, trees
``tools/``              the ``distckpt`` command
``comm/``               communicators under every launcher
``hostile/``            hostile and damaged input, fuzzing
``cluster/``            launch/, SLURM, two nodes in namespaces
``docs/``               the README's commands
``support/``            helpers the tests import (servers, launchers, golden values)
``scripts/``            rank scripts run under torchrun or mpiexec (``scripts/rank.py``
                        holds what they share)
``golden/``             checkpoints written by earlier versions
``conftest.py``         the S3 and Azure servers, and ``backend``: one test per store
                        (a directory, S3, Azure) for what every store does alike
======================  =============================================================

Every folder is a package, so test modules are imported by their full name
(``tests.engine.test_matrix``) and helpers as ``tests.support.<module>``: pytest puts the
repository root on ``sys.path`` (its default "prepend" import mode, the folder above the
outermost ``__init__.py``).
"""
