"""Why memory ran out: what the bytes in use were for at an out-of-memory error, read from the live tensors.

Five categories, the same on a GPU and under :class:`~lightning_gpuopt.testing.SimulatedMemory`
(:data:`CATEGORIES`; :data:`CATEGORY_OF` folds :class:`~lightning_gpuopt.memory.MemoryCategory`, what
:func:`~lightning_gpuopt.memory.predict_peak` counts, into them):

- ``parameters``, ``gradients``, ``optimizer_state``: the storages of the tensors given (each storage
  once, on the device only; parameters first, so a saved weight is a parameter);
- ``activations``: the storages autograd saved for a backward that has not run yet, found from every
  live tensor that has a ``grad_fn`` (the garbage collector lists them; no frame is read, so nothing is
  kept alive) through the graph, read without unpacking (a checkpointed block's holder is no tensor);
- ``other``: the rest of what the allocator counts (inputs, the loss, temporaries, buffers, workspaces).

Finding what is saved walks the live objects: a tenth of a second in a large process, paid at an OOM
only. What else is here: the fragmentation and the memory outside PyTorch's allocator on CUDA, the
CUDA allocator's history ring buffer and its snapshot pickle, the one process-wide OOM observer with a
weak reference to whoever listens, and :class:`ActivationOwners`, which measures the modules that own
the activations while it is entered.
"""

from __future__ import annotations

import gc
import inspect
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

import torch

from lightning_gpuopt._compat import (
    attach_cuda_oom_observer,
    dump_cuda_memory_snapshot,
    local_tensor,
    record_cuda_memory_history,
    saved_tensors,
    thread_frames,
)
from lightning_gpuopt.memory.prediction_types import MemoryCategory

__all__ = [
    "CATEGORIES",
    "CATEGORY_OF",
    "ActivationOwners",
    "MemoryHistory",
    "OOMEvent",
    "OOMListener",
    "action_taken",
    "allocation_failed",
    "categories_now",
    "cuda_fragmentation",
    "failure_caught",
    "fold_categories",
    "held_before_step",
    "listener",
    "memory_outside_allocator",
    "phase_of_frames",
    "saved_activations",
    "stack_frames",
    "storages",
    "unwatch",
    "watch",
]

#: The record's categories, in the order the pictures stack them.
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")

#: What each of predict_peak's categories counts as in an OOM record.
CATEGORY_OF: dict[MemoryCategory, str] = {
    MemoryCategory.PARAMETERS: "parameters",
    MemoryCategory.GATHERED: "other",  # FSDP2's unsharded copies: working memory of the step
    MemoryCategory.BUFFERS: "other",
    MemoryCategory.GRADIENTS: "gradients",
    MemoryCategory.OPTIMIZER_STATE: "optimizer_state",
    MemoryCategory.ACTIVATIONS: "activations",
    MemoryCategory.INPUTS: "other",
    MemoryCategory.TEMPORARIES: "other",
    MemoryCategory.WORKSPACES: "other",
    MemoryCategory.SCRATCH: "other",
}


def fold_categories(categories: Mapping[str | MemoryCategory, int]) -> dict[str, int]:
    """``predict_peak``'s categories (by :class:`MemoryCategory` or its value) folded into :data:`CATEGORIES`.

    Example:
        >>> fold_categories({"parameters": 4, "buffers": 1, "activations": 8, "inputs": 2})
        {'parameters': 4, 'gradients': 0, 'optimizer_state': 0, 'activations': 8, 'other': 3}
    """
    out = dict.fromkeys(CATEGORIES, 0)
    for category, nbytes in categories.items():
        out[CATEGORY_OF[MemoryCategory(category)]] += int(nbytes)
    return out


# ---------------------------------------------------------------------------------------------------
# What the bytes in use are for
# ---------------------------------------------------------------------------------------------------
def _on(t: Any, device: torch.device) -> bool:
    if t.device.type != device.type:
        return False
    return device.index is None or t.device.index is None or t.device.index == device.index


def _storage(t: Any, device: torch.device) -> tuple[tuple[str, int | None, int], int] | None:
    """(a key of ``t``'s storage, its bytes) when it lives on ``device``; ``None`` for anything else."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        t = local_tensor(t)
        if getattr(t, "fake_mode", None) is not None or t.is_meta or not _on(t, device):
            return None
        storage = t.untyped_storage()
        nbytes, ptr = storage.nbytes(), storage.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None  # sparse, nested or wrapper tensors: no plain storage
    if not nbytes or not ptr:
        return None
    return (t.device.type, t.device.index, ptr), nbytes


def storages(tensors: Iterable[Any], device: torch.device) -> dict[tuple, int]:
    """The distinct storages of ``tensors`` on ``device``: a key of each -> its bytes (other objects are skipped).

    Example:
        >>> import torch
        >>> x = torch.zeros(256)
        >>> list(storages([x, x[:10], torch.ones(2)], torch.device("cpu")).values())
        [1024, 8]
    """
    out: dict[tuple, int] = {}
    for t in tensors:
        item = _storage(t, device)
        if item is not None:
            out.setdefault(*item)
    return out


def _graph_roots() -> Iterator[Any]:
    """The ``grad_fn`` of every live tensor that has one (the garbage collector's list: no frame is read)."""
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):
            try:
                node = obj.grad_fn
            except RuntimeError:
                continue
            if node is not None:
                yield node


def saved_activations(device: torch.device, exclude: set | None = None) -> dict[tuple, int]:
    """The storages on ``device`` that autograd holds for a backward still to run: key -> bytes.

    ``exclude``: storage keys to leave out (the parameters, gradients and optimizer state counted already).
    """
    exclude = exclude or set()
    found: dict[tuple, int] = {}
    seen: dict[int, Any] = {}  # id -> node, kept alive so that an id is not reused during the walk
    was_enabled = gc.isenabled()
    gc.disable()  # a collection here could free tensors inside an allocator's failure path
    try:
        stack = list(_graph_roots())
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            for data in saved_tensors(node):
                item = _storage(data, device)
                if item is not None and item[0] not in exclude:
                    found[item[0]] = item[1]
            try:
                stack.extend(nxt for nxt, _ in node.next_functions)
            except RuntimeError:
                continue
    finally:
        if was_enabled:
            gc.enable()
    return found


def categories_now(
    allocated_bytes: int,
    device: torch.device,
    parameters: Iterable[Any] = (),
    gradients: Iterable[Any] = (),
    optimizer_state: Iterable[Any] = (),
    activations: bool = True,
) -> dict[str, int]:
    """The bytes in use now by category (:data:`CATEGORIES`), summing to ``allocated_bytes``.

    Each storage counts once, in the first category that holds it (parameters, gradients, optimizer
    state, activations); ``other`` is the rest of ``allocated_bytes``. ``activations=False`` leaves the
    activations in ``other`` (no walk of the live objects).

    Example:
        >>> import torch
        >>> cpu = torch.device("cpu")
        >>> before = categories_now(0, cpu)["activations"]            # graphs alive elsewhere in the process
        >>> w = torch.nn.Parameter(torch.ones(256))                    # 1 KiB
        >>> x = torch.ones(64, 256)                                    # 64 KiB, saved by the product
        >>> y = (x * w).sum()
        >>> c = categories_now(10**9, cpu, parameters=[w])
        >>> c["parameters"], c["activations"] - before, sum(c.values())
        (1024, 65536, 1000000000)
    """
    seen: set = set()
    out = dict.fromkeys(CATEGORIES, 0)
    for name, tensors in (
        ("parameters", parameters),
        ("gradients", gradients),
        ("optimizer_state", optimizer_state),
    ):
        for key, nbytes in storages(tensors, device).items():
            if key not in seen:
                seen.add(key)
                out[name] += nbytes
    if activations:
        out["activations"] = sum(saved_activations(device, seen).values())
    out["other"] = max(0, int(allocated_bytes) - sum(out[c] for c in CATEGORIES[:-1]))
    return out


def held_before_step(
    categories: Mapping[str, int], baseline_bytes: int, kept_gradient_bytes: int = 0
) -> dict[str, int]:
    """Of the bytes in use at an OOM (``categories``), those that were in use already when the step began
    (``baseline_bytes``), by category; the rest of each category was allocated during the step.

    The training state was there first: the parameters, the optimizer state and the gradients the engine
    kept aside from earlier batches of the window; what else the step began with is ``other`` (the
    batch, and what the program keeps on the device: a dataset, outputs it saved), as far as ``other``
    holds it at the OOM (the rest was freed during the step). Activations and new gradients are the
    step's own.

    Example:
        >>> at_oom = {"parameters": 10, "gradients": 0, "optimizer_state": 20, "activations": 40, "other": 130}
        >>> held_before_step(at_oom, baseline_bytes=150)  # a 120-byte dataset held on the device
        {'parameters': 10, 'gradients': 0, 'optimizer_state': 20, 'activations': 0, 'other': 120}
    """
    left = max(0, min(int(baseline_bytes), sum(int(v) for v in categories.values())))
    held = dict.fromkeys(CATEGORIES, 0)
    kept = min(int(kept_gradient_bytes), int(categories.get("gradients", 0)))
    for name, most in (
        ("parameters", int(categories.get("parameters", 0))),
        ("optimizer_state", int(categories.get("optimizer_state", 0))),
        ("gradients", kept),
        ("other", int(categories.get("other", 0))),
    ):
        take = min(left, max(0, most))
        held[name] += take
        left -= take
    return held


# ---------------------------------------------------------------------------------------------------
# Where the program was, for an OOM that no catcher describes: read from code objects only (a frame's locals
# are never touched). The engine and the search's trial steps say their stage and phase when they catch one.
# ---------------------------------------------------------------------------------------------------
def stack_frames() -> list[FrameType]:
    """The frames of this thread and of the main thread, innermost first (a backward on CUDA runs on its own
    thread, while the Python code that called it waits on the main thread)."""
    out: list[FrameType] = []
    main = threading.main_thread().ident
    starts = [inspect.currentframe()]
    if threading.get_ident() != main:
        starts.append(thread_frames().get(main))
    for frame in starts:
        while frame is not None:
            out.append(frame)
            frame = frame.f_back
    return out


_OPTIMIZER_DIR = os.path.dirname(torch.optim.__file__)
_AUTOGRAD_DIR = os.path.dirname(torch.autograd.__file__)


def phase_of_frames(frames: Iterable[FrameType]) -> str:
    """``"backward"`` inside autograd's backward, ``"optimizer step"`` inside a ``torch.optim`` step, else
    ``"forward"`` (innermost first)."""
    for frame in frames:
        code = frame.f_code
        if code.co_filename.startswith(_AUTOGRAD_DIR) and code.co_name in (
            "backward",
            "_engine_run_backward",
        ):
            return "backward"
        if code.co_filename.startswith(_OPTIMIZER_DIR + os.sep):
            return "optimizer step"
    return "forward"


# ---------------------------------------------------------------------------------------------------
# CUDA only: fragmentation, memory outside the allocator, the history ring buffer
# ---------------------------------------------------------------------------------------------------
def cuda_fragmentation(device: torch.device) -> dict[str, int]:
    """The caching allocator's free bytes inside its segments (reserved − allocated) and the largest free block,
    from ``torch.cuda.memory_snapshot()`` (the allocator reports no such figure)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    free = largest = 0
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device") != index:
            continue
        for block in segment.get("blocks", ()):
            if block.get("state") == "inactive":
                free += block["size"]
                largest = max(largest, block["size"])
    return {"free_in_reserved_bytes": free, "largest_free_block_bytes": largest}


def memory_outside_allocator(device: torch.device) -> tuple[int | None, str]:
    """Device bytes this process holds outside PyTorch's caching allocator (the CUDA context, NCCL's buffers,
    libraries' own allocations), and how they were read.

    With ``pynvml`` installed: this process's use as NVML counts it, minus what the allocator reserved.
    Else ``mem_get_info``'s used bytes minus reserved, which also counts other processes on the device.
    """
    reserved = torch.cuda.memory_reserved(device)
    try:
        import pynvml

        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        pid = os.getpid()
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid and proc.usedGpuMemory is not None:
                return max(0, int(proc.usedGpuMemory) - reserved), "nvml (this process)"
    except Exception:  # no pynvml, no NVML, or a container that hides the pids: the device-wide figure
        pass
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - reserved), "mem_get_info (the whole device)"


class MemoryHistory:
    """The CUDA allocator's recent allocations and frees with their stacks, in a ring buffer of ``entries``
    events, and its snapshot pickle (pytorch.org/memory_viz opens it).

    Recording makes every allocation and free on the device record a stack; it starts with :meth:`start` and
    stops with :meth:`stop` (only if this object started it).
    """

    def __init__(self, entries: int = 100_000) -> None:
        self.entries = entries
        self.recording = False

    def start(self) -> bool:
        """Start recording (CUDA only); returns whether it records now."""
        if self.recording or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return self.recording
        record_cuda_memory_history(self.entries)
        self.recording = True
        return True

    def stop(self) -> None:
        if self.recording:
            self.recording = False
            record_cuda_memory_history(None)

    @staticmethod
    def dump(path: str | os.PathLike[str]) -> str:
        """Write the snapshot (segments and blocks, with the history when recording) to ``path``."""
        dump_cuda_memory_snapshot(str(path))
        return str(path)


# ---------------------------------------------------------------------------------------------------
# The OOM observer: one per process, dispatching to whoever listens now
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OOMEvent:
    """An allocation that failed, as the allocator saw it (before it raised).

    Attributes:
        device: the device (``"cuda:0"``, ``"cpu"`` for SimulatedMemory).
        requested_bytes: the allocation that failed.
        allocated_bytes: bytes held by live tensors then.
        reserved_bytes: bytes the allocator held then (its cache included).
        limit_bytes: the memory the process may use (``None``: unknown).
        frames: the stack then, innermost first (read for code objects only).
        time: ``time.perf_counter()`` then.
    """

    device: str
    requested_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    limit_bytes: int | None
    frames: tuple[FrameType, ...] = field(default=(), repr=False, compare=False)
    time: float = 0.0


class OOMListener(Protocol):
    """Who hears of out-of-memory errors: the allocator's observer (:meth:`oom_observed`, inside the failing
    allocation), the micro-batch engine when it catches one (:meth:`oom_caught`, inside its ``except``
    block) and what it did about it (:meth:`oom_action`)."""

    def oom_observed(self, event: OOMEvent) -> None: ...

    def oom_caught(self, error: BaseException, **context: Any) -> None: ...

    def oom_action(self, action: str) -> None: ...


_listener: weakref.ref | None = None
_cuda_observer_attached = False
_observing = threading.local()


def watch(who: OOMListener) -> None:
    """Make ``who`` the process's OOM listener (held weakly; the previous one stops hearing), and attach the
    CUDA allocator's observer once per process when CUDA is initialized (it has no detach)."""
    global _listener, _cuda_observer_attached
    _listener = weakref.ref(who)
    if not _cuda_observer_attached and torch.cuda.is_available() and torch.cuda.is_initialized():
        attach_cuda_oom_observer(_cuda_observer)
        _cuda_observer_attached = True


def unwatch(who: OOMListener) -> None:
    """``who`` stops hearing of OOMs (when it is the listener)."""
    global _listener
    if _listener is not None and _listener() is who:
        _listener = None


def listener() -> OOMListener | None:
    """The process's OOM listener now, if any."""
    return _listener() if _listener is not None else None


def allocation_failed(
    device: str, requested_bytes: int, allocated_bytes: int, reserved_bytes: int, limit_bytes: int | None
) -> None:
    """Tell the listener that an allocation failed (the allocator's observer calls it before raising).

    Never raises: a listener's error must not replace the OOM. Re-entry on the same thread (an OOM
    while the listener runs) is ignored.
    """
    who = listener()
    if who is None or getattr(_observing, "active", False):
        return
    _observing.active = True
    try:
        frames = tuple(stack_frames()[1:])
        event = OOMEvent(
            device,
            int(requested_bytes),
            int(allocated_bytes),
            int(reserved_bytes),
            limit_bytes,
            frames,
            time.perf_counter(),
        )
        who.oom_observed(event)
    except Exception:  # the OOM itself is what the program must see
        pass
    finally:
        _observing.active = False


def _cuda_observer(device: int, requested: int, limit: int, free: int) -> None:
    allocated = torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    allocation_failed(f"cuda:{device}", requested, allocated, reserved, limit)


def failure_caught(error: BaseException, **context: Any) -> None:
    """The micro-batch engine (or a trial step of the batch-size search) caught ``error`` (an OOM) inside its
    ``except`` block; ``context``: stage, phase, step and what the attempt ran (the listener's
    :meth:`OOMListener.oom_caught`). A no-op without a listener."""
    who = listener()
    if who is not None:
        who.oom_caught(error, **context)


def action_taken(action: str) -> None:
    """What the pack did about the OOM it caught last (``"micro-batch 64 → 32"``, ``"gave up: ..."``)."""
    who = listener()
    if who is not None:
        who.oom_action(action)


# ---------------------------------------------------------------------------------------------------
# Which modules own the activations, measured while entered
# ---------------------------------------------------------------------------------------------------
class ActivationOwners:
    """While entered, counts what autograd saves for backward by the module whose forward saved it, and keeps
    the split at the moment the saved bytes alive were highest.

    Uses a ``saved_tensors_hooks`` pair (the pack hook notes the storage and the module running, and hands
    autograd a detached alias whose death says the storage is no longer saved) and global module forward hooks. A pair of
    hooks entered inside (activation checkpointing, a user's offloading) takes precedence: what it saves is
    not seen. Costs a Python call per saved tensor: enter it for one step, not for a run.

    Args:
        root: the model; modules are named by their qualified name in it (``""``: outside any module).
        device: the device whose tensors count.
    """

    def __init__(self, root: torch.nn.Module, device: torch.device) -> None:
        self.names = {id(m): name for name, m in root.named_modules()}
        self.device = device
        #: The parameters' storages: a saved weight (or a view of one) is no activation.
        self.parameters = {item[0] for p in root.parameters() if (item := _storage(p, device)) is not None}
        #: Storage key -> [bytes, the module that saved it first, how many saved copies autograd holds].
        self.alive: dict[tuple, list] = {}
        self.by_module: dict[str, int] = {}
        self.total = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self._stack: list[str] = []
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> ActivationOwners:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        hooks.__enter__()
        self._undo.append(lambda: hooks.__exit__(None, None, None))
        pre = torch.nn.modules.module.register_module_forward_pre_hook(self._enter_module)
        post = torch.nn.modules.module.register_module_forward_hook(self._leave_module)
        self._undo += [pre.remove, post.remove]
        return self

    def __exit__(self, *exc: Any) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    def _enter_module(self, module: torch.nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self._stack.append(name)

    def _leave_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if id(module) in self.names and self._stack:
            self._stack.pop()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        held = t.detach()  # no grad_fn: saving an output then makes no reference cycle
        item = _storage(t, self.device)
        if item is None or item[0] in self.parameters:
            return held
        key, nbytes = item
        entry = self.alive.get(key)
        if entry is not None:
            entry[2] += 1  # the same storage saved again (a Tanh's output, then the next layer's input)
        else:
            module = self._stack[-1] if self._stack else ""
            self.alive[key] = [nbytes, module, 1]
            self.by_module[module] = self.by_module.get(module, 0) + nbytes
            self.total += nbytes
            if self.total > self.peak:
                self.peak = self.total
                self.at_peak = dict(self.by_module)
        # Autograd holds `held` until its backward ran or its graph died: then the storage is no longer saved.
        weakref.finalize(held, self._released, key)
        return held

    def _released(self, key: tuple) -> None:
        entry = self.alive.get(key)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] == 0:
            nbytes, module, _ = self.alive.pop(key)
            self.by_module[module] -= nbytes
            self.total -= nbytes

    @staticmethod
    def top(split: Mapping[str, int], n: int = 5) -> list[dict[str, Any]]:
        """The ``n`` largest owners of ``split``: ``[{"module": name, "bytes": n}, ...]``."""
        ranked = sorted(((m, b) for m, b in split.items() if b > 0), key=lambda mb: -mb[1])[:n]
        return [{"module": m or "(outside any module)", "bytes": int(b)} for m, b in ranked]


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
