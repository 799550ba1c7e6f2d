"""Exact mid-epoch resume of a training loader: which samples remain, in which order, with which augmentation RNG.

The pieces:

- :class:`ResumableSampler` is a ``DistributedSampler`` (one replica in a single process) whose order is a
  function of ``(seed, epoch)`` and which, after :meth:`~ResumableSampler.skip`, starts the epoch past the
  samples already consumed. Lightning leaves a ``DistributedSampler`` in place under DDP, so each rank
  keeps its own shard. Like ``DistributedSampler`` it pads when the dataset does not divide by the world
  size: a few samples of the last round are seen twice in that epoch, on different ranks.
- The sampler yields ``(epoch, index)`` pairs; :class:`SeededSamples` wraps the dataset, seeds the torch,
  Python and NumPy RNGs of the process that loads (a worker, or the main process with workers off) from
  ``(seed, epoch, index)`` before it loads sample ``index``, and hands ``dataset[index]`` out. Random
  augmentation is thus a function of the sample and the epoch: it does not depend on the worker count or
  on where a run was interrupted. In the main process the RNG states are put back after each batch, so
  loading does not move the training step's streams (dropout).
- :func:`loader_state` is what the datamodule saves: the epoch, the batches the training loop consumed
  (from the Trainer's progress, not the loader's: workers and device prefetch read ahead) and the seed.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler

__all__ = [
    "EVALUATION_EPOCH",
    "ResumableSampler",
    "SeededSamples",
    "capture_rng",
    "declare_resumable",
    "derive_rng",
    "elastic_size",
    "restore_rng",
    "sample_seed",
]

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    # splitmix64's finaliser: nearby inputs give unrelated seeds.
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The RNG seed a sample is loaded under: a function of the run's seed, the epoch and the sample index.

    Example:
        >>> sample_seed(0, 0, 1) == sample_seed(0, 0, 1), sample_seed(0, 0, 1) == sample_seed(0, 1, 1)
        (True, False)
    """
    return _mix(_mix(_mix(seed & _MASK) ^ (epoch & _MASK)) ^ (index & _MASK)) >> 1  # 63 bits: numpy's limit


def seed_all(seed: int) -> None:
    """Seed torch's CPU generator, Python's ``random`` and NumPy's global generator (what a sample is loaded under)."""
    # The CPU generator only: `torch.manual_seed` also seeds every accelerator, ~100x slower per sample.
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed & 0xFFFFFFFF)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # numpy is optional: without it there is no NumPy RNG to seed
        return None
    return numpy


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` whose epoch can start past the samples a resumed run already consumed.

    The order of an epoch is ``DistributedSampler``'s: a permutation drawn from ``seed + epoch`` (or the
    index order without ``shuffle``), padded to a multiple of ``num_replicas`` and dealt round-robin to
    the ranks. Items are ``(epoch, index)`` pairs for :class:`SeededSamples`.

    Dealt round-robin, the ranks' ``b``-th batches together are one window of that order, whatever the number of
    ranks: a resumed epoch starts past the first ``samples`` of the order (:meth:`skip`, counted on all the ranks
    that consumed them) and deals the rest over this run's ranks, so a run resumed on another number of ranks sees
    every sample of the epoch once (the rest padded to a multiple of the ranks, as ``DistributedSampler`` pads).

    Args:
        dataset: the map-style dataset.
        num_replicas: ranks sharing the dataset (1 in a single process).
        rank: this rank.
        shuffle: a new permutation each epoch.
        seed: the permutation seed (the same on every rank).
        drop_last: drop the tail that does not divide by ``num_replicas`` instead of padding.

    Example:
        >>> sampler = ResumableSampler(range(10), num_replicas=1, rank=0, shuffle=False)
        >>> sampler.skip(epoch=0, samples=7)
        >>> [i for _, i in sampler]
        [7, 8, 9]
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            dataset,  # type: ignore[arg-type]
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self._skip_epoch: int | None = None
        self._skip_samples = 0
        self._skip_counted: int | None = None

    def skip(self, epoch: int, samples: int, counted: int | None = None) -> None:
        """Start ``epoch`` past the first ``samples`` samples of its order: those a resumed run consumed, on all its
        ranks (any number of them).

        ``counted``: the items this rank's loader is taken to have handed out already in that epoch (Lightning's
        restored batch count times this run's batch size); the sampler's length in the resumed epoch is that plus
        what remains, so the loader's length is the fit loop's batches so far plus the batches left. Default:
        this rank's share of ``samples``.
        """
        if samples < 0:
            raise ValueError(f"`samples` must be >= 0, got {samples}")
        self._skip_epoch, self._skip_samples, self._skip_counted = epoch, samples, counted

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        epoch = self.epoch
        indices = super().__iter__() if self._skip_epoch != epoch else self._rest()
        return iter([(epoch, int(i)) for i in indices])

    def __len__(self) -> int:
        if self._skip_epoch != self.epoch:
            return super().__len__()
        counted = self._skip_counted
        if counted is None:
            counted = self._skip_samples // self.num_replicas
        return counted + len(self._rest())

    def _rest(self) -> list[int]:
        """This rank's items of the resumed epoch: the order past the skipped samples, padded (or, with
        ``drop_last``, cut) to a multiple of the ranks as ``DistributedSampler`` does, and dealt round-robin. On the
        number of ranks that consumed the skipped samples this is what ``DistributedSampler`` deals past them."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        rest = order[self._skip_samples :]
        world = self.num_replicas
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % world]
        elif len(rest) % world:
            rest += (order * math.ceil(world / max(1, n)))[: world - len(rest) % world]
        return rest[self.rank :: world]

    def set_epoch(self, epoch: int) -> None:
        if self._skip_epoch is not None and epoch != self._skip_epoch:
            self._skip_epoch, self._skip_samples, self._skip_counted = (
                None,
                0,
                None,
            )  # the resumed epoch is over
        super().set_epoch(epoch)


#: What the optimizer batch is, besides ``ranks x name``, for each per-rank quantity :func:`elastic_size` scales; its
#: unit; and who says the line.
_ELASTIC = {
    "batch_size": ("x accumulate_grad_batches", "sample(s)", "GPUOptDataModule"),
    "max_tokens": ("x accumulate_grad_batches", "token(s)", "GPUOptDataModule"),
    "accumulate_grad_batches": ("x the loader's batch size", "batch(es)", "ExactResume"),
}


def elastic_size(
    name: str,
    before: int,
    before_world: int,
    world: int,
    current: int,
    given: bool = False,
    keep_per_rank: bool = False,
) -> tuple[int, str, str]:
    """The per-rank ``name`` (``batch_size``, ``max_tokens``, or ``accumulate_grad_batches`` where the loader is not the
    pack's) of a run resumed on ``world`` ranks from a checkpoint of ``before_world`` ranks x ``before``: the one that
    keeps the optimizer batch (``ranks x batch_size x accumulate_grad_batches``), ``before`` with ``keep_per_rank``,
    or ``current`` where it was ``given`` for this run. Returns it, what a report notes, and the line to say.

    Raises:
        ValueError: the optimizer batch does not divide by ``world`` (one line naming the rank counts that work).

    Example:
        >>> elastic_size("batch_size", 12, 2, 3, current=12)[:2]
        (8, '12 -> 8 per rank: the optimizer batch kept')
    """
    times, unit, who = _ELASTIC[name]
    was = f"{before_world} rank(s) x {name} {before}"
    resumed = f"resumed on {world} rank(s) from a checkpoint of {was}"
    total = before_world * before
    if given:
        return (
            current,
            f"{before} -> {current} per rank, given for this run",
            (
                f"{resumed}; {name}={current} given for this run is kept: the optimizer batch is {world * current} {unit} "
                f"{times} (was {total} x it)."
            ),
        )
    if keep_per_rank:
        return (
            before,
            f"{before} per rank kept (elastic='keep_per_rank')",
            (
                f"{resumed}; {name} {before} is kept per rank (elastic='keep_per_rank'): the optimizer batch is "
                f"{world * before} {unit} {times} (was {total} x it), so an epoch has other steps than a "
                "restored schedule counted."
            ),
        )
    if total % world:
        fits = ", ".join(str(n) for n in range(1, total + 1) if total % n == 0)
        raise ValueError(
            f"{who}: the checkpoint's optimizer batch, {was} = {total} {unit} {times}, does not divide by this run's "
            f"{world} rank(s): resume on {fits} rank(s), set {name} for this run, or pass "
            f"ExactResume(elastic='keep_per_rank') to keep {name} per rank."
        )
    size = total // world
    return (
        size,
        f"{before} -> {size} per rank: the optimizer batch kept",
        f"{resumed}: {name} {before} -> {size} per rank, keeping the optimizer batch of {total} {unit} {times}.",
    )


def _no_loader_state() -> dict[str, Any]:
    return {}  # the place in the epoch is the datamodule's state (GPUOptDataModule.state_dict)


def _ignore_loader_state(state_dict: dict[str, Any]) -> None:
    return None


def declare_resumable(loader: Any) -> bool:
    """Tell Lightning that ``loader`` resumes mid-epoch, when its sampler is a :class:`ResumableSampler`.

    Lightning warns "your dataloader is not resumable" on a mid-epoch resume unless the loader has
    ``state_dict``/``load_state_dict``. This one's place lives in the datamodule's state, so both are
    empty: Lightning keeps ``[{}]`` in the checkpoint and hands it back. Returns whether it was declared.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(range(4), sampler=ResumableSampler(range(4), num_replicas=1, rank=0))
        >>> declare_resumable(loader), loader.state_dict()
        (True, {})
        >>> declare_resumable(DataLoader(range(4)))
        False
    """
    if not isinstance(getattr(loader, "sampler", None), ResumableSampler):
        return False
    loader.state_dict = _no_loader_state
    loader.load_state_dict = _ignore_loader_state
    return True


#: The epoch an evaluation loader's samples are seeded under (the same draws at every validation).
EVALUATION_EPOCH = -1


class SeededSamples(Dataset):
    """A dataset view whose item ``(epoch, index)`` is ``dataset[index]`` loaded under :func:`sample_seed`.

    In the main process (a loader without workers) the RNG states are put back after each batch, so loading
    does not move the training step's streams.

    Args:
        dataset: the map-style dataset.
        seed: the run's seed.
        epoch: the epoch a plain index is loaded under (an evaluation loader's, :data:`EVALUATION_EPOCH`);
            ``None``: a plain index (from a sampler of the user's own) is loaded unseeded.

    Example:
        >>> view = SeededSamples([10, 11, 12], seed=0)
        >>> view[(0, 2)], len(view)
        (12, 3)
    """

    def __init__(self, dataset: Any, seed: int = 0, epoch: int | None = None) -> None:
        self.dataset = dataset
        self.seed = seed
        self.epoch = epoch
        #: The dataset's items are addressed by ``(epoch, index)`` (a stream's positions), not by index alone.
        self.keyed = bool(getattr(dataset, "keyed_by_epoch", False))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Any) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[Any]) -> list[Any]:
        in_main = torch.utils.data.get_worker_info() is None
        saved = _raw_rng() if in_main else None
        try:
            items = []
            for key in keys:
                epoch, index = key if isinstance(key, tuple) else (self.epoch, key)
                if epoch is not None:
                    seed_all(sample_seed(self.seed, epoch, index))
                items.append(self.dataset[(epoch, index)] if self.keyed else self.dataset[index])
            return items
        finally:
            if saved is not None:
                _set_raw_rng(saved)  # loading ahead must not move the training step's streams

    def __getattr__(self, name: str) -> Any:
        # Attributes of the user's dataset stay reachable through the loader's `dataset`.
        if name in ("dataset", "seed", "epoch", "keyed"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _raw_rng() -> tuple[Any, Any, Any]:
    np = _numpy()
    return (
        torch.default_generator.get_state(),
        random.getstate(),
        None if np is None else np.random.get_state(),
    )


def _set_raw_rng(state: tuple[Any, Any, Any]) -> None:
    torch_state, python_state, numpy_state = state
    torch.default_generator.set_state(torch_state)
    random.setstate(python_state)
    if numpy_state is not None:
        _numpy().random.set_state(numpy_state)


def capture_rng(cuda: bool = True) -> dict[str, Any]:
    """This process's torch, Python and NumPy RNG states (and CUDA's when initialised) as plain values.

    Example:
        >>> state = capture_rng()
        >>> a = torch.rand(1)
        >>> restore_rng(state)
        >>> bool(torch.rand(1) == a)
        True
    """
    version, mt, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().tolist(),
        "python": [version, list(mt), gauss],
    }
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    if cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set this process's RNGs to a state :func:`capture_rng` returned (keys it lacks are left alone)."""
    if "torch" in state:
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "python" in state:
        version, mt, gauss = state["python"]
        random.setstate((version, tuple(mt), gauss))
    np = _numpy()
    if np is not None and "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in states])


def derive_rng(step: int, rank: int, seed: int | None = None) -> None:
    """Seed this process's torch (every device), Python and NumPy RNGs from ``(seed, step, rank)``: where a resume
    cannot restore a rank's streams (another number of ranks), it starts them from values it can repeat.

    ``seed``: the run's global seed (``seed_everything``'s) when ``None``.

    Example:
        >>> derive_rng(step=5, rank=1, seed=0); a = torch.rand(1)
        >>> derive_rng(step=5, rank=1, seed=0); bool(torch.rand(1) == a)
        True
    """
    if seed is None:
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    value = sample_seed(seed, step, rank)
    torch.manual_seed(value)
    random.seed(value)
    np = _numpy()
    if np is not None:
        np.random.seed(value & 0xFFFFFFFF)
