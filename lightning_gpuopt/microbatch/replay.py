"""The random numbers a training step draws, recorded on a piece of a batch and replayed on its parts.

The loss-weighting check (``loss_weighting.py``) compares the loss of a piece of a batch with the losses of
its two parts. A step that draws random numbers (diffusion noise and timesteps, flow-matching times) draws
other numbers at every call, so no weighting of the parts' losses could reproduce the piece's.
:class:`RandomDraws` runs the piece under a ``TorchDispatchMode`` that records the outputs of torch's seeded
random operators (those tagged ``torch.Tag.nondeterministic_seeded``: ``randn_like``, ``randint``, ``rand``,
``normal_``, ...), and each part under one that gives the same operators, in the same order, the piece's
values: the part's rows where a dimension counts the piece's samples, the whole tensor where the shapes are
equal. The comparison then sees the same randomness on both sides.

What is left alone: an operator given a ``generator=`` (the user seeds it), dropout and attention at
probability 0, an RNN that is not training. What cannot be replayed is reported, not guessed: Python's
``random`` and NumPy's global state moved by the piece, a random tensor whose shape is not batch-major, a
different sequence of random operators in a part (a loop over samples), a part that fails on the piece's
values (random indices into the batch). Replaying also counts, per part, the targets a mean
``cross_entropy``/``nll_loss`` averaged over: the count that random token selection inside the step (MLM
masking) changes, which the check uses to name that case.

Nothing here runs unless the check runs (once per fit, under ``torch.compiler.set_stance("force_eager")``,
so no compiled graph sees the modes), and the parts run without any mode when the piece drew nothing.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gpuopt import _compat

__all__ = ["HostRandom", "PartRun", "RandomDraws", "draws_random", "op_arguments", "rows_for"]

_SEEDED = torch.Tag.nondeterministic_seeded
#: Arguments that make a seeded operator deterministic when 0 (dropout, attention dropout, RNN dropout).
_PROBABILITIES = ("p", "dropout_p", "dropout")
#: Mean negative log-likelihood operators: what a mean ``cross_entropy`` averages over is their target count.
_NLL = ("nll_loss_forward", "nll_loss2d_forward")
_MEAN = 1  # ATen's Reduction::Mean


def draws_random(func: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether this call of an ATen operator draws from torch's default generators.

    Example:
        >>> draws_random(torch.ops.aten.randn.default, ([2],), {})
        True
        >>> draws_random(torch.ops.aten.native_dropout.default, (torch.ones(2), 0.0, True), {})
        False
    """
    if _SEEDED not in getattr(func, "tags", ()):
        return False
    named = op_arguments(func, args, kwargs)
    if named.get("generator") is not None:
        return False  # the user's own generator, seeded by the user: the same numbers in a part
    if named.get("train") is False or named.get("training") is False:
        return False
    for name in _PROBABILITIES:
        value = named.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            return False
    return True


def op_arguments(func: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """An ATen operator call's arguments by name, from the operator's schema; defaults filled in.

    Example:
        >>> op_arguments(torch.ops.aten.native_dropout.default, (None, 0.5, True), {})
        {'input': None, 'p': 0.5, 'train': True}
    """
    named: dict[str, Any] = {}
    for i, argument in enumerate(_compat.op_schema(func).arguments):
        if i < len(args) and not argument.kwarg_only:
            named[argument.name] = args[i]
        elif argument.name in kwargs:
            named[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            named[argument.name] = argument.default_value
    return named


def _tensors(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, Tensor)]
    return []


def _name(func: Any) -> str:
    return str(getattr(func, "overloadpacket", func)).rsplit(".", 1)[-1]


def _shape(t: Tensor | torch.Size) -> str:
    return "(" + ", ".join(map(str, t.shape if isinstance(t, Tensor) else t)) + ")"


def rows_for(recorded: Tensor, shape: torch.Size, m: int, lo: int, hi: int) -> Tensor | None:
    """The piece's values for a part's tensor of ``shape``: rows ``[lo:hi]`` (``c`` per sample) of the one
    dimension that counts the piece's ``m`` samples, the whole tensor when the shapes are equal, else ``None``.

    Example:
        >>> rows_for(torch.arange(8.0).view(4, 2), torch.Size([1, 2]), 4, 2, 3).tolist()
        [[4.0, 5.0]]
        >>> rows_for(torch.arange(8.0), torch.Size([2]), 4, 1, 2).tolist()  # two values per sample, flattened
        [2.0, 3.0]
    """
    if recorded.shape == shape:
        return recorded
    if recorded.dim() != len(shape):
        return None
    differ = [d for d in range(len(shape)) if recorded.shape[d] != shape[d]]
    if len(differ) != 1:
        return None
    d = differ[0]
    size = recorded.shape[d]
    if size % m or shape[d] != (hi - lo) * (size // m):
        return None
    per_sample = size // m
    return recorded.narrow(d, lo * per_sample, (hi - lo) * per_sample)


@dataclass(frozen=True)
class _Draw:
    op: str
    outputs: tuple[Tensor, ...]


class HostRandom:
    """The state of Python's ``random`` and of NumPy's global generator (when NumPy is imported)."""

    def __init__(self) -> None:
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None

    def moved(self) -> str | None:
        """Which of the two has drawn since this snapshot (``None``: neither)."""
        if random.getstate() != self.python:
            return "Python's `random` module"
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy is not None:
            now = numpy.random.get_state()
            if (
                now[0] != self.numpy[0]
                or now[2:] != self.numpy[2:]
                or not numpy.array_equal(now[1], self.numpy[1])
            ):
                return "NumPy's global random state (`np.random`)"
        return None

    def restore(self) -> None:
        random.setstate(self.python)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy is not None:
            numpy.random.set_state(self.numpy)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.draws: list[_Draw] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if draws_random(func, args, kwargs):
            self.draws.append(_Draw(_name(func), tuple(t.detach().clone() for t in _tensors(out))))
        return out


@dataclass
class PartRun:
    """What replaying the piece's draws on one part found.

    Attributes:
        failure: why the draws could not be replayed on this part (``None``: they were, all of them).
        selected: the targets the part's one mean ``nll_loss`` averaged over (``None``: no such single call).
        nll_calls: the mean ``nll_loss`` calls the part made.
    """

    failure: str | None = None
    selected: float | None = None
    nll_calls: int = 0


class _Replayer(TorchDispatchMode):
    def __init__(self, draws: list[_Draw], m: int, lo: int, hi: int, run: PartRun) -> None:
        super().__init__()
        self.draws, self.m, self.lo, self.hi, self.run = draws, m, lo, hi, run
        self.next = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _name(func) in _NLL:
            self._count_targets(func, args, kwargs)
        if self.run.failure is not None or not draws_random(func, args, kwargs):
            return out  # after a failure the part runs on (its collectives stay in step with other ranks')
        part = f"its part of {self.hi - self.lo} sample(s)"
        if self.next >= len(self.draws) or self.draws[self.next].op != _name(func):
            ops = [d.op for d in self.draws]
            self.run.failure = (
                f"torch's random operators ran as {_summary(ops)} on a piece of {self.m} samples, but "
                f"{part} called {_name(func)} as random operator {self.next + 1} (a loop over samples?)"
            )
            return out
        draw = self.draws[self.next]
        self.next += 1
        targets = _tensors(out)
        for target, recorded in zip(targets, draw.outputs):
            values = rows_for(recorded, target.shape, self.m, self.lo, self.hi)
            if values is None:
                self.run.failure = (
                    f"torch's {draw.op} drew a tensor of shape {_shape(recorded)} on a piece of {self.m} samples "
                    f"and {_shape(target)} on {part}: a random shape that is not batch-major"
                )
                return out
            target.copy_(values)
        return out

    def _count_targets(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        named = op_arguments(func, args, kwargs)
        if named.get("reduction") != _MEAN:
            return
        target, weight = named["target"], named.get("weight")
        valid = target != named.get("ignore_index", -100)
        if weight is None:
            count = float(valid.sum())
        else:
            count = float((weight[target.masked_fill(~valid, 0)] * valid).sum())
        self.run.nll_calls += 1
        self.run.selected = count if self.run.nll_calls == 1 else None

    def finish(self) -> None:
        if self.run.failure is None and self.next != len(self.draws):
            ops = [d.op for d in self.draws]
            self.run.failure = (
                f"torch's random operators ran as {_summary(ops)} on a piece of {self.m} samples, but only "
                f"{self.next} time(s) on its part of {self.hi - self.lo} sample(s) (a loop over samples?)"
            )


def _summary(ops: list[str]) -> str:
    counts: dict[str, int] = {}
    for op in ops:
        counts[op] = counts.get(op, 0) + 1
    return ", ".join(f"{op} x{n}" if n > 1 else op for op, n in counts.items())


class RandomDraws:
    """The random numbers a training step drew on a piece of ``m`` samples, for replaying on its parts.

    Example:
        >>> def step(x):
        ...     return (x + torch.randn_like(x)).square().mean()
        >>> x, draws = torch.arange(4.0).view(4, 1), RandomDraws(4)
        >>> with draws.record():
        ...     whole = step(x)
        >>> with draws.replay(0, 1) as first:
        ...     one = step(x[:1])
        >>> with draws.replay(1, 4) as rest:
        ...     three = step(x[1:])
        >>> first.failure is None and rest.failure is None and bool(torch.isclose(whole, (one + 3 * three) / 4))
        True
    """

    def __init__(self, m: int) -> None:
        self.m = m
        self.draws: list[_Draw] = []
        #: Which host generator the piece drew from (Python's, NumPy's); ``None``: neither.
        self.host: str | None = None

    @property
    def drew(self) -> bool:
        """Whether the piece drew from torch's default generators."""
        return bool(self.draws)

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        """Run the piece: record its torch draws, and notice draws from Python's or NumPy's generators."""
        host = HostRandom()
        recorder = _Recorder()
        try:
            with recorder:
                yield
        finally:
            self.draws = recorder.draws
            self.host = host.moved()

    @contextlib.contextmanager
    def replay(self, lo: int, hi: int) -> Iterator[PartRun]:
        """Run the part ``[lo:hi]`` of the piece with the piece's draws (no mode at all when it drew none)."""
        run = PartRun()
        if not self.draws:
            yield run
            return
        replayer = _Replayer(self.draws, self.m, lo, hi, run)
        with replayer:
            yield run
        replayer.finish()

    def clear(self) -> None:
        """Let the recorded tensors go."""
        self.draws = []
