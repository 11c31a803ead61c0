"""distckpt as the format of Hugging Face Accelerate's ``save_state`` / ``load_state``.

One name changes in the script, nothing else::

    from distckpt.integrations.accelerate import DistckptAccelerator

    accelerator = DistckptAccelerator(project_config=ProjectConfiguration(...))  # was Accelerator
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    accelerator.register_for_checkpointing(progress)
    accelerator.save_state("run/step-100")     # every process, as before
    accelerator.load_state("run/step-100")     # on any number of processes

What ``save_state`` writes is one distckpt checkpoint of an object graph
(:class:`distckpt.Checkpoint`): ``models/<i>/...`` (the unwrapped models' parameters and
buffers, by name), ``optimizers/<i>`` (slots keyed by parameter name), ``schedulers/<i>``,
``dataloaders/<i>`` (a stateful loader's state, or a ``SeedableRandomSampler``'s epoch
and seed), ``custom/<i>`` (the objects registered for checkpointing), ``scaler``,
``step`` and ``rng`` (each process's Python, NumPy and torch generators,
:class:`distckpt.RNGState`). Accelerate's own writes a directory of files from rank 0
and pickles the RNG states and the custom objects; here every process writes its part
and the commit is atomic, tensors sharded by FSDP2 (DTensors) are written by the ranks
that hold them, and a load reshards onto another world size (the RNG state of process
``r`` comes from the saved process ``r % saved``). Nothing is pickled unless the
accelerator is made with ``distckpt_options=CheckpointOptions(allow_pickle=True)``.

Both calls are collective, as Accelerate's are: every process calls them. A directory
that already holds a checkpoint is never overwritten (:class:`distckpt.CheckpointExists`).
With ``automatic_checkpoint_naming`` the checkpoints are
``project_dir/checkpoints/checkpoint_<n>``, the oldest beyond ``total_limit`` are removed
whole, and a ``load_state()`` of the newest sets the next ``<n>``. Models, optimizers and
schedulers that DeepSpeed or Megatron-LM manage are not supported (a ``ValueError``).
Launching on CPUs: ``accelerate launch --multi_gpu --num_processes N`` (torchrun inside)
with ``DistckptAccelerator(cpu=True, ...)``, or ``torchrun``. ``accelerate launch --cpu
--num_processes N`` starts one process whatever N is (several only with
``--mpirun_hostfile``), and processes started for several that Accelerate runs alone (no
``cpu=True`` on a machine without GPUs) each see a world of one: a ``DistckptAccelerator``
made in either case warns.
The hooks of ``register_load_state_pre_hook`` run as in Accelerate, and a model a hook
removes from the list is left to it; ``register_save_state_pre_hook`` hooks receive the
models and their state dicts, and a model whose state dict a hook removes is left to it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from accelerate import Accelerator
from accelerate.data_loader import SeedableRandomSampler
from accelerate.utils import DistributedType

import distckpt
from distckpt.numbering import numbered
from distckpt.storage.registry import open_store


def _alone_but_launched_for_more() -> str | None:
    """Why this process, which Accelerate sees as the only one, was launched to be one of
    several (None when nothing says so). Checked when a ``DistckptAccelerator`` is made:
    a save would hold one process's state, or several processes would each write their
    own checkpoint to one path."""
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 1:
        return (
            f"the launcher started {world} processes (WORLD_SIZE={world}) but Accelerate runs "
            "this one alone: on a machine without GPUs, make the accelerator with cpu=True "
            "(DistckptAccelerator(cpu=True, ...)) so that its processes join one gloo group"
        )
    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    if use_cpu and "MASTER_ADDR" in os.environ:
        return (
            "this process runs alone, under `accelerate launch --cpu` with MASTER_ADDR set, as "
            "that launcher leaves it when asked for more than one process: it starts ONE "
            "process whatever --num_processes says (several only with --mpirun_hostfile), so "
            "the checkpoints saved hold one process's state; for N processes on CPUs run "
            "`accelerate launch --multi_gpu --num_processes N` with "
            "DistckptAccelerator(cpu=True, ...), or `torchrun --nproc-per-node N`"
        )
    return None


class DistckptAccelerator(Accelerator):
    """An ``Accelerator`` whose ``save_state`` and ``load_state`` write and read distckpt
    checkpoints; ``distckpt_options`` (a :class:`distckpt.CheckpointOptions`) applies to
    both. Everything else is Accelerate's."""

    def __init__(
        self, *args: Any, distckpt_options: distckpt.CheckpointOptions | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.distckpt_options = distckpt_options or distckpt.CheckpointOptions()
        alone = _alone_but_launched_for_more() if self.num_processes == 1 else None
        if alone is not None:
            warnings.warn(alone, stacklevel=2)

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> str:
        """Write the training state at ``output_dir`` (or the next automatic name) as one
        distckpt checkpoint; every process calls it. Returns the checkpoint's path."""
        self._check_supported()
        config = self.project_configuration
        if config.automatic_checkpoint_naming:
            output_dir = os.path.join(self._numbered_dir(), f"checkpoint_{self.save_iteration}")
        elif output_dir is None:
            raise ValueError("save_state needs an output_dir (automatic naming is off)")
        models = list(self._models)
        if self._save_model_state_pre_hook:
            weights = [self.get_state_dict(m, unwrap=False) for m in models]
            handed = list(weights)
            for hook in self._save_model_state_pre_hook.values():
                hook(models, weights, output_dir)
            kept = {id(w) for w in weights}  # a hook that saved a model popped its weights
            models = [m for m, w in zip(self._models, handed) if id(w) in kept]
        graph = self._graph(models)
        graph.write(output_dir, options=self.distckpt_options.replace(overwrite=False))
        config.iteration += 1
        limit = config.total_limit
        if config.automatic_checkpoint_naming and limit is not None:
            # after the commit (Accelerate removes before it): a failed save loses nothing
            if self.is_main_process:
                parent = self._numbered_dir()
                numbered = _numbered(parent)
                checkpoints = open_store(parent)  # an entry swapped for a link: never followed
                for _, name in numbered[: max(len(numbered) - limit, 0)]:
                    distckpt.remove(checkpoints.child(name))
            self.wait_for_everyone()
        return os.fspath(output_dir)

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        """Restore the training state from ``input_dir`` (or the newest automatic name);
        every process calls it, on any world size."""
        self._check_supported()
        config = self.project_configuration
        if input_dir is None:
            if not config.automatic_checkpoint_naming:
                raise ValueError(
                    "No input_dir provided and automatic checkpoint naming is disabled."
                )
            parent = self._numbered_dir()
            numbered = _numbered(parent)
            if not numbered:
                raise distckpt.CheckpointNotFoundError(f"no checkpoint_<n> in {parent}")
            number, name = numbered[-1]
            input_dir = os.path.join(parent, name)
            config.iteration = number + 1
        models = list(self._models)
        for hook in self._load_model_state_pre_hook.values():
            hook(models, input_dir)
        graph = self._graph(models)
        status = graph.restore(input_dir, options=self.distckpt_options)
        status.assert_existing_objects_matched()
        self.step = graph.step

    def _numbered_dir(self) -> str:
        """Where automatic naming puts ``checkpoint_<n>`` (Accelerate's place)."""
        if self.project_dir is None:
            raise ValueError("automatic_checkpoint_naming needs a project_dir")
        return os.path.join(self.project_dir, "checkpoints")

    def _check_supported(self) -> None:
        if self.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
            raise ValueError(
                f"DistckptAccelerator does not save {self.distributed_type} states; "
                "use accelerate's Accelerator for them"
            )
        if self.distributed_type == DistributedType.FSDP and not self.is_fsdp2:
            raise ValueError(
                "DistckptAccelerator saves FSDP2 (fsdp_version=2) models; FSDP1's flat "
                "parameters are not supported"
            )

    def _graph(self, models: list[Any]) -> distckpt.Checkpoint:
        graph = distckpt.Checkpoint(
            models=[self.unwrap_model(m, keep_torch_compile=False) for m in models],
            optimizers=[getattr(o, "optimizer", o) for o in self._optimizers],
            schedulers=[getattr(s, "scheduler", s) for s in self._schedulers],
            dataloaders=[_LoaderState(d) for d in self._dataloaders],
            custom=list(self._custom_objects),
            step=self.step,
            rng=distckpt.RNGState(),
        )
        if self.scaler is not None:
            graph.scaler = self.scaler
        return graph


class _LoaderState:
    """A prepared dataloader's position: a stateful loader's own state, or the epoch and
    seed of its ``SeedableRandomSampler`` (what Accelerate saves), else nothing."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def _sampler(self) -> Any:
        get = getattr(self.loader, "get_sampler", None)
        sampler = get() if get is not None else None
        return sampler if isinstance(sampler, SeedableRandomSampler) else None

    def state_dict(self) -> dict[str, Any]:
        if getattr(self.loader, "use_stateful_dataloader", False):
            return {"loader": self.loader.state_dict()}
        sampler = self._sampler()
        if sampler is not None:
            return {"epoch": sampler.epoch, "initial_seed": sampler.initial_seed}
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "loader" in state:
            self.loader.load_state_dict(state["loader"])
        sampler = self._sampler()
        if sampler is not None and "epoch" in state:
            sampler.set_epoch(state["epoch"])
            sampler.initial_seed = state["initial_seed"]


def _numbered(parent: str) -> list[tuple[int, str]]:
    """The ``checkpoint_<n>`` entries of ``parent``, oldest first."""
    if not os.path.isdir(parent):
        return []
    found = [(numbered(name, "checkpoint_"), name) for name in os.listdir(parent)]
    return sorted((n, name) for n, name in found if n is not None)
