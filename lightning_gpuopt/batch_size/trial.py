"""Measured training steps that leave no trace: the trials behind MemoryAwareBatchSize.

A trial is a real training step on a given (micro-)batch -- the LightningModule's ``training_step``
under the precision plugin's context, its ``backward``, and the optimizer's ``step`` with its state in
place -- whose peak memory is read from the probe. Before the first trial, :class:`TrainingState`
copies everything a step can change into host memory outside the device's allocator (so that the
copies neither take device memory nor show in the figures): parameters, buffers, gradients, the
optimizer's state (keeping note of what did not exist yet: lazily created state is removed again),
its parameter groups and step flags, LR schedulers, the RNG states, and the plain attributes of
every submodule (counters, lists, torchmetrics states). ``self.log`` is silenced while trials run,
and no Lightning hook, callback or loop counter is involved. Afterwards everything is put back.

A trial of a micro-batch runs with gradients allocated (zeros when there were none): the state a
micro-batch after the first one starts from. A trial of a whole batch starts without gradients, as
a step that zeroes them first does.

Under FSDP2 (``fully_shard``) a trial is a real sharded step: every unit all-gathers its parameters
in the forward and the backward and reduce-scatters its gradients, so the measured peak holds the
gathered units and the reduce-scatter buffers as a training step's does; parameters, gradients and
optimizer state are this rank's shards (DTensors, copied and counted by their local part). The ranks
must run their trials together: given the micro-batch engine's FSDP2 exchange, the ranks vote before
each of FSDP's collectives (a rank that runs out of memory mid-step stops the others at their next
one instead of leaving them waiting), once after each trial (every rank learns whether any failed,
and every rank resets FSDP's step state when one did), and once before each trial
(:meth:`TrialSteps.agree_size`: every rank runs the smallest size any rank's search asks for).
"""

from __future__ import annotations

import copy
import ctypes
import random
from collections.abc import Mapping
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor

from lightning_gpuopt._compat import local_shard
from lightning_gpuopt._compiled import compiled_frames, is_compiled_anywhere, mark_batch_dynamic
from lightning_gpuopt.batch_size.peak_model import StepMeasurement
from lightning_gpuopt.memory import MemoryProbe, forensics, free_memory, is_oom_error
from lightning_gpuopt.votes import PeerFailure, Status, Vote

__all__ = ["TRIAL_OOM_ACTION", "NoLossInTrial", "RankVotes", "TrainingState", "TrialSteps", "local_bytes"]

#: What the search did about a trial step that ran out of memory (the OOM record's action).
TRIAL_OOM_ACTION = "MemoryAwareBatchSize's search counted this size as too big and went on below it"


class RankVotes(Protocol):
    """What the trial steps need of the ranks under FSDP2 (the micro-batch engine's exchange gives it): the ranks
    vote before each collective, so one rank's OOM stops every rank's step alike."""

    k: int

    def prepare(self) -> None: ...

    def install(self) -> None: ...

    def vote(self, status: Status, k: int) -> list[Vote]: ...

    def recover(self) -> None: ...


class NoLossInTrial(RuntimeError):
    """``training_step`` returned no loss (``None``, a dict without ``"loss"``) for a trial step."""


_PLAIN = (type(None), bool, int, float, str, complex)
_CONTAINERS = (list, dict, set)
# Module internals handled elsewhere (parameters, buffers) or not state (hooks, submodules).
_SKIP_KEYS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})

try:
    import numpy
except ImportError:  # numpy is optional for torch: then there is no NumPy stream to keep
    numpy = None


def _rng_states() -> dict[str, Any]:
    """The global random states of torch (and CUDA, once initialised), NumPy and Python."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch.cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if "torch.cuda" in states:
        torch.cuda.set_rng_state_all(states["torch.cuda"])
    if "numpy" in states:
        numpy.random.set_state(states["numpy"])
    random.setstate(states["python"])


def local_bytes(t: Tensor) -> int:
    """Bytes of ``t`` on this process's device: a DTensor's local shard only (its ``numel`` is the global one)."""
    t = local_shard(t)
    return t.numel() * t.element_size()


class _HostCopy:
    """A tensor's bytes in host memory that no torch allocator owns, and the tensor to put them back into.

    A DTensor (an FSDP2 shard) is copied and put back through its local part.
    """

    __slots__ = ("buffer", "tensor")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor
        data = local_shard(tensor).detach()
        if data.device.type != "cpu":
            data = data.to("cpu")  # host memory: not the device's
        data = data.contiguous()
        self.buffer = bytearray(data.numel() * data.element_size())
        if self.buffer:
            ctypes.memmove(
                (ctypes.c_char * len(self.buffer)).from_buffer(self.buffer), data.data_ptr(), len(self.buffer)
            )

    def restore(self) -> Tensor:
        if self.buffer:
            target = local_shard(self.tensor)
            source = torch.frombuffer(self.buffer, dtype=torch.uint8).view(target.dtype).view(target.shape)
            with torch.no_grad():
                target.copy_(source)
        return self.tensor


class _Copied:
    """A value as it was: tensors as host copies, containers copied one level deep, the rest as is."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        if isinstance(value, Tensor):
            self.value = _HostCopy(value)
        elif isinstance(value, _CONTAINERS):
            self.value = copy.copy(value)
        else:
            self.value = value

    def restore(self, current: Any = None) -> Any:
        value = self.value
        if isinstance(value, _HostCopy):
            return value.restore()
        if isinstance(value, _CONTAINERS) and type(current) is type(value):
            current.clear()  # keep the object others may hold, with its old contents
            if isinstance(current, list):
                current.extend(value)
            else:
                current.update(value)
            return current
        return copy.copy(value) if isinstance(value, _CONTAINERS) else value


class TrainingState:
    """What a training step can change, held in host memory, put back by :meth:`restore`.

    Args:
        trainer: the Trainer (its optimizers and LR schedulers).
        module: the LightningModule.
    """

    def __init__(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.module = module
        self.optimizers = list(trainer.optimizers)
        tensors: dict[int, Tensor] = {}
        for t in [*module.parameters(), *module.buffers()]:
            tensors.setdefault(id(t), t)
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    tensors.setdefault(id(p), p)
        self.tensors = [_HostCopy(t) for t in tensors.values()]
        self.grads = [
            (t, None if t.grad is None else _HostCopy(t.grad))
            for t in tensors.values()
            if isinstance(t, Tensor)
        ]
        self.optimizer_states = [self._capture_optimizer(o) for o in self.optimizers]
        self.schedulers = [
            (config.scheduler, copy.deepcopy(config.scheduler.state_dict()))
            for config in trainer.lr_scheduler_configs
        ]
        self.rng = _rng_states()
        self.attributes = [(m, self._capture_attributes(m)) for m in module.modules()]

    @staticmethod
    def _capture_optimizer(optimizer: torch.optim.Optimizer) -> tuple:
        state = {
            p: {key: _Copied(value) for key, value in per_param.items()}
            for p, per_param in optimizer.state.items()
        }
        groups = [
            {key: _Copied(value) for key, value in group.items() if key != "params"}
            for group in optimizer.param_groups
        ]
        flags = {key: value for key, value in vars(optimizer).items() if isinstance(value, _PLAIN)}
        return state, groups, flags

    @staticmethod
    def _capture_attributes(module: torch.nn.Module) -> dict[str, _Copied]:
        saved = {}
        for key, value in vars(module).items():
            if key in _SKIP_KEYS:
                continue
            if isinstance(value, (_PLAIN, Tensor)) or (
                isinstance(value, _CONTAINERS) and not key.startswith("_")
            ):
                saved[key] = _Copied(value)
        return saved

    def restore(self) -> None:
        """Put everything back as it was when this state was captured."""
        for copied in self.tensors:
            copied.restore()
        for param, grad in self.grads:
            param.grad = None if grad is None else grad.restore()
        for optimizer, (state, groups, flags) in zip(self.optimizers, self.optimizer_states):
            current = optimizer.state
            restored = {
                p: {key: value.restore(current.get(p, {}).get(key)) for key, value in per_param.items()}
                for p, per_param in state.items()
            }
            current.clear()  # lazily created state of the trials goes; the optimizer's own dict stays
            current.update(restored)
            for group, saved in zip(optimizer.param_groups, groups):
                for key, value in saved.items():
                    group[key] = value.restore(group.get(key))
            for key in [k for k, v in vars(optimizer).items() if isinstance(v, _PLAIN) and k not in flags]:
                delattr(optimizer, key)
            for key, value in flags.items():
                setattr(optimizer, key, value)
        for scheduler, saved in self.schedulers:
            scheduler.load_state_dict(copy.deepcopy(saved))
        _set_rng_states(self.rng)
        for module, saved in self.attributes:
            attributes = vars(module)
            for key in [
                k
                for k, v in attributes.items()
                if k not in saved
                and not k.startswith("_")
                and (isinstance(v, (_PLAIN, Tensor)) or isinstance(v, _CONTAINERS))
            ]:
                del attributes[key]  # created by a trial (e.g. an activation kept for a later hook)
            for key, value in saved.items():
                attributes[key] = value.restore(attributes.get(key))


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(local_bytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor))


def _silent_log(*args: Any, **kwargs: Any) -> None:
    return None


class TrialSteps:
    """A context in which :meth:`measure` runs real training steps that leave no trace.

    Args:
        trainer: the Trainer, set up for fitting (model on its device, optimizer created).
        module: the LightningModule.
        probe: the memory probe of the training device.
        batch_idx: passed to ``training_step``.
        exchange: under FSDP2, the micro-batch engine's exchange: the ranks run their trials together
            (see the module docstring); ``None``: this process alone (one device, DDP).

    On exit, everything is restored (see the module docstring) and memory is freed.
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        probe: MemoryProbe,
        batch_idx: int = 0,
        exchange: RankVotes | None = None,
    ) -> None:
        self.trainer = trainer
        self.exchange = exchange
        self.module = module
        self.probe = probe
        self.batch_idx = batch_idx
        self.optimizer = trainer.optimizers[0]
        self.precision = trainer.precision_plugin
        self._state: TrainingState | None = None
        self._saved_attrs: dict[str, Any] = {}
        self._training: list[tuple[torch.nn.Module, bool]] = []
        #: Allocated bytes after the last step that completed, its outputs freed: what every step holds.
        self.held_bytes: int | None = None
        self._params = [
            p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad
        ]
        #: Bytes of the gradients of every trained parameter (this rank's shards under FSDP2).
        self.grad_bytes = sum(local_bytes(p) for p in self._params)
        #: The first line of the last out-of-memory error.
        self.last_error: str | None = None
        #: Bytes of the optimizer's state once a trial's optimizer step ran (``None``: none ran).
        self.state_bytes: int | None = None
        #: Under torch.compile: every trial batch has its batch dimension marked dynamic (one compilation
        #: serves every size), and the frames dynamo compiled during the trials are counted here.
        self.compiled = is_compiled_anywhere(module)
        self.frames_compiled = 0

    def missing_grad_bytes(self) -> int:
        """Bytes of the gradients not allocated now, which the first trial allocates and every later one holds."""
        return sum(local_bytes(p) for p in self._params if p.grad is None)

    def __enter__(self) -> TrialSteps:
        module = self.module
        self._state = TrainingState(self.trainer, module)
        for name in ("log", "log_dict"):
            if name in vars(module):
                self._saved_attrs[name] = vars(module)[name]
            setattr(module, name, _silent_log)
        module.train()
        if self.exchange is not None:
            self.exchange.prepare()
            self.exchange.install()
        return self

    def agree_size(self, size: int | None) -> int | None:
        """The size every rank's next trial step runs at: the smallest any rank asks for; ``None``: no step.

        ``size`` is what this rank's search asks for (``None``: nothing more). Under FSDP2 one vote of every
        rank (a step's all-gathers and reduce-scatters need every rank, and the ranks use the smallest
        answer, so the rank with the least memory leads); elsewhere ``size`` itself.
        """
        if self.exchange is None:
            return size
        asked = [v.k for v in self.exchange.vote(Status.NONE, size or 0) if v.k > 0]
        return min(asked, default=None)

    def __exit__(self, *exc_info: Any) -> None:
        module = self.module
        for name in ("log", "log_dict"):
            if name in self._saved_attrs:
                setattr(module, name, self._saved_attrs[name])
            else:
                vars(module).pop(name, None)
        if self._state is not None:
            self._state.restore()
            self._state = None
        # The trials' own cycles are young (a trial that ran out of memory collected in full already): a
        # full collection here would cost a large share of a search in a process with a large heap.
        free_memory(generation=1)

    def _step_kwargs(self, batch: Any) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"batch": batch}
        if is_param_in_hook_signature(self.module.training_step, "batch_idx", min_args=2):
            kwargs["batch_idx"] = self.batch_idx
        return kwargs

    def measure(
        self, batch: Any, size: int, batch_bytes: int = 0, whole: bool = False
    ) -> StepMeasurement | None:
        """One training step on ``batch`` (``size`` samples, of which ``batch_bytes`` were allocated for this step).

        ``whole``: the step starts without gradients (a whole batch after zeroing), else with them (a
        micro-batch after the first). Returns what forward+backward added at its peak and what the
        optimizer step added, both over the memory held after the step once its outputs are dropped
        (parameters, gradients, optimizer state, first-use workspaces; the batch excluded):
        :attr:`held_bytes`. Or an out-of-memory measurement. Errors other than out-of-memory propagate.

        Under FSDP2 (an ``exchange``) every rank calls it together: ``None`` when another rank ran out of
        memory before this rank's step ended (nothing measured here); an error on any rank raises on every
        rank (this rank's own error, or a ``RuntimeError`` naming the ranks that failed).
        """
        probe, module = self.probe, self.module
        for p in self._params:
            if whole:
                p.grad = None
            elif p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.compiled:
            mark_batch_dynamic(batch, size)
            frames = compiled_frames()
        start = probe.allocated
        state_before = _state_bytes(self.optimizer)
        probe.reset_peak()
        out = loss = None
        forward_backward = step_peak = None
        failed = False
        error: BaseException | None = None
        peer_votes = None
        phase = "forward"
        try:
            with torch.enable_grad():
                with self.precision.train_step_context():
                    out = module.training_step(*self._step_kwargs(batch).values())
                loss = out.get("loss") if isinstance(out, Mapping) else out
                if not isinstance(loss, Tensor):
                    raise NoLossInTrial(
                        "MemoryAwareBatchSize: training_step returned no loss for a trial step (None or a dict without "
                        "'loss'), so the step's memory cannot be measured"
                    )
                phase = "backward"
                type(module).backward(module, loss)
            forward_backward = probe.peak - start
            probe.reset_peak()
            phase = "optimizer step"
            self.optimizer.step()
            step_peak = probe.peak
        except PeerFailure as err:
            # FSDP2: another rank failed, and this one stopped at the vote before one of FSDP's collectives.
            peer_votes = err.votes
        except Exception as err:
            if not is_oom_error(err):
                if self.exchange is None:
                    raise
                error = err  # raised once the other ranks know (they would wait in the next collective)
            else:
                failed = True
                self.last_error = (str(err).strip().splitlines() or [type(err).__name__])[0]
                forensics.failure_caught(err, stage="trial", phase=phase, step=self.trainer.global_step)
        out = loss = None  # outside the except block: the traceback no longer pins the step's tensors
        if self.compiled:
            self.frames_compiled += compiled_frames() - frames
        if self.exchange is not None and self._settle(failed, error, peer_votes):
            return None
        if failed:
            free_memory()
            forensics.action_taken(TRIAL_OOM_ACTION)
            return StepMeasurement(size, None, None)
        held = probe.allocated
        self.held_bytes = held - batch_bytes
        # What the step left allocated beyond its optimizer state -- gradients a whole-batch step created,
        # workspaces and caches made on first use -- is held by every later step too: count it in the
        # base (`held`), not in what forward+backward adds.
        self.state_bytes = _state_bytes(self.optimizer)
        kept = held - start - (self.state_bytes - state_before)
        return StepMeasurement(size, int(forward_backward - kept), max(0, int(step_peak - held)))

    def _settle(self, failed: bool, error: BaseException | None, peer_votes: list | None) -> bool:
        """Under FSDP2, after a trial on every rank: the ranks' verdict. ``True``: another rank's failure stopped
        this step (nothing measured here). Raises on every rank when a step failed other than out of memory."""
        exchange = self.exchange
        status = Status.FATAL if error is not None else Status.OOM if failed else Status.NONE
        votes = peer_votes if peer_votes is not None else exchange.vote(status, exchange.k)
        fatal = [r for r, v in enumerate(votes) if v.status & Status.FATAL]
        if fatal:
            if error is not None:
                raise error
            raise RuntimeError(
                f"MemoryAwareBatchSize: a trial step failed on rank(s) {', '.join(map(str, fatal))} (the error there says "
                "why); every rank stops."
            )
        if any(v.status for v in votes):  # an OOM on some rank: every rank resets FSDP's step state
            exchange.recover()
            free_memory()
        return peer_votes is not None
