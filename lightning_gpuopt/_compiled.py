"""What the pack needs to know about ``torch.compile``: where a model is compiled, how, and what it recompiled.

Two forms of compiled model exist, and both train under the pack:

- a LightningModule compiled the way Lightning documents, ``trainer.fit(torch.compile(model))``:
  Lightning unwraps it and compiles ``forward`` and the ``*_step`` methods (``module._compiler_ctx``);
- compiled submodules or blocks (``self.net = torch.compile(self.net)``), the form FSDP2 uses.

Recompilations are read from dynamo's own counters (``torch._dynamo.utils.counters["frames"]["ok"]``: one
per frame compiled, a recompilation included), never guessed.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lightning_gpuopt._compat import is_compiled
from lightning_gpuopt._warnings import GPUOptWarning

__all__ = [
    "CUDA_GRAPHS_REASON",
    "RecompileBudget",
    "caused_compilations",
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
    """The dynamo contexts (``OptimizeContext``) that compile ``module`` or its submodules."""
    ctx = getattr(module, "_compiler_ctx", None)
    if isinstance(ctx, Mapping) and ctx.get("dynamo_ctx") is not None:
        yield ctx["dynamo_ctx"]
    from torch._dynamo.eval_frame import OptimizedModule

    for sub in module.modules():
        if isinstance(sub, OptimizedModule):
            yield sub.dynamo_ctx


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
    return any(_uses_cuda_graphs(getattr(ctx, "callback", None)) for ctx in _dynamo_contexts(module))


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


#: What dynamo's recompile reason says when a new micro-batch size or a precision switch is the cause.
_PACK_REASONS = ("size mismatch", "GLOBAL_STATE changed")


def caused_compilations(new: int) -> int:
    """Of the last ``new`` compilations, those a new batch size or a new autocast/grad state explains.

    dynamo records why it recompiled each frame (``get_compilation_metrics()[i].recompile_reason``); guards
    on other state (a Lightning ``self.log`` inside a compiled step guards on the loop's results, say)
    recompile without the pack's doing and are not counted. A frame compiled for the first time counts:
    the new graph's own frames. Where the records are unavailable, every compilation counts.
    """
    if new <= 0:
        return 0
    try:
        from torch._dynamo.utils import get_compilation_metrics

        metrics = list(get_compilation_metrics())[-new:]
    except Exception:  # pragma: no cover - an older or newer torch without the records
        return new
    if len(metrics) < new:
        return new
    reasons = [getattr(m, "recompile_reason", None) for m in metrics]
    return sum(1 for r in reasons if not r or any(key in r for key in _PACK_REASONS))


def recompile_limit() -> int:
    """dynamo's recompilations per frame before it runs that frame eagerly (``torch._dynamo.config``)."""
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8))


def _tensors(obj: Any, depth: int = 4) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0 and isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value, depth - 1)
    elif depth > 0 and isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value, depth - 1)


def mark_batch_dynamic(chunk: Any, size: int) -> int:
    """Mark dim 0 of every tensor of ``chunk`` that has ``size`` rows as dynamic for dynamo; the count marked.

    ``torch._dynamo.maybe_mark_dynamic``: the compiled graph takes any batch size from now on (dynamo still
    specialises a size of 1, and never raises when it specialises).
    """
    marked = 0
    for t in _tensors(chunk):
        if t.dim() >= 1 and t.shape[0] == size:
            torch._dynamo.maybe_mark_dynamic(t, 0)
            marked += 1
    return marked


class RecompileBudget:
    """Recompilations the pack caused in one fit, and the warning before dynamo's limit turns compile off.

    dynamo recompiles a frame at most :func:`recompile_limit` times; past that it runs the frame eagerly
    without saying so in the step. The pack warns once, when what it caused reaches the limit minus one.
    """

    def __init__(self) -> None:
        self.caused = 0
        self._warned = False

    def add(self, frames: int, why: str) -> None:
        """Count ``frames`` recompilations caused by ``why``; warn once near dynamo's limit."""
        self.caused += frames
        limit = recompile_limit()
        if not self._warned and self.caused >= limit - 1:
            self._warned = True
            warnings.warn(
                f"The pack has caused {self.caused} recompilations in this fit ({why}); dynamo's recompile limit is "
                f"{limit} per frame, past which it runs the frame eagerly (no longer compiled). Raise "
                "torch._dynamo.config.recompile_limit, or keep the batch size fixed (OOMRecovery's "
                "min_micro_batch_size, MemoryAwareBatchSize's search bounds).",
                GPUOptWarning,
                stacklevel=2,
            )
