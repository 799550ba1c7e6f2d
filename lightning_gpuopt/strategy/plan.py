"""Choose how to spread training over devices from memory needs: :func:`select_strategy` and its :class:`StrategyPlan`.

:func:`select_strategy` estimates, per device, the bytes of parameters, gradients, optimizer state,
gathered units and activations under each candidate (single device, DDP, FSDP sharding gradients and
optimizer state, full sharding, full sharding with CPU offload, DeepSpeed ZeRO stages) with
:mod:`lightning_gpuopt.memory.estimate`, compares them with the device's memory, and picks the
candidate with the least communication that fits. The returned :class:`StrategyPlan` prints as a
table and carries the Lightning strategy to pass to the Trainer.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch import nn

from lightning_gpuopt._validate import fraction, positive_int
from lightning_gpuopt.memory import format_bytes, get_probe
from lightning_gpuopt.memory.estimate import (
    CANDIDATES,
    Candidate,
    MemoryEstimate,
    activation_bytes_per_sample,
    count_parameters,
    estimate,
)
from lightning_gpuopt.memory.extrapolate import predict_peak_deep, scale_to_batch
from lightning_gpuopt.memory.optimizers import optimizer_in
from lightning_gpuopt.memory.prediction_types import ParallelLayout, PeakPrediction, PredictionMethod
from lightning_gpuopt.strategy.fsdp2 import FSDP2Strategy, shard_units
from lightning_gpuopt.support import Feature, StrategyKind, supports

__all__ = [
    "PlanRow",
    "StrategyPlan",
    "StrategyPlanError",
    "optimizer_of",
    "select_strategy",
]

#: Fraction of device memory the plan fills at most (the rest: allocator fragmentation, the CUDA context).
DEFAULT_HEADROOM = 0.9


@dataclass(frozen=True)
class PlanRow:
    """One candidate of a plan: its estimate, whether it fits, whether it can run here.

    ``prediction`` is the candidate's traced peak (:func:`~lightning_gpuopt.memory.predict_peak`) at the
    planned micro-batch, when a sample batch was given; it then decides ``fits``, and
    ``largest_micro_batch`` is the largest micro-batch predicted to fit the budget.
    """

    estimate: MemoryEstimate
    fits: bool
    available: bool
    note: str = ""
    prediction: PeakPrediction | None = None
    predicted_bytes: int | None = None
    largest_micro_batch: int | None = None

    @property
    def name(self) -> str:
        return self.estimate.candidate.name

    @property
    def host_bytes(self) -> int:
        """Host memory per rank (CPU offload: its shards of parameters, gradients and optimizer state), apart
        from the device bytes. From the estimate: a traced prediction's ``host_bytes`` is the host memory at
        the device's peak (in the first forward, before gradients and optimizer state exist)."""
        return self.estimate.host


class StrategyPlanError(RuntimeError):
    """No candidate fits the device memory; :attr:`plan` holds the table."""

    def __init__(self, message: str, plan: StrategyPlan) -> None:
        super().__init__(message)
        self.plan = plan


@dataclass
class StrategyPlan:
    """What :func:`select_strategy` estimated and chose.

    Attributes:
        rows: one per candidate considered, cheapest communication first.
        pick: the chosen candidate's name (``None``: nothing fits).
        reason: why, in one sentence.
        strategy: the Lightning strategy to pass to ``Trainer(strategy=...)`` (``None`` when nothing fits).
        device_memory: bytes per device planned against; ``budget`` = ``headroom`` × that.
        world_size: devices × nodes.
        num_nodes: nodes (the table says how the devices are spread over them; host memory is shared by
            the ranks of one node).
    """

    rows: list[PlanRow]
    pick: str | None
    reason: str
    strategy: Strategy | str | None
    device_memory: int
    budget: int
    world_size: int
    precision: str
    optimizer: str
    activation_note: str
    notes: list[str] = field(default_factory=list)
    num_nodes: int = 1

    def table(self) -> str:
        """The plan as a text table: bytes per device per component per candidate, the pick and why."""
        head = (
            "candidate",
            "parameters",
            "gradients",
            "optimizer",
            "gathered",
            "activations",
            "total",
            "fits",
            "",
        )
        predicted = any(row.predicted_bytes is not None for row in self.rows)
        if predicted:
            head = (*head[:7], "predicted peak", "max micro-batch", *head[7:])
        host = any(row.host_bytes for row in self.rows)
        if host:  # CPU offload: host memory per rank, apart from the device columns
            head = (*head[:-2], "host per rank", *head[-2:])
        lines = [head]
        for row in self.rows:
            e = row.estimate
            mark = "<- pick" if row.name == self.pick else row.note
            cells = [
                row.name,
                format_bytes(e.parameters),
                format_bytes(e.gradients),
                format_bytes(e.optimizer),
                format_bytes(e.gathered),
                format_bytes(e.activations),
                format_bytes(e.total),
            ]
            if predicted:
                cells += [
                    format_bytes(row.predicted_bytes) if row.predicted_bytes is not None else "-",
                    str(row.largest_micro_batch) if row.largest_micro_batch is not None else "-",
                ]
            if host:
                cells.append(format_bytes(row.host_bytes) if row.host_bytes else "-")
            lines.append((*cells, "yes" if row.fits else "no", mark))
        widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
        nodes = (
            f" ({self.num_nodes} nodes x {self.world_size // self.num_nodes})" if self.num_nodes > 1 else ""
        )
        text = [
            f"gpuopt plan: {self.world_size} device(s){nodes}, {format_bytes(self.device_memory)} each (budget "
            f"{format_bytes(self.budget)}), precision {self.precision}, optimizer {self.optimizer}; activations: "
            f"{self.activation_note}",
        ]
        for i, line in enumerate(lines):
            text.append("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip())
            if i == 0:
                text.append("  ".join("-" * w for w in widths))
        text.append(f"pick: {self.pick or 'none'}: {self.reason}")
        picked = next((row for row in self.rows if row.name == self.pick), None)
        if picked is not None and picked.host_bytes:
            per_node = self.world_size // max(1, self.num_nodes)
            text.append(
                f"host memory: {format_bytes(picked.host_bytes)} per rank on top of the device's, "
                f"{format_bytes(picked.host_bytes * per_node)} per node ({per_node} rank(s) per node)"
            )
        text += [f"note: {n}" for n in self.notes]
        return "\n".join(text)

    def __str__(self) -> str:
        return self.table()


def _activations_per_sample(model: nn.Module, batch: Any) -> int:
    """A LightningModule's activations per sample through its own ``training_step``, on a copy (its metrics stay as they are)."""
    import copy
    import warnings

    import lightning.pytorch as pl

    if not isinstance(model, pl.LightningModule):
        return activation_bytes_per_sample(model, batch)
    on_meta = any(p.is_meta for p in model.parameters())
    clone = model if on_meta else copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `self.log` without a Trainer warns and does nothing
        return activation_bytes_per_sample(clone, batch, forward=lambda m, b: m.training_step(b, 0))


def _optimizer_name(optimizer: Any) -> str:
    if isinstance(optimizer, str):
        return optimizer
    return optimizer.__name__ if isinstance(optimizer, type) else type(optimizer).__name__


def _candidate_kind(candidate: Candidate) -> StrategyKind:
    if candidate.name == "single device":
        return StrategyKind.SINGLE_DEVICE
    if candidate.name == "ddp":
        return StrategyKind.DDP
    return StrategyKind.DEEPSPEED if candidate.deepspeed else StrategyKind.FSDP2


def _refused(candidate: Candidate, features: list[Feature]) -> list[tuple[str, str]]:
    """The features (by name, with the support module's reason) that ``candidate``'s strategy cannot run."""
    kind = _candidate_kind(candidate)
    answers = [(f, supports(f, kind)) for f in features]
    return [(f.value, a.reason) for f, a in answers if not a.supported]


def _make_strategy(candidate: Candidate, units: list[nn.Module], static_graph: bool) -> Strategy | str:
    name = candidate.name
    if name == "single device":
        return "auto"
    if name == "ddp":
        # Gradients as views into DDP's buckets save a copy of them; static_graph only when asked for (it is
        # not safe with OOMRecovery, which refuses it).
        return DDPStrategy(gradient_as_bucket_view=True, static_graph=static_graph)
    if name.startswith("deepspeed"):
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=int(name[-1]))
    types = sorted({type(u) for u in units}, key=lambda t: t.__name__)
    # FSDP2 on CUDA as on CPU: the pack's OOM recovery runs under it (not under FSDP1, see support.py).
    return FSDP2Strategy(
        shard_modules=types or None,
        reshard_after_forward=candidate.shard_params,
        cpu_offload=candidate.offload,
        hsdp=candidate.hybrid,
    )


# over 80 lines: the public docstring documents its 14 arguments, with four doctests
def select_strategy(
    model: nn.Module,
    devices: int = 1,
    num_nodes: int = 1,
    precision: str | None = "32-true",
    optimizer: Any = "adam",
    *,
    activation_bytes: int | None = None,
    sample_batch: Any = None,
    micro_batch_size: int = 1,
    device_memory: int | None = None,
    device: torch.device | str | None = None,
    headroom: float = DEFAULT_HEADROOM,
    shard_modules: list[str | type[nn.Module]] | None = None,
    static_graph: bool = False,
    features: Iterable[Feature] = (),
) -> StrategyPlan:
    """Pick single device / DDP / FSDP (sharding, offload) / DeepSpeed from a per-device memory estimate.

    The estimate per device: parameters, gradients, optimizer state, the largest unit gathered under full
    sharding (twice: prefetch), buffers, and activations for ``micro_batch_size`` samples (measured, estimated
    from ``sample_batch``, else 0, said in the plan). Among the candidates under ``headroom`` × the device
    memory, the one with the least communication is picked: single device < DDP < HSDP < sharding gradients
    and optimizer state < full sharding < full sharding with CPU offload (DeepSpeed only when installed). The
    model may live on the ``meta`` device. docs/multi-gpu.md has the long form.

    Args:
        model: the model (a LightningModule or any ``nn.Module``).
        devices: devices per node.
        num_nodes: nodes.
        precision: the Lightning precision.
        optimizer: an optimizer, its class or name.
        activation_bytes: activations of one micro-batch, measured.
        sample_batch: a batch to estimate activations per sample from (``model(sample_batch)`` must run).
        micro_batch_size: samples per micro-batch to plan activations for.
        device_memory: bytes per device to plan against; ``None``: the memory probe's ``total`` for
            ``device`` (honouring a per-process fraction; SimulatedMemory's limit under it).
        device: the device to read memory from (``None``: the current CUDA device, else the CPU).
        headroom: the fraction of device memory the plan may fill, in (0, 1].
        shard_modules: the units for full sharding; ``None``: the repeated blocks (:func:`shard_units`).
        static_graph: pass ``static_graph=True`` to DDP (only without OOMRecovery).
        features: the pack's features the run uses (:class:`~lightning_gpuopt.support.Feature`, e.g.
            ``Feature.OOM_RECOVERY`` when OOMRecovery is a callback): among the candidates that fit, the
            pick supports the most of them (then the least communication); one it cannot run is named in
            ``plan.reason``.

    Returns:
        A :class:`StrategyPlan`; ``plan.strategy`` goes to ``Trainer(strategy=...)``.

    Raises:
        ValueError: an argument is out of range.
        StrategyPlanError: no candidate fits; the error carries the plan table.

    Example:
        >>> with torch.device("meta"):
        ...     big = nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(8)))   # 134 M parameters
        >>> plan = select_strategy(big, devices=4, optimizer="adam", device_memory=768 * 2**20)
        >>> plan.pick
        'fsdp: full shard'
        >>> select_strategy(big, devices=4, device_memory=80 * 2**30).pick
        'ddp'
        >>> select_strategy(big, devices=4, num_nodes=2, device_memory=768 * 2**20).pick  # a node's 4 shards fit
        'hsdp: full shard in node'
        >>> select_strategy(big, devices=4, num_nodes=2, device_memory=512 * 2**20).pick  # they need all 8
        'fsdp: full shard'
    """
    for name, value in (
        ("devices", devices),
        ("num_nodes", num_nodes),
        ("micro_batch_size", micro_batch_size),
    ):
        positive_int(name, value)
    fraction("headroom", headroom)
    positive_int("device_memory", device_memory, unit="bytes", allow_none=True)
    world = devices * num_nodes
    probe_device = torch.device(device) if device is not None else None
    if device_memory is None:
        device_memory = get_probe(probe_device).total
    budget = int(headroom * device_memory)
    units = shard_units(model, shard_modules)
    activations, note = _activations(model, activation_bytes, sample_batch, micro_batch_size)
    device_type = (
        probe_device.type if probe_device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    counts = count_parameters(model, units or None)
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    rows = []
    for candidate in CANDIDATES:
        if not _plannable(candidate, world, devices, num_nodes):
            continue
        e = estimate(
            counts, candidate, devices if candidate.hybrid else world, precision, optimizer, activations
        )
        if candidate.deepspeed and not has_deepspeed:
            row = PlanRow(e, e.total <= budget, False, "estimate only (deepspeed not installed)")
        else:
            row = PlanRow(e, e.total <= budget, True, "")
        if sample_batch is not None and activation_bytes is None and not candidate.deepspeed:
            row = _predicted_row(
                row,
                model,
                sample_batch,
                optimizer,
                precision,
                world,
                units,
                device_type,
                budget,
                micro_batch_size,
                num_nodes,
            )
        rows.append(row)
    plan_args = dict(
        device_memory=device_memory,
        budget=budget,
        world_size=world,
        num_nodes=num_nodes,
        precision=str(precision),
        optimizer=_optimizer_name(optimizer),
        activation_note=note,
    )
    notes = _unit_notes(units)
    fitting, split = _fitting(rows, micro_batch_size, notes)
    if not fitting:
        plan = StrategyPlan(rows, None, "no candidate fits", None, notes=notes, **plan_args)
        raise _nothing_fits(plan, rows, world, device_memory, budget)
    features = [Feature(f) for f in features]
    refused = {r.name: _refused(r.estimate.candidate, features) for r in rows}
    best = min(fitting, key=lambda r: (len(refused[r.name]), r.estimate.candidate.cost))
    reason = _reason(best, rows, split, micro_batch_size, budget)
    for name, why in refused[best.name]:
        reason += f"; {name} does not run under {best.name}: {why}"
    strategy = _make_strategy(best.estimate.candidate, units, static_graph)
    return StrategyPlan(rows, best.name, reason, strategy, notes=notes, **plan_args)


def _activations(
    model: nn.Module, activation_bytes: int | None, sample_batch: Any, micro_batch_size: int
) -> tuple[int, str]:
    """The activations of one micro-batch to plan for, and how they were found: measured, estimated or not."""
    if activation_bytes is not None:
        return int(activation_bytes), f"{format_bytes(activation_bytes)} measured"
    if sample_batch is None:
        return 0, "not estimated (no sample batch): plan leaves them to the headroom"
    try:
        per_sample = _activations_per_sample(model, sample_batch)
    except Exception as err:  # planning must not stop a run: say why and leave activations to the headroom
        return 0, f"not estimated ({type(err).__name__}: {err}); left to the headroom"
    return (
        per_sample * micro_batch_size,
        f"{format_bytes(per_sample)} per sample estimated (saved for backward) x {micro_batch_size}",
    )


def _plannable(candidate: Candidate, world: int, devices: int, num_nodes: int) -> bool:
    """Whether ``candidate`` is a way to run on ``world`` devices (HSDP: shard within a node of several)."""
    return (
        (candidate.multi_device or world == 1)
        and (world > 1 or candidate.offload or not candidate.multi_device)
        and (not candidate.hybrid or (num_nodes > 1 and devices > 1))
    )


def _unit_notes(units: list[nn.Module]) -> list[str]:
    """What full sharding gathers at a time, said once."""
    if not units:
        return []
    kinds = Counter(type(u).__name__ for u in units)
    if len(kinds) == 1:
        return [f"full sharding gathers one {next(iter(kinds))} at a time ({len(units)} units)"]
    each = ", ".join(f"{n} {name}" for name, n in kinds.items())  # an encoder's and a decoder's layers
    return [f"full sharding gathers one unit at a time ({len(units)} units: {each})"]


def _fitting(
    rows: list[PlanRow], micro_batch_size: int, notes: list[str]
) -> tuple[list[PlanRow], PlanRow | None]:
    """The rows that fit, and, when none fits whole, the cheapest that fits smaller micro-batches (noted)."""
    fitting = [r for r in rows if r.fits and r.available]
    if fitting:
        return fitting, None
    # The pack splits each batch into micro-batches: a candidate where a smaller one fits will do.
    fitting = [r for r in rows if r.available and (r.largest_micro_batch or 0) >= 1]
    if not fitting:
        return [], None
    split = min(fitting, key=lambda r: r.estimate.candidate.cost)
    notes.append(
        f"{split.name} fits micro-batches of {split.largest_micro_batch} (predicted), not "
        f"{micro_batch_size}: each batch is split into {-(-micro_batch_size // split.largest_micro_batch)} "
        "micro-batches (OOMRecovery / MemoryAwareBatchSize)"
    )
    return fitting, split


def _nothing_fits(
    plan: StrategyPlan, rows: list[PlanRow], world: int, device_memory: int, budget: int
) -> StrategyPlanError:
    smallest = min(rows, key=_row_bytes)
    return StrategyPlanError(
        f"No way of training this model fits {world} device(s) of {format_bytes(device_memory)} (budget "
        f"{format_bytes(budget)}): the smallest, {smallest.name}, needs {format_bytes(_row_bytes(smallest))} per "
        "device. Use more devices, a lower-memory precision (bf16), a smaller optimizer state (SGD), "
        f"or a smaller model.\n{plan.table()}",
        plan,
    )


def _reason(
    best: PlanRow, rows: list[PlanRow], split: PlanRow | None, micro_batch_size: int, budget: int
) -> str:
    """Why ``best`` was picked: the cheaper ones over the budget, or what a split made fit."""
    if split is not None:
        return (
            f"nothing fits micro-batches of {micro_batch_size}; {best.name} has the least communication among "
            f"those that fit smaller ones ({best.largest_micro_batch} samples predicted to fit)"
        )
    cheaper = [r for r in rows if r.estimate.candidate.cost < best.estimate.candidate.cost and r.available]
    if not cheaper:
        return f"fits with the least communication: {format_bytes(_row_bytes(best))} of {format_bytes(budget)} per device"
    last = max(cheaper, key=lambda r: r.estimate.candidate.cost)
    reason = (
        f"{last.name} would need {format_bytes(_row_bytes(last))} per device, over the budget; "
        f"{best.name} needs {format_bytes(_row_bytes(best))}"
    )
    hybrid = next((r for r in cheaper if r.estimate.candidate.hybrid and r is not last), None)
    if hybrid is not None:  # the rule for several nodes: HSDP whenever sharding within a node fits
        reason += f" (sharding within a node, {hybrid.name}, would need {format_bytes(_row_bytes(hybrid))})"
    return reason


def _row_bytes(row: PlanRow) -> int:
    """The bytes a row is judged by: its predicted peak when traced, else its estimate."""
    return row.predicted_bytes if row.predicted_bytes is not None else row.estimate.total


def _layout_of(
    candidate: Candidate, world: int, units: list[nn.Module], model: nn.Module, num_nodes: int = 1
) -> ParallelLayout:
    if not candidate.multi_device:
        return ParallelLayout()
    if candidate.name == "ddp":
        return ParallelLayout("ddp", world, gradient_as_bucket_view=True)  # as _make_strategy builds it
    names = {id(m): name for name, m in model.named_modules()}
    return ParallelLayout(
        "fsdp",
        world,
        reshard_after_forward=candidate.shard_params,
        cpu_offload=candidate.offload,
        units=tuple(names[id(u)] for u in units if id(u) in names) or None,
        replicate_size=num_nodes if candidate.hybrid else 1,
    )


def _optimizer_for_prediction(optimizer: Any) -> Any:
    """An optimizer instance, a factory from a name or class, or None (the module's configure_optimizers)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return lambda params: optimizer(params)
    if isinstance(optimizer, str):
        cls = {name.lower(): getattr(torch.optim, name) for name in dir(torch.optim)}.get(optimizer.lower())
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            return lambda params: cls(params)
    return None


def _predicted_row(
    row: PlanRow,
    model: nn.Module,
    sample_batch: Any,
    optimizer: Any,
    precision: str | None,
    world: int,
    units: list[nn.Module],
    device_type: str,
    budget: int,
    micro_batch_size: int,
    num_nodes: int = 1,
) -> PlanRow:
    """``row`` with the candidate's traced peak at ``micro_batch_size`` and the largest micro-batch predicted to fit."""
    import dataclasses

    opt = _optimizer_for_prediction(optimizer)
    if opt is None and not callable(getattr(model, "configure_optimizers", None)):
        return row
    layout = _layout_of(row.estimate.candidate, world, units, model, num_nodes)
    prediction = predict_peak_deep(
        model, sample_batch, opt, precision=precision, layout=layout, device=device_type
    )
    if prediction.method is not PredictionMethod.TRACED:
        return dataclasses.replace(row, prediction=prediction, note=row.note or "estimate (not traced)")
    predicted = scale_to_batch(prediction, micro_batch_size)
    largest = 0
    while largest < 1 << 20 and scale_to_batch(prediction, largest + 1) <= budget:
        largest = largest + 1 if largest < 64 else largest * 2
    if largest >= 64:  # refine the doubling: the largest n with the predicted peak in the budget
        low, high = largest // 2, largest
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if scale_to_batch(prediction, mid) <= budget else (low, mid - 1)
        largest = low
    return dataclasses.replace(
        row,
        fits=predicted <= budget,
        prediction=prediction,
        predicted_bytes=predicted,
        largest_micro_batch=largest,
    )


def optimizer_of(module: nn.Module) -> Any:
    """The optimizer a LightningModule configures (for the estimate), or ``"adam"`` when it cannot be read without a Trainer."""
    configure = getattr(module, "configure_optimizers", None)
    if not callable(configure):
        return "adam"
    try:
        out = configure()
    except Exception:  # it may need the Trainer (estimated_stepping_batches, ...)
        return "adam"
    found = optimizer_in(out)
    return found if found is not None else "adam"
