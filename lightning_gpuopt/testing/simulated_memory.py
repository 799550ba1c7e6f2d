"""SimulatedMemory: the CPU as a GPU-like memory device, for testing memory logic on real training code.

It counts new allocations while entered (the ``"allocator"`` backend: a counting c10 CPU allocator built on
first use, which sees kernel-internal temporaries and raises at allocation time; the ``"dispatch"``
backend, pure Python, counts op outputs on the entering thread), tensors that existed before entering the
first time training touches them (module parameters and buffers, optimizer state, inputs), what
collectives allocate (counted, never raising), and DataLoader batches moved to the simulated device as
Lightning moves them to a GPU. docs/memory.md lists what is and is not modelled.

The instance is the active :class:`~lightning_gpuopt.memory.MemoryProbe` while entered, so
``get_probe()`` returns it and everything built on the probe runs unchanged on CPU.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
import torch.distributed as _dist
from torch.optim import optimizer as _optim

from lightning_gpuopt import _compat
from lightning_gpuopt.memory import forensics
from lightning_gpuopt.memory.counting_allocator import NativeCounter, NativeUnavailableError
from lightning_gpuopt.memory.probe import CpuMemoryProbe, MemoryProbe, pop_active_probe, push_active_probe
from lightning_gpuopt.memory.units import parse_bytes
from lightning_gpuopt.testing._dispatch import DispatchCounter

__all__ = ["SimulatedMemory"]

log = logging.getLogger(__name__)

Backend = Literal["auto", "allocator", "dispatch"]
_BACKENDS = ("auto", "allocator", "dispatch")

# One SimulatedMemory per process at a time: the allocator is process-global, and two nested
# instances would each need to see the other's allocations.
_state_lock = threading.Lock()
_active_instance: SimulatedMemory | None = None
_fallback_logged = False

#: torch.distributed functions whose own allocations never raise under the simulation (see the module docs).
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
    "reduce",
    "all_to_all_single",
    "barrier",
)


class SimulatedMemory(MemoryProbe):
    """A context manager that makes the CPU behave like a GPU with ``limit_bytes`` of memory.

    While entered it counts the live bytes of every tensor the training touches -- parameters,
    gradients, optimizer state, activations saved for backward, temporaries, the batch (also when
    it comes from DataLoader workers) -- and raises ``torch.OutOfMemoryError`` with the message
    ``"CUDA out of memory (simulated). Tried to allocate X; Y in use; limit Z..."`` when an
    allocation would pass the limit, so ``lightning_gpuopt.memory.is_oom_error``, Lightning's own
    ``is_oom_error`` and tools built on it (``BatchSizeFinder``) take it for the real thing. It is
    the active memory probe meanwhile: ``get_probe()`` returns it.

    One instance may be entered per process at a time (entering a second one, or the same one twice,
    raises ``RuntimeError``); an instance can be entered again after it exits, and starts counting
    from zero each time. After exit its figures stay as they were at exit. Each process (each DDP
    rank) enters its own instance with its own limit. Enter and exit on the same thread.

    Args:
        limit_bytes: the simulated device's memory: bytes, or a size as the CLI reads it (``"5GB"``,
            ``"5 GiB"``, ``"512MiB"``, ``"1.5e9"``); ``None`` counts without a limit. Can be changed while
            entered (:attr:`limit_bytes`); lowering it below what is in use makes the next allocation fail.
        backend: ``"allocator"`` (exact: a counting CPU allocator, built with the system C++ compiler
            on first use, a few seconds, cached), ``"dispatch"`` (pure Python; misses the buffers kernels
            allocate internally, so peaks read low -- a ResNet-18 forward peak by 40 %, and most of
            what inductor-compiled code allocates --; counts only the entering thread; slower), or
            ``"auto"``: the allocator when it can be built, else dispatch (logged once).

    Raises:
        ValueError: ``limit_bytes`` is not a size from 1 byte to 1 PiB or None, or ``backend`` is unknown.

    Example:
        >>> import torch
        >>> with SimulatedMemory(limit_bytes=1 << 20) as mem:
        ...     x = torch.zeros(1024, 64)                       # 256 KiB
        ...     in_use = mem.allocated_bytes
        ...     try:
        ...         y = torch.zeros(1024, 1024)                 # 4 MiB: over the limit
        ...     except torch.OutOfMemoryError as err:
        ...         message = str(err)
        >>> in_use
        262144
        >>> message.startswith("CUDA out of memory (simulated). Tried to allocate 4.00 MiB")
        True
        >>> mem.peak_bytes
        262144
    """

    kind = "simulated"

    def __init__(self, limit_bytes: int | str | None = None, *, backend: Backend = "auto") -> None:
        if backend not in _BACKENDS:
            raise ValueError(f"`backend` must be one of {_BACKENDS}, got {backend!r}")
        self._limit = _check_limit(limit_bytes)
        self._backend_choice: Backend = backend
        self.device = torch.device("cpu")
        #: The backend in use (``"allocator"`` or ``"dispatch"``) once entered; None before.
        self.backend: str | None = None
        self._counter: NativeCounter | DispatchCounter | None = None
        self._adopter: _Adopter | None = None
        self._undo: list = []
        self._collective_depth = 0  # torch.distributed calls running now (their allocations never raise)
        self._compile_logged = False  # the dispatch backend's note about torch.compile, once per entry
        self._pid = 0
        self._final = (0, 0, 0)  # allocated, peak, num_ooms at the last exit

    # --- limit ---------------------------------------------------------------------------------
    @property
    def limit_bytes(self) -> int | None:
        """The simulated device's memory in bytes; settable at any time, also while entered (a size string too)."""
        return self._limit

    @limit_bytes.setter
    def limit_bytes(self, value: int | str | None) -> None:
        self._limit = _check_limit(value)
        if self._counter is not None:
            self._counter.set_limit(self._limit)

    # --- figures -------------------------------------------------------------------------------
    @property
    def entered(self) -> bool:
        """Whether this instance is counting now."""
        return self._counter is not None

    @property
    def allocated_bytes(self) -> int:
        """Live bytes counted now (after exit: at exit)."""
        return self._counter.allocated if self._counter is not None else self._final[0]

    @property
    def peak_bytes(self) -> int:
        """Highest :attr:`allocated_bytes` since entering or the last :meth:`reset_peak`."""
        return self._counter.peak if self._counter is not None else self._final[1]

    @property
    def num_ooms(self) -> int:
        """How many simulated out-of-memory errors were raised since entering."""
        return self._counter.num_ooms if self._counter is not None else self._final[2]

    def reset_peak(self) -> None:
        """Start a new peak window: :attr:`peak_bytes` becomes :attr:`allocated_bytes`."""
        if self._counter is not None:
            self._counter.reset_peak()
        else:
            self._final = (self._final[0], self._final[0], self._final[2])

    # MemoryProbe: what a GPU would report. No cache, so reserved == allocated, no retries.
    @property
    def total(self) -> int:
        """``limit_bytes``, or the host's physical RAM when there is no limit."""
        return self._limit if self._limit is not None else CpuMemoryProbe().total

    @property
    def free(self) -> int:
        return max(0, self.total - self.allocated_bytes)

    @property
    def allocated(self) -> int:
        return self.allocated_bytes

    @property
    def reserved(self) -> int:
        return self.allocated_bytes

    @property
    def peak(self) -> int:
        return self.peak_bytes

    @property
    def alloc_retries(self) -> int:
        return 0

    # --- explicit registration -------------------------------------------------------------------
    def track(self, *objs: Any) -> None:
        """Count tensors that existed before entering, as if they had been moved to the device now.

        Rarely needed: modules, optimizers and DataLoader batches are counted automatically when the
        training first uses them. Use it for tensors used directly (not passed to a module), to have
        parameters counted before the first forward, or under ``torch.compile`` where no module call
        is eager (``trainer.fit(torch.compile(model))``: buffers are counted only this way).

        Args:
            *objs: modules (parameters, buffers, gradients), optimizers (parameters, gradients,
                state), tensors (counted like inputs: a view into a bigger storage counts its own
                bytes), or lists/tuples/dicts/dataclasses of them.

        Raises:
            RuntimeError: not entered.
        """
        if self._adopter is None:
            raise RuntimeError(
                "SimulatedMemory.track() counts tensors only while entered: call it inside `with`"
            )
        for obj in objs:
            if isinstance(obj, torch.nn.Module):
                self._adopter.module(obj, recurse=True)
            elif isinstance(obj, torch.optim.Optimizer):
                self._adopter.optimizer(obj)
            else:
                self._adopter.tree(obj, as_input=True)

    # --- context manager -----------------------------------------------------------------------
    def __enter__(self) -> SimulatedMemory:
        global _active_instance
        with _state_lock:
            if _active_instance is self:
                raise RuntimeError("This SimulatedMemory is already entered; it cannot be entered twice")
            if _active_instance is not None:
                raise RuntimeError(
                    f"Another SimulatedMemory is already active in this process ({_active_instance!r}); "
                    "SimulatedMemory cannot be nested: exit the other one first, or change its `limit_bytes`"
                )
            counter = self._make_counter()
            counter.begin(self._limit)
            counter.on_oom(_tell_forensics)
            _active_instance = self
        try:
            self._pid = os.getpid()
            self._counter = counter
            self._compile_logged = False
            self._adopter = _Adopter(counter)
            self._install_hooks(self._adopter)
            push_active_probe(self)
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._counter is None:
            return
        if self._pid != os.getpid():  # a forked child: the simulation belongs to the parent
            self._counter = self._adopter = None
            self._undo = []
            return
        pop_active_probe(self)
        self._teardown()

    def _teardown(self) -> None:
        global _active_instance
        counter = self._counter
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        if counter is not None:
            self._final = (counter.allocated, counter.peak, counter.num_ooms)
            counter.on_oom(None)
            counter.end()
        if self._adopter is not None:
            self._adopter.close()
        self._counter = self._adopter = None
        with _state_lock:
            if _active_instance is self:
                _active_instance = None

    def _make_counter(self) -> NativeCounter | DispatchCounter:
        global _fallback_logged
        if self._backend_choice == "dispatch":
            self.backend = "dispatch"
            return DispatchCounter()
        try:
            counter = NativeCounter()
        except NativeUnavailableError as err:
            if self._backend_choice == "allocator":
                raise RuntimeError(
                    f"SimulatedMemory(backend='allocator') is unavailable: {err}. Install a C++ compiler "
                    "(or set $CXX), or use backend='dispatch'"
                ) from err
            if not _fallback_logged:
                _fallback_logged = True
                log.warning(
                    "SimulatedMemory uses its pure-Python backend: the counting allocator is unavailable (%s). "
                    "Buffers that kernels allocate internally are not counted.",
                    err,
                )
            self.backend = "dispatch"
            return DispatchCounter()
        self.backend = "allocator"
        return counter

    def _install_hooks(self, adopter: _Adopter) -> None:
        # Neither hook may be traced: dynamo inlines global hooks into the code it compiles, where the
        # adopter's bookkeeping would break the graph (or fail: "already tracked for mutation"). Under
        # torch.compile they run only where the call itself is eager (see _Adopter.called).
        def module_pre_hook(module: torch.nn.Module, args: Any) -> None:
            if torch.compiler.is_compiling():
                return
            adopter.called(module)
            adopter.tree(args, depth=2, as_input=True)

        def optimizer_pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if torch.compiler.is_compiling():
                return
            adopter.optimizer(optimizer)

        handle = torch.nn.modules.module.register_module_forward_pre_hook(module_pre_hook)
        self._undo.append(handle.remove)
        handle = _optim.register_optimizer_step_pre_hook(optimizer_pre_hook)
        self._undo.append(handle.remove)

        # Every batch any DataLoader yields "moves to the device" on arrival (see _Adopter.arrival).
        iter_cls = _compat.dataloader_iterator_base()
        original_next = iter_cls.__dict__["__next__"]

        def __next__(it: Any) -> Any:
            return adopter.arrival(original_next(it))

        # A loader iterated inside compiled code: dynamo breaks the graph at this call, as it does at the
        # original's (a skipped function), instead of tracing the adopter.
        iter_cls.__next__ = torch.compiler.disable(__next__)

        def restore_next() -> None:
            iter_cls.__next__ = original_next

        self._undo.append(restore_next)
        if isinstance(adopter.counter, DispatchCounter):
            remove = _on_dynamo_compile(self._compiling_under_dispatch)
            if remove is not None:
                self._undo.append(remove)
        if _dist.is_available():
            # torch caches this table of torch.distributed's functions the first time it is asked (dynamo
            # asks when it first compiles): built now, it holds the originals, not the wrappers below.
            torch.overrides.get_testing_overrides()
            for name in _COLLECTIVES:
                if callable(getattr(_dist, name, None)):
                    self._unlimit_inside(name)

    def _compiling_under_dispatch(self) -> None:
        if self._compile_logged:
            return
        self._compile_logged = True
        log.warning(
            "SimulatedMemory(backend='dispatch') under torch.compile counts the operators that compiled graphs "
            "run (exact with backend='aot_eager'), not the buffers that inductor's generated kernels allocate: "
            "peaks of inductor-compiled code read low. Use SimulatedMemory(backend='allocator'), built with "
            "the C++ compiler that inductor needs too."
        )

    def _unlimit_inside(self, name: str) -> None:
        original = getattr(_dist, name)
        counter = self._counter

        def collective(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                # Inside compiled code: dynamo must see the original, which it turns into a traceable
                # collective; the limit stays (what compiled collectives allocate is checked like the rest).
                return original(*args, **kwargs)
            self._collective_depth += 1  # a collective that calls another one: the outer restores the limit
            counter.set_limit(None)
            try:
                return original(*args, **kwargs)
            finally:
                self._collective_depth -= 1
                if not self._collective_depth:
                    counter.set_limit(self._limit)

        collective.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(_dist, name, collective)
        self._undo.append(lambda: setattr(_dist, name, original))

    # --- misc ----------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # A copy (e.g. sent to a DDP spawn worker) is a fresh, not-entered instance with the same settings.
        return {"limit_bytes": self._limit, "backend": self._backend_choice, "final": self._final}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["limit_bytes"], backend=state["backend"])
        self._final = tuple(state["final"])

    def __repr__(self) -> str:
        return (
            f"SimulatedMemory(limit_bytes={self._limit!r}, backend={self.backend or self._backend_choice!r}, "
            f"allocated_bytes={self.allocated_bytes}, peak_bytes={self.peak_bytes})"
        )


def _tell_forensics(requested: int, in_use: int, limit: int) -> None:
    # The simulated device's OOM observer, like CUDA's: what is in use is allocated and reserved alike (no cache).
    forensics.allocation_failed("cpu", requested, in_use, in_use, limit)


def _check_limit(value: Any) -> int | None:
    # The CLI's reader of sizes, so that "5GB" means here what it means to `--gpuopt.device_memory`.
    return None if value is None else parse_bytes(value, name="`limit_bytes`")


class _Adopter:
    """Counts tensors that existed before entering, once each, and uncounts them when they die.

    Two rules, after what a GPU run would hold:

    * model state (parameters, buffers, gradients, optimizer state) lives on the device whole:
      its *storage* counts, until the storage dies;
    * an input (a DataLoader batch, a tensor passed to a module or to :meth:`SimulatedMemory.track`)
      would have been copied to the device: a tensor that is only a view into a bigger host storage
      (a slice of a dataset) counts its own bytes, until that tensor object dies; one that covers its
      storage counts the storage, as model state does.

    Storages made by the counter itself (the allocator's blocks, the dispatch mode's outputs) are
    already counted and are skipped.
    """

    def __init__(self, counter: NativeCounter | DispatchCounter) -> None:
        self.counter = counter
        self.session = counter.session
        self._lock = threading.Lock()
        self._storages: dict[int, weakref.ref] = {}  # data_ptr -> weakref to the storage
        self._views: dict[int, weakref.ref] = {}  # id(tensor) -> weakref to the tensor
        self._seen_modules: weakref.WeakSet = weakref.WeakSet()
        self._seen_optimizers: weakref.WeakSet = weakref.WeakSet()
        self._closed = False

    def close(self) -> None:
        self._closed = True
        self._storages, self._views = {}, {}  # dropping the weakrefs drops their callbacks too

    def tensor(self, t: torch.Tensor, as_input: bool = False) -> None:
        if self._closed:
            return
        if getattr(t, "fake_mode", None) is not None:
            return  # a fake tensor (predict_peak's trace): nothing behind it to count
        try:
            if t.device.type != "cpu":
                return
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            ptr = storage.data_ptr()
            own_bytes = t.numel() * t.element_size()
        except (RuntimeError, NotImplementedError, TypeError):
            return  # sparse, nested, fake or wrapper tensors have no plain storage: nothing to count
        if nbytes == 0 or ptr in self._storages:
            return
        with self._lock:
            if ptr in self._storages or self.counter.owns(ptr):
                return
            session = self.session
            if as_input and own_bytes < nbytes:
                key = id(t)
                if key in self._views:
                    return
                self._views[key] = weakref.ref(
                    t, lambda ref: self._on_free(self._views, key, own_bytes, session, ref)
                )
                self.counter.charge(own_bytes)
                return
            self._storages[ptr] = weakref.ref(
                storage, lambda ref: self._on_free(self._storages, ptr, nbytes, session, ref)
            )
            self.counter.charge(nbytes)

    def _on_free(self, table: dict, key: int, nbytes: int, session: int, ref: weakref.ref) -> None:
        # Runs wherever the object dies (any thread, maybe inside tensor()): no lock, atomic dict ops.
        if table.get(key) is ref:
            table.pop(key, None)
            self.counter.release(nbytes, session)

    def arrival(self, batch: Any) -> Any:
        """``batch`` as it would be on the device: tensors not counted yet are replaced by counted copies."""
        if self._closed:
            return batch
        return self._move(batch, 6)

    def _move_tensor(self, t: torch.Tensor) -> torch.Tensor:
        try:
            if t.device.type != "cpu":
                return t
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            empty = storage.nbytes() == 0
        except (RuntimeError, NotImplementedError, TypeError):
            return t
        if empty or ptr in self._storages or self.counter.owns(ptr):
            return t  # already on the "device" (collated in this process, or counted before)
        if t.requires_grad or type(t) is not torch.Tensor:
            self.tensor(t, as_input=True)  # a copy would change autograd or the subclass: count in place
            return t
        # The host-to-device copy. The source (shared memory from a worker, or the dataset's own
        # tensor) is not device memory: only the copy counts, and it dies with the batch.
        return t.clone()

    def _move(self, obj: Any, depth: int) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._move_tensor(obj)
        if depth <= 0 or isinstance(obj, (str, bytes, int, float, type(None))):
            return obj
        try:
            if isinstance(obj, (list, tuple)):
                items = [self._move(v, depth - 1) for v in obj]
                if all(a is b for a, b in zip(items, obj)):
                    return obj
                if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
                    return type(obj)(*items)
                return type(obj)(items)
            if isinstance(obj, Mapping):
                moved = {k: self._move(v, depth - 1) for k, v in obj.items()}
                if all(moved[k] is v for k, v in obj.items()):
                    return obj
                out = copy.copy(obj)  # keeps the mapping's type and attributes (defaultdict, UserDict...)
                for k, v in moved.items():
                    out[k] = v
                return out
            if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
                moved = {f.name: self._move(getattr(obj, f.name), depth - 1) for f in dataclasses.fields(obj)}
                if all(moved[name] is getattr(obj, name) for name in moved):
                    return obj
                out = copy.copy(obj)
                for name, value in moved.items():
                    object.__setattr__(out, name, value)  # frozen dataclasses too
                return out
        except torch.OutOfMemoryError:
            raise
        except Exception:  # a container that cannot be rebuilt: count its tensors where they are
            self.tree(obj, depth, as_input=True)
        return obj

    def called(self, module: torch.nn.Module) -> None:
        """``module`` runs eagerly: count its tensors and its submodules' (each module once).

        Submodules at once, as ``module.to(device)`` would move them: a submodule that only runs inside
        compiled code (``torch.compile(block)``, ``block.compile()``) has no eager call of its own.
        """
        if module in self._seen_modules or _on_fake_tensors(module):
            return
        for sub in module.modules():
            if sub not in self._seen_modules and not _on_fake_tensors(sub):
                self._seen_modules.add(sub)
                self.module(sub, recurse=False)

    def module(self, module: torch.nn.Module, recurse: bool) -> None:
        for p in module.parameters(recurse=recurse):
            self.tensor(p)
            if p.grad is not None:
                self.tensor(p.grad)
        for b in module.buffers(recurse=recurse):
            self.tensor(b)

    def optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer in self._seen_optimizers:
            return
        self._seen_optimizers.add(optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                self.tensor(p)
                if p.grad is not None:
                    self.tensor(p.grad)
        for state in optimizer.state.values():
            self.tree(state)

    def tree(self, obj: Any, depth: int = 6, as_input: bool = False) -> None:
        if isinstance(obj, torch.Tensor):
            self.tensor(obj, as_input)
        elif depth <= 0 or isinstance(obj, (str, bytes, int, float, type(None))):
            return
        elif isinstance(obj, Mapping):
            for value in obj.values():
                self.tree(value, depth - 1, as_input)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for value in obj:
                self.tree(value, depth - 1, as_input)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for field in dataclasses.fields(obj):
                self.tree(getattr(obj, field.name, None), depth - 1, as_input)


def _on_dynamo_compile(callback: Callable[[], None]) -> Callable[[], None] | None:
    """Call ``callback()`` whenever dynamo starts compiling; returns the undo, None where torch has no such hook.

    The hook is private to torch (``torch._dynamo.callback``); tests/testing/test_simulated_memory_compile.py
    fails when it moves.
    """
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        return None
    register = getattr(callback_handler, "register_start_callback", None)
    remove = getattr(callback_handler, "remove_start_callback", None)
    if register is None or remove is None:
        return None

    def on_start(args: Any) -> None:
        callback()

    register(on_start)
    return lambda: remove(on_start)


def _on_fake_tensors(module: torch.nn.Module) -> bool:
    # Traced on fake tensors (predict_peak): its own tensors are adopted when it runs for real.
    state = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return any(getattr(t, "fake_mode", None) is not None for t in state)


def _forget_in_child() -> None:
    # A forked child (DataLoader worker, fork-started DDP rank) is a new device: the parent's
    # simulation counts nothing there (its hooks stay, inert), and the child may enter its own.
    global _active_instance, _state_lock
    if _active_instance is not None and _active_instance._adopter is not None:
        _active_instance._adopter.close()
    _active_instance = None
    _state_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
