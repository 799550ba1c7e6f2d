"""What the pack needs to know about ``torch.compile``: where a model is compiled, how, and what it recompiled.

Two forms of compiled model exist, and both train under the pack:

- a LightningModule compiled the way Lightning documents, ``trainer.fit(torch.compile(model))``:
  Lightning unwraps it and compiles ``forward`` and the ``*_step`` methods (``module._compiler_ctx``);
- compiled submodules or blocks (``self.net = torch.compile(self.net)``), the form FSDP2 uses.

Recompilations are read from dynamo's own counters (``torch._dynamo.utils.counters["frames"]["ok"]``: one
per frame compiled, a recompilation included), never guessed.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lightning_gpuopt._compat import is_compiled
from lightning_gpuopt._warnings import GPUOptWarning
from lightning_gpuopt.memory.walk import tensors

__all__ = [
    "CUDA_GRAPHS_REASON",
    "RecompileBudget",
    "caused_compilations",
    "compilations_since",
    "compile_marker",
    "compiled_frames",
    "cuda_graphs_in",
    "cuda_graphs_refusal",
    "is_compiled_anywhere",
    "mark_batch_dynamic",
    "recompile_limit",
]

CUDA_GRAPHS_REASON = (
    "CUDA graphs (torch.compile mode='reduce-overhead' or backend='cudagraphs') record one graph per input shape "
    "in a private memory pool that freeing memory after an out-of-memory error cannot reach, and a graph recorded "
    "before a failed attempt replays into buffers the retry needs; compile with the default mode (or "
    "mode='max-autotune-no-cudagraphs') for the pack's retries and trial steps"
)


def _dynamo_contexts(module: torch.nn.Module) -> Iterator[Any]:
    """The dynamo contexts (``OptimizeContext``) that compile ``module`` or its submodules: Lightning's
    ``_compiler_ctx``, ``torch.compile(submodule)`` and ``submodule.compile()``."""
    ctx = getattr(module, "_compiler_ctx", None)
    if isinstance(ctx, Mapping) and ctx.get("dynamo_ctx") is not None:
        yield ctx["dynamo_ctx"]
    from torch._dynamo.eval_frame import OptimizedModule

    for sub in module.modules():
        if isinstance(sub, OptimizedModule):
            yield sub.dynamo_ctx
        compiled_call = getattr(
            sub, "_compiled_call_impl", None
        )  # module.compile(): the context is in its closure
        for cell in getattr(compiled_call, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if hasattr(value, "callback") and type(value).__name__.endswith("OptimizeContext"):
                yield value


def is_compiled_anywhere(module: torch.nn.Module) -> bool:
    """Whether ``module`` is compiled as a whole (Lightning's form) or has compiled submodules.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> is_compiled_anywhere(net)
        False
        >>> net[0] = torch.compile(net[0], backend="eager")
        >>> is_compiled_anywhere(net)
        True
    """
    if is_compiled(module):
        return True
    return any(True for _ in _dynamo_contexts(module)) or any(
        getattr(sub, "_compiled_call_impl", None) is not None for sub in module.modules()
    )


def _uses_cuda_graphs(backend: Any) -> bool:
    """Whether a dynamo backend (as ``OptimizeContext.callback`` wraps it) records CUDA graphs."""
    seen = 0
    while backend is not None and seen < 8:  # the wrappers dynamo puts around the user's backend
        config = getattr(backend, "config", None)
        if isinstance(config, Mapping) and config.get("triton.cudagraphs"):
            return True
        name = getattr(backend, "_compiler_name", None) or getattr(backend, "__name__", None)
        if name == "cudagraphs":
            return True
        backend = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(
            backend, "_torchdynamo_orig_callable", None
        )
        seen += 1
    return False


def cuda_graphs_in(module: torch.nn.Module) -> bool:
    """Whether any compiled part of ``module`` records CUDA graphs (``mode="reduce-overhead"``, ``"cudagraphs"``).

    Example:
        >>> cuda_graphs_in(torch.compile(torch.nn.Linear(2, 2), mode="reduce-overhead"))
        True
        >>> cuda_graphs_in(torch.compile(torch.nn.Linear(2, 2)))
        False
    """
    contexts = list(_dynamo_contexts(module))
    if any(_uses_cuda_graphs(getattr(ctx, "callback", None)) for ctx in contexts):
        return True
    # inductor's global switch (``torch._inductor.config.triton.cudagraphs = True``): set only once imported
    config = sys.modules.get("torch._inductor.config")
    switched_on = bool(getattr(getattr(config, "triton", None), "cudagraphs", False))
    return switched_on and is_compiled_anywhere(module)


def cuda_graphs_refusal(module: torch.nn.Module, device: torch.device, who: str) -> str | None:
    """Why ``who`` cannot run ``module`` on ``device``: its compiled parts record CUDA graphs there; else ``None``.

    Example:
        >>> model = torch.compile(torch.nn.Linear(2, 2), mode="reduce-overhead")
        >>> cuda_graphs_refusal(model, torch.device("cpu"), "OOMRecovery") is None  # no CUDA graphs on the CPU
        True
        >>> cuda_graphs_refusal(model, torch.device("cuda", 0), "OOMRecovery").startswith("OOMRecovery cannot run")
        True
    """
    if device.type != "cuda" or not cuda_graphs_in(module):
        return None
    return f"{who} cannot run a model compiled with CUDA graphs: {CUDA_GRAPHS_REASON}."


def compiled_frames() -> int:
    """Frames dynamo has compiled in this process so far (first compilations and recompilations)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


#: What dynamo's recompile reason says when a new batch size or a precision switch is the cause: a size
#: guard ("size mismatch at index 0", "2 <= L['x'].size()[0]") or the global autocast/grad state.
_PACK_REASONS = ("size mismatch", "size()[", "GLOBAL_STATE changed")


def _metrics() -> list[Any] | None:
    try:
        from torch._dynamo.utils import get_compilation_metrics

        return list(get_compilation_metrics())
    except Exception:  # pragma: no cover - a torch without the records
        return None


def compile_marker() -> tuple[int, Any]:
    """Where dynamo's records stand now: (frames compiled, the last compilation record or ``None``)."""
    metrics = _metrics()
    return compiled_frames(), (metrics[-1] if metrics else None)


def _frame_compilations(marker: tuple[int, Any]) -> list[Any] | None:
    """dynamo's records of the frames compiled since ``marker`` (no backward graphs, no failed attempts);
    ``None`` where the records cannot say (unavailable, or the marker was dropped from dynamo's window)."""
    last = marker[1]
    metrics = _metrics()
    if metrics is None:
        return None
    if last is not None:
        where = next((i for i in range(len(metrics) - 1, -1, -1) if metrics[i] is last), None)
        if where is None:
            return None
        metrics = metrics[where + 1 :]
    return [
        m
        for m in metrics
        if getattr(m, "is_forward", True) is not False
        and not getattr(m, "is_runtime", False)
        and getattr(m, "fail_type", None) is None
    ]


def caused_compilations(marker: tuple[int, Any]) -> tuple[int, list[str]]:
    """The frames compiled since ``marker`` that a new batch size or autocast/grad state explains, and their
    names (``file:line name``).

    dynamo records why it recompiled each frame (``recompile_reason``); guards on other state (a Lightning
    ``self.log`` inside a compiled step guards on the loop's results, say) recompile without the pack's
    doing and are not counted. A frame compiled for the first time counts: the new graph's own frames.
    Where the records cannot say, every frame compiled since ``marker`` counts (under no name).
    """
    records = _frame_compilations(marker)
    if records is None:
        return max(0, compiled_frames() - marker[0]), []
    caused = [
        m
        for m in records
        if not getattr(m, "recompile_reason", None) or any(key in m.recompile_reason for key in _PACK_REASONS)
    ]
    return len(caused), [_frame_name(m) for m in caused]


def _frame_name(record: Any) -> str:
    return f"{getattr(record, 'co_filename', '?')}:{getattr(record, 'co_firstlineno', '?')} {getattr(record, 'co_name', '?')}"


def compilations_since(marker: tuple[int, Any]) -> list[str]:
    """The names of every frame compiled since ``marker``, whoever caused it (for dynamo's per-frame limit)."""
    records = _frame_compilations(marker)
    return [] if records is None else [_frame_name(m) for m in records]


def recompile_limit() -> int:
    """dynamo's recompilations per frame before it runs that frame eagerly (``torch._dynamo.config``)."""
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8))


def mark_batch_dynamic(chunk: Any, size: int) -> int:
    """Mark dim 0 of every tensor of ``chunk`` that has ``size`` rows as dynamic for dynamo; the count marked.

    ``torch._dynamo.maybe_mark_dynamic``: the compiled graph takes any batch size from now on (dynamo still
    specialises a size of 1, and never raises when it specialises).
    """
    marked = 0
    for t in tensors(chunk):
        if t.dim() >= 1 and t.shape[0] == size:
            torch._dynamo.maybe_mark_dynamic(t, 0)
            marked += 1
    return marked


class RecompileBudget:
    """Recompilations the pack caused in one fit, and the warning before dynamo's limit turns compile off.

    dynamo compiles one frame at most :func:`recompile_limit` times; past that it runs the frame eagerly
    (it logs that once). Per frame, every compilation in the pack's attempts is counted, whoever caused it
    (they all use up the limit); the pack warns once, when a frame it recompiled reaches the limit minus one.
    """

    def __init__(self) -> None:
        self.caused = 0
        self.per_frame: dict[str, int] = {}
        self._warned = False

    def seen(self, frames: list[str]) -> None:
        """Count compilations of these frames (any cause) toward dynamo's per-frame limit."""
        for name in frames:
            self.per_frame[name] = self.per_frame.get(name, 0) + 1

    def add(self, frames: int, why: str, names: list[str] = ()) -> None:
        """Count ``frames`` recompilations caused by ``why``; warn once near dynamo's per-frame limit."""
        self.caused += frames
        limit = recompile_limit()
        busiest = max((self.per_frame.get(name, 0) for name in names), default=frames)
        if not self._warned and busiest >= limit - 1:
            self._warned = True
            warnings.warn(
                f"A compiled frame has been compiled {busiest} times in this fit, the last after {why} (the pack "
                f"caused {self.caused} recompilations in all); dynamo's recompile limit is {limit} per frame, past "
                "which it runs the frame eagerly (no longer compiled). Raise torch._dynamo.config.recompile_limit, "
                "or keep the batch size fixed (OOMRecovery's min_micro_batch_size, MemoryAwareBatchSize's search "
                "bounds).",
                GPUOptWarning,
                stacklevel=2,
            )
