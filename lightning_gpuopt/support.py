"""Which of the pack's features runs under which strategy, torch version and compile setting, and why not.

One table answers for everything that needs to know: the micro-batch engine, the callbacks, the CLI
(which callbacks it adds) and :func:`~lightning_gpuopt.select_strategy` (which strategies it plans).
The docs table (``docs/support.md``) is rendered from it and a test holds the two equal. The setups the
micro-batching callbacks refuse beyond the strategy (manual optimization, BatchSizeFinder beside them, a
compiled module, CUDA graphs) are worded here too, once per feature (:func:`setup_refusal`), and
:func:`refuse_unsupported` raises the callbacks' refusals in their ``setup``.

Example:
    >>> from lightning_gpuopt.support import Feature, StrategyKind, supports
    >>> supports(Feature.OOM_RECOVERY, StrategyKind.DDP).supported
    True
    >>> answer = supports(Feature.OOM_RECOVERY, StrategyKind.FSDP1)
    >>> answer.supported, "FSDP2Strategy" in answer.reason
    (False, True)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gpuopt._compat import tensor_parallel_size
from lightning_gpuopt._compiled import CUDA_GRAPHS_REASON

__all__ = [
    "SETUP_WORDS",
    "Answer",
    "Feature",
    "StrategyKind",
    "manual_optimization_refusal",
    "markdown_table",
    "strategy_kind",
    "supports",
    "torch_version",
    "unsupported_strategy",
]


class Feature(str, enum.Enum):
    """A feature of the pack whose support depends on the strategy."""

    OOM_RECOVERY = "OOMRecovery"
    BATCH_SIZE_SEARCH = "MemoryAwareBatchSize"
    PRECISION_SWITCH = "PrecisionSwitch (runtime switch)"
    ADAPTIVE_BATCH_SIZE = "AdaptiveBatchSize"


class StrategyKind(str, enum.Enum):
    """The kinds of Lightning strategy the table distinguishes."""

    SINGLE_DEVICE = "single device"
    DDP = "DDP"
    FSDP2 = "FSDP2"
    FSDP1 = "FSDP1"
    DEEPSPEED = "DeepSpeed"
    TENSOR_PARALLEL = "tensor parallel"
    OTHER = "other"


@dataclass(frozen=True)
class Answer:
    """Whether a feature runs, and why (or why not): ``reason`` names the alternative when it does not."""

    supported: bool
    reason: str

    def __bool__(self) -> bool:
        return self.supported


@dataclass(frozen=True)
class _Rule:
    supported: bool
    reason: str
    min_torch: tuple[int, int] | None = None  # supported only from this torch on


def _resets_fsdp2(reason: str) -> _Rule:
    """Supported under FSDP2 where a step stopped mid-way (an OOM) can be undone: FSDPModule.reset_iter_state."""
    return _Rule(
        True, f"{reason}; needs FSDPModule.reset_iter_state (torch 2.14 or newer)", min_torch=(2, 14)
    )


_COLLECTIVES = (
    "runs collectives inside the step, which cannot be kept in step when one rank runs out of memory: "
    "use FSDP2Strategy (sharding) or strategy='ddp', or train without OOMRecovery"
)
_SHARDED_MEMORY = (
    "runs collectives inside the trial steps, which cannot be kept in step when one rank runs out of memory: use "
    "FSDP2Strategy (sharding), devices=1 or strategy='ddp', or remove MemoryAwareBatchSize"
)
_NOISE_ON_ENGINE = (
    "measures the noise scale (GradientNoiseScale) on the micro-batch engine, which runs single-device, DDP and "
    "FSDP2 training: use strategy='ddp' or FSDP2Strategy, or remove AdaptiveBatchSize"
)
_FIXED_PRECISION = "fixes the precision when it wraps the model, so only the setup-time choice applies"

_RULES: dict[tuple[Feature, StrategyKind], _Rule] = {
    (Feature.OOM_RECOVERY, StrategyKind.SINGLE_DEVICE): _Rule(True, "micro-batches on one device"),
    (Feature.OOM_RECOVERY, StrategyKind.DDP): _Rule(
        True, "micro-batches under no_sync; the pack averages gradients at the optimizer step"
    ),
    (Feature.OOM_RECOVERY, StrategyKind.FSDP2): _resets_fsdp2(
        "the ranks vote before each FSDP collective (under HSDP all ranks in one group, also before the replicas' "
        "all-reduce)"
    ),
    (Feature.OOM_RECOVERY, StrategyKind.FSDP1): _Rule(False, f"FSDP1 (FSDPStrategy) {_COLLECTIVES}"),
    (Feature.OOM_RECOVERY, StrategyKind.DEEPSPEED): _Rule(False, f"DeepSpeed {_COLLECTIVES}"),
    (Feature.OOM_RECOVERY, StrategyKind.TENSOR_PARALLEL): _Rule(
        False,
        "tensor-parallel collectives inside the forward cannot be kept in step: use tensor_parallel_size=1 "
        "(FSDP2Strategy), or train without OOMRecovery",
    ),
    (Feature.OOM_RECOVERY, StrategyKind.OTHER): _Rule(
        False,
        "micro-batching supports single-device, DDP and FSDP2 training: use strategy='ddp' or FSDP2Strategy",
    ),
    (Feature.BATCH_SIZE_SEARCH, StrategyKind.SINGLE_DEVICE): _Rule(True, "measures one device"),
    (Feature.BATCH_SIZE_SEARCH, StrategyKind.DDP): _Rule(
        True, "measures each rank; the ranks agree on the size"
    ),
    (Feature.BATCH_SIZE_SEARCH, StrategyKind.FSDP2): _resets_fsdp2(
        "each rank measures real sharded steps (gathered units and reduce-scatter buffers included), the ranks "
        "voting before each FSDP collective, and all use the smallest answer"
    ),
    (Feature.BATCH_SIZE_SEARCH, StrategyKind.FSDP1): _Rule(False, _SHARDED_MEMORY),
    (Feature.BATCH_SIZE_SEARCH, StrategyKind.DEEPSPEED): _Rule(False, _SHARDED_MEMORY),
    (Feature.BATCH_SIZE_SEARCH, StrategyKind.TENSOR_PARALLEL): _Rule(False, _SHARDED_MEMORY),
    (Feature.BATCH_SIZE_SEARCH, StrategyKind.OTHER): _Rule(
        False,
        "measures single-device, DDP and FSDP2 training only: use devices=1, strategy='ddp' or FSDP2Strategy",
    ),
    (Feature.PRECISION_SWITCH, StrategyKind.SINGLE_DEVICE): _Rule(
        True, "swaps the precision plugin at a window boundary"
    ),
    (Feature.PRECISION_SWITCH, StrategyKind.DDP): _Rule(True, "every rank swaps at the same window boundary"),
    (Feature.PRECISION_SWITCH, StrategyKind.FSDP2): _Rule(
        True,
        "bfloat16 autocast over float32 sharded parameters switches at a window boundary on every rank; "
        "FSDP2's MixedPrecisionPolicy (PrecisionSwitch's default for bf16-mixed under FSDP2Strategy) is fixed "
        "once the model is sharded: its non-finite steps are held back, fsdp2_policy=False for the fallback",
    ),
    (Feature.PRECISION_SWITCH, StrategyKind.FSDP1): _Rule(False, _FIXED_PRECISION),
    (Feature.PRECISION_SWITCH, StrategyKind.DEEPSPEED): _Rule(False, _FIXED_PRECISION),
    (Feature.PRECISION_SWITCH, StrategyKind.TENSOR_PARALLEL): _Rule(False, _FIXED_PRECISION),
    (Feature.PRECISION_SWITCH, StrategyKind.OTHER): _Rule(
        False, "runtime switching supports single-device, DDP and FSDP2 strategies"
    ),
    (Feature.ADAPTIVE_BATCH_SIZE, StrategyKind.SINGLE_DEVICE): _Rule(
        True, "the noise scale from accumulation windows, or from a measured step split in two"
    ),
    (Feature.ADAPTIVE_BATCH_SIZE, StrategyKind.DDP): _Rule(
        True, "the noise scale across the ranks; the ranks agree on each change"
    ),
    (Feature.ADAPTIVE_BATCH_SIZE, StrategyKind.FSDP2): _resets_fsdp2(
        "the noise scale from accumulation windows of several micro-batches, measured on the micro-batch engine"
    ),
    (Feature.ADAPTIVE_BATCH_SIZE, StrategyKind.FSDP1): _Rule(False, _NOISE_ON_ENGINE),
    (Feature.ADAPTIVE_BATCH_SIZE, StrategyKind.DEEPSPEED): _Rule(False, _NOISE_ON_ENGINE),
    (Feature.ADAPTIVE_BATCH_SIZE, StrategyKind.TENSOR_PARALLEL): _Rule(False, _NOISE_ON_ENGINE),
    (Feature.ADAPTIVE_BATCH_SIZE, StrategyKind.OTHER): _Rule(False, _NOISE_ON_ENGINE),
}

#: The features that run on the micro-batch engine (AdaptiveBatchSize through its GradientNoiseScale).
_ON_THE_ENGINE = (Feature.OOM_RECOVERY, Feature.BATCH_SIZE_SEARCH, Feature.ADAPTIVE_BATCH_SIZE)

_LIGHTNING_REFUSES_COMPILED = _Rule(
    False,
    "Lightning runs a torch.compile'd LightningModule only under SingleDeviceStrategy, DDPStrategy and "
    "FSDPStrategy (it refuses ModelParallelStrategy and DeepSpeed): apply torch.compile inside configure_model "
    "instead",
)
#: The kinds under which Lightning itself refuses a compiled LightningModule.
_COMPILE_REFUSED_BY_LIGHTNING = (
    StrategyKind.FSDP2,
    StrategyKind.TENSOR_PARALLEL,
    StrategyKind.DEEPSPEED,
    StrategyKind.OTHER,
)


def torch_version(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed torch).

    Example:
        >>> torch_version("2.11.0+cu128")
        (2, 11)
    """
    text = version if version is not None else torch.__version__
    parts = text.split("+")[0].split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def strategy_kind(strategy: Any) -> StrategyKind:
    """The table's kind of a Lightning strategy (an instance, or a :class:`StrategyKind`).

    Example:
        >>> from lightning.pytorch.strategies import DDPStrategy
        >>> strategy_kind(DDPStrategy())
        <StrategyKind.DDP: 'DDP'>
    """
    if isinstance(strategy, StrategyKind):
        return strategy
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
    )

    if isinstance(strategy, SingleDeviceStrategy):
        return StrategyKind.SINGLE_DEVICE
    if isinstance(strategy, DeepSpeedStrategy):  # a DDPStrategy subclass: before DDP
        return StrategyKind.DEEPSPEED
    if isinstance(strategy, FSDPStrategy):
        return StrategyKind.FSDP1
    if isinstance(strategy, ModelParallelStrategy):
        if tensor_parallel_size(strategy) > 1:
            return StrategyKind.TENSOR_PARALLEL
        return StrategyKind.FSDP2
    if isinstance(strategy, DDPStrategy):
        return StrategyKind.DDP
    return StrategyKind.OTHER


def supports(feature: Feature, strategy: Any, *, torch: str | None = None, compiled: bool = False) -> Answer:
    """Whether ``feature`` runs under ``strategy`` (an instance or a :class:`StrategyKind`), and why.

    Args:
        feature: the feature asked about.
        strategy: a Lightning strategy instance, or its :class:`StrategyKind`.
        torch: the torch version to answer for (default: the installed one, checked for the capability
            itself where the answer depends on one).
        compiled: whether the LightningModule is ``torch.compile``'d.
    """
    feature = Feature(feature)
    kind = strategy_kind(strategy)
    if compiled and kind in _COMPILE_REFUSED_BY_LIGHTNING:
        return Answer(False, _LIGHTNING_REFUSES_COMPILED.reason)
    rule = _RULES[(feature, kind)]
    if rule.supported and rule.min_torch is not None:
        if torch_version(torch) < rule.min_torch:
            wanted = ".".join(map(str, rule.min_torch))
            return Answer(
                False, f"{rule.reason}; torch {torch or _installed()} is older than {wanted}: upgrade torch"
            )
        if torch is None and kind is StrategyKind.FSDP2:
            missing = _fsdp2_missing()
            if missing is not None:
                return Answer(False, f"{missing}: upgrade torch")
    return Answer(rule.supported, rule.reason)


def _installed() -> str:
    return torch.__version__


def _fsdp2_missing() -> str | None:
    """Why this torch cannot recover from an OOM under FSDP2; ``None`` when it can."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return f"torch {torch.__version__} has no FSDP2 (`torch.distributed.fsdp.FSDPModule`)"
    if not hasattr(FSDPModule, "reset_iter_state"):
        return (
            f"torch {torch.__version__} lacks FSDPModule.reset_iter_state, which recovering from an OOM mid-step "
            "under FSDP2 needs (torch 2.14 or newer has it)"
        )
    return None


@dataclass(frozen=True)
class _SetupWords:
    """How a micro-batching feature words a setup it refuses: why, and what to do instead."""

    manual_why: str
    manual_instead: str
    finder_why: str
    finder_instead: str


SETUP_WORDS = {
    Feature.OOM_RECOVERY: _SetupWords(
        manual_why="",
        manual_instead="Split the batch yourself inside `training_step`",
        finder_why="both change how a batch runs, and the finder's trial steps would be retried",
        finder_instead="OOMRecovery already fits the micro-batch to memory without changing the optimizer batch",
    ),
    Feature.BATCH_SIZE_SEARCH: _SetupWords(
        manual_why=" (a manual step cannot be measured or split)",
        manual_instead="Choose the batch size yourself",
        finder_why="both choose the batch size",
        finder_instead="MemoryAwareBatchSize(mode='max') also sets batch_size, in at most four measured steps",
    ),
}


def manual_optimization_refusal(feature: Feature, module: Any, who: str | None = None) -> str | None:
    """Why ``feature`` cannot run a module that steps its optimizer itself; ``None`` under automatic optimization.

    ``who`` names what refuses in the message (default: the feature's callback; the engine says "Micro-batching").
    """
    if module.automatic_optimization:
        return None
    words = SETUP_WORDS[Feature(feature)]
    return (
        f"{who or Feature(feature).value} needs automatic optimization, but the LightningModule sets "
        f"`automatic_optimization = False`{words.manual_why}. {words.manual_instead}, or use automatic optimization."
    )


def unsupported_strategy(strategy: Any, feature: Feature) -> str | None:
    """Why the engine cannot run ``feature`` under ``strategy``, naming the alternative; ``None`` when it can.

    For the features that run on the engine (``Feature.OOM_RECOVERY``, ``Feature.BATCH_SIZE_SEARCH``,
    ``Feature.ADAPTIVE_BATCH_SIZE``): single device, DDP and FSDP2 without tensor parallelism, on a torch that
    can reset FSDP2 after an interrupted step. Not under FSDP1 (``FSDPStrategy``) or DeepSpeed, whose
    collectives inside the step cannot be kept in step when one rank runs out of memory.
    """
    feature = Feature(feature)
    if feature not in _ON_THE_ENGINE:
        raise ValueError(
            "`feature` must be a micro-batching feature (OOMRecovery, MemoryAwareBatchSize, AdaptiveBatchSize), "
            f"got {feature}"
        )
    answer = supports(feature, strategy)
    if answer.supported:
        return None
    name = type(strategy).__name__
    kind = strategy_kind(strategy)
    if feature is Feature.OOM_RECOVERY and kind is StrategyKind.TENSOR_PARALLEL:
        return (
            f"micro-batching under {name} supports FSDP2 data parallelism only, got tensor_parallel_size="
            f"{tensor_parallel_size(strategy)} (tensor-parallel collectives inside the forward cannot be kept in "
            "step). Use tensor_parallel_size=1, or train without OOMRecovery here."
        )
    if kind is StrategyKind.FSDP2:
        return f"{answer.reason}, or train without {feature.value} under {name}."
    return (
        f"micro-batching supports single-device, DDP and FSDP2 (ModelParallelStrategy) training, got {name} "
        f"({answer.reason}). Use strategy='ddp' (or one device), or FSDP2Strategy for a sharded model, or train "
        "without the pack's micro-batching callbacks (OOMRecovery, MemoryAwareBatchSize, AdaptiveBatchSize) here."
    )


def markdown_table(reasons: bool = True) -> str:
    """The support table as Markdown (what ``docs/support.md`` holds between its markers).

    ``reasons=False``: the cells only (``docs/multi-gpu.md``'s copy, which links to the reasons).
    """
    kinds = list(StrategyKind)
    lines = [
        "| feature | " + " | ".join(k.value for k in kinds) + " | compiled module |",
        "|---|" + "---|" * len(kinds) + "---|",
    ]
    for feature in Feature:
        cells = []
        for kind in kinds:
            rule = _RULES[(feature, kind)]
            if not rule.supported:
                cells.append("no")
            elif rule.min_torch is not None:
                cells.append(f"torch ≥ {'.'.join(map(str, rule.min_torch))}")
            else:
                cells.append("yes")
        cells.append("single device, DDP")
        lines.append(f"| {feature.value} | " + " | ".join(cells) + " |")
    if not reasons:
        return "\n".join(lines)
    lines.append("")
    lines.append("Why, for each cell that says no or names a torch version:")
    lines.append("")
    for feature in Feature:
        for kind in kinds:
            rule = _RULES[(feature, kind)]
            if not rule.supported or rule.min_torch is not None:
                lines.append(f"- {feature.value}, {kind.value}: {rule.reason}.")
    refused = ", ".join(k.value for k in _COMPILE_REFUSED_BY_LIGHTNING)
    lines.append(f"- Any feature, compiled module under {refused}: {_LIGHTNING_REFUSES_COMPILED.reason}.")
    lines.append(
        f"- {Feature.OOM_RECOVERY.value} and {Feature.BATCH_SIZE_SEARCH.value}, any part compiled with CUDA graphs on "
        f"a CUDA device: {CUDA_GRAPHS_REASON}."
    )
    return "\n".join(lines)
