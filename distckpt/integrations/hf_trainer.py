"""distckpt as the checkpoint format of Hugging Face ``transformers.Trainer``.

One name changes (or one base class, for a Trainer subclass of your own)::

    from distckpt.integrations.hf_trainer import DistckptTrainer

    trainer = DistckptTrainer(model=model, args=args, train_dataset=data)   # was Trainer
    trainer.train(resume_from_checkpoint=True)

    class MyTrainer(DistckptTrainerMixin, SFTTrainer): ...                 # a subclass

Each ``output_dir/checkpoint-<step>`` directory holds the Trainer's ``trainer_state.json``
and, in ``checkpoint-<step>/distckpt``, one distckpt checkpoint of the object graph
``model`` (the unwrapped model's parameters and buffers), ``optimizer`` (slots by
parameter name), ``lr_scheduler``, ``scaler`` and ``rng`` (each process's Python, NumPy
and torch generators; :class:`distckpt.RNGState`), which every process writes together
and which commits atomically; ``trainer_state.json`` is written after the commit, so a
checkpoint is complete once it exists. ``train(resume_from_checkpoint=True)`` resumes
from the newest complete one (an interrupted save is passed over), and a resume reads
every tensor once, resharded to the job. ``save_only_model`` saves the model alone,
``save_total_limit`` removes whole checkpoints (the state first, out of sight at once),
``load_best_model_at_end`` reads the model from the best one. Nothing is pickled.

The Trainer's data position is its optimizer step: a resume skips the batches of the
steps taken. On another world size that is the same data only when the global batch
(processes x ``per_device_train_batch_size`` x ``gradient_accumulation_steps``) is the
same. The model is not written in the Hugging Face format inside checkpoints (use
``trainer.save_model()``, or after the fact :func:`distckpt.export_hf` of
``checkpoint-<step>/distckpt`` with a ``rename`` from ``model/l1/weight`` to
``l1.weight``); DeepSpeed is not supported, and
``push_to_hub`` does not push checkpoints.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

import distckpt
from distckpt.numbering import numbered
from distckpt.storage.registry import open_store

log = logging.getLogger("distckpt")

#: The subdirectory of a Trainer checkpoint that holds the distckpt checkpoint.
STATE = "distckpt"
#: The Trainer's own state file: a checkpoint directory without it is incomplete.
TRAINER_STATE = "trainer_state.json"


def complete_checkpoints(output_dir: str | os.PathLike[str]) -> list[str]:
    """The complete ``checkpoint-<step>`` directories of ``output_dir``, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        step = numbered(name, f"{PREFIX_CHECKPOINT_DIR}-")
        path = os.path.join(output_dir, name)
        if step is not None and os.path.isfile(os.path.join(path, TRAINER_STATE)):
            found.append((step, path))
    return [path for _, path in sorted(found)]


class DistckptTrainerMixin:
    """Makes a ``transformers.Trainer`` (subclass) save and resume through distckpt; put it
    first among the bases. ``distckpt_options`` (a :class:`distckpt.CheckpointOptions`)
    applies to every save and load."""

    distckpt_options: distckpt.CheckpointOptions = distckpt.CheckpointOptions()
    _distckpt_restore: tuple[str, distckpt.Checkpoint] | None = None

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kw: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` picks the newest complete
        checkpoint of ``output_dir``."""
        if resume_from_checkpoint is True:
            found = complete_checkpoints(self.args.output_dir)  # type: ignore[attr-defined]
            if not found:
                raise ValueError(
                    f"No valid checkpoint found in output directory ({self.args.output_dir})"  # type: ignore[attr-defined]
                )
            resume_from_checkpoint = found[-1]
        return super().train(resume_from_checkpoint, *args, **kw)  # type: ignore[misc]

    # ----------------------------------------------------------------- saving

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        trainer: Any = self
        args = trainer.args
        if trainer.hp_search_backend is None and trial is None:
            trainer.store_flos()
        run_dir = trainer._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
        graph = distckpt.Checkpoint(model=self._unwrapped())
        if not args.save_only_model:
            graph.optimizer = _optimizer(trainer.optimizer)
            graph.lr_scheduler = _scheduler(trainer.lr_scheduler)
            if trainer.accelerator.scaler is not None:
                graph.scaler = trainer.accelerator.scaler
            graph.rng = distckpt.RNGState()
        graph.write(os.path.join(output_dir, STATE), options=self.distckpt_options)  # collective
        saving = (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
        if args.save_strategy in saving and trainer.state.best_global_step:
            best = os.path.join(
                run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.best_global_step}"
            )
            if os.path.exists(best):
                trainer.state.best_model_checkpoint = best
        if not args.should_save:
            return
        self._record_callback_states()
        _write_atomically(os.path.join(output_dir, TRAINER_STATE), trainer.state)
        self._rotate(run_dir)

    def _record_callback_states(self) -> None:
        from transformers.trainer_callback import ExportableState

        trainer: Any = self
        callbacks = [*trainer.callback_handler.callbacks, trainer.control]
        for callback in (cb for cb in callbacks if isinstance(cb, ExportableState)):
            name = type(callback).__name__
            if isinstance(trainer.state.stateful_callbacks[name], list):
                trainer.state.stateful_callbacks[name].append(callback.state())
            else:
                trainer.state.stateful_callbacks[name] = callback.state()

    def _rotate(self, run_dir: str) -> None:
        """Keep ``save_total_limit`` checkpoints (the newest and the best always)."""
        trainer: Any = self
        limit = trainer.args.save_total_limit
        checkpoints = complete_checkpoints(run_dir)
        if limit is None or limit <= 0 or len(checkpoints) <= limit:
            return
        protected = {checkpoints[-1]}
        if trainer.state.best_model_checkpoint is not None:
            protected.add(os.path.normpath(trainer.state.best_model_checkpoint))
        doomed = [c for c in checkpoints if c not in protected]
        # Through the run directory: an entry of it swapped for a link is never followed.
        run = open_store(run_dir)
        for path in doomed[: len(checkpoints) - max(limit, len(protected))]:
            name = os.path.basename(path)
            try:
                run.delete(f"{name}/{TRAINER_STATE}")  # incomplete from here on
                distckpt.remove(run.child(f"{name}/{STATE}"), missing_ok=True)
                run.delete_tree(name)  # what else was put there
            except distckpt.CheckpointError as exc:
                log.warning("not removing %s: %s", path, exc)

    # ---------------------------------------------------------------- loading

    def _unwrapped(self, model: Any = None) -> Any:
        trainer: Any = self
        return trainer.accelerator.unwrap_model(model if model is not None else trainer.model)

    def _restoring(self, checkpoint: str, model: Any = None) -> distckpt.Checkpoint:
        """The graph restoring ``checkpoint``: made, and its model restored, at the first
        call; what is assigned to it later is restored as it is assigned (one index read)."""
        if self._distckpt_restore is None or self._distckpt_restore[0] != checkpoint:
            graph = distckpt.Checkpoint(model=self._unwrapped(model))
            status = graph.restore(os.path.join(checkpoint, STATE), options=self.distckpt_options)
            status.assert_nontrivial_match()
            self._distckpt_restore = (checkpoint, graph)
        return self._distckpt_restore[1]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        self._restoring(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        trainer: Any = self
        if checkpoint is None:
            return
        graph = self._restoring(checkpoint)
        graph.optimizer = _optimizer(trainer.optimizer)
        graph.lr_scheduler = _scheduler(trainer.lr_scheduler)

    def _load_scaler(self, checkpoint: str | None) -> None:
        trainer: Any = self
        if checkpoint is not None and trainer.accelerator.scaler is not None:
            self._restoring(checkpoint).scaler = trainer.accelerator.scaler

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            self._restoring(checkpoint).rng = distckpt.RNGState()

    def _load_best_model(self) -> None:
        trainer: Any = self
        best = trainer.state.best_model_checkpoint
        graph = distckpt.Checkpoint(model=self._unwrapped())
        status = graph.restore(os.path.join(best, STATE), options=self.distckpt_options)
        status.assert_nontrivial_match()


class DistckptTrainer(DistckptTrainerMixin, Trainer):
    """``transformers.Trainer`` saving and resuming through distckpt."""


def _optimizer(obj: Any) -> Any:
    """The optimizer that Accelerate's wrapper holds (or ``obj``)."""
    return getattr(obj, "optimizer", obj)


def _scheduler(obj: Any) -> Any:
    """The scheduler that Accelerate's wrapper holds (or ``obj``; a torch scheduler's
    ``optimizer`` attribute is its optimizer, not a wrapped scheduler)."""
    return getattr(obj, "scheduler", obj)


def _write_atomically(path: str, state: Any) -> None:
    """``state.save_to_json(path)``, through a temporary file renamed into place."""
    folder = os.path.dirname(path)
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=".trainer_state.")
    os.close(fd)
    try:
        state.save_to_json(temporary)
        with open(temporary, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
