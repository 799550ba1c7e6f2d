"""Batches by tokens: samples of similar length together, at most ``max_tokens`` padded tokens a batch.

A batch of variable-length samples is padded to its longest sample, so its cost is ``len(batch) x longest``
(its *padded tokens*). :class:`TokenBatchSampler` forms batches whose padded tokens stay within a budget:

- **Shapes fixed for the run.** The samples are ordered by length rounded up to a *bucket width* ``q`` (a power
  of two near a sixteenth of the median length), and cut greedily, from the longest down, into batches whose
  rounded cost fits ``max_tokens``. The rounded lengths in that order are the same every epoch, so the batches' sizes, and their
  count, are too: the count is known before any epoch starts (schedules reading Lightning's
  ``estimated_stepping_batches`` stay right), and a real batch never exceeds the budget it was planned for.
- **Random within that.** Each epoch, samples whose rounded lengths are equal trade places at random, and the
  batches run in a random order: both drawn from ``(seed, epoch)``, so the epoch is the same on any resume.
- **Every sample once, every rank the same count.** Under ``W`` ranks the batch count is raised to a multiple of
  ``W`` by halving the cheapest batches (never by repeating samples), the batches are ranked by cost and cut
  into groups of ``W`` neighbours, and each rank takes one batch of every group: the ranks' batches at a step
  cost about the same, so none waits long for another.

Items are lists of ``(epoch, index)`` pairs, for :class:`~lightning_gpuopt.data.resume.SeededSamples`.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch.utils.data import Dataset

from lightning_gpuopt._validate import choice, positive_int
from lightning_gpuopt.data.resume import ResumableSampler, SeededSamples

__all__ = ["SeededBatches", "TokenBatchSampler", "bucket_width", "sample_length"]

#: What happens to a sample longer than ``max_tokens``: refused at setup, or a batch of its own.
LongSamples = Literal["refuse", "alone", "truncate"]


def bucket_width(lengths: Sequence[int]) -> int:
    """The rounding of lengths the sampler plans with: the largest power of two at most a sixteenth of the
    median length (1 for a median under 32). Samples within one width of each other trade places each epoch.

    Example:
        >>> bucket_width([80] * 5), bucket_width([16, 24, 30]), bucket_width([512, 600])
        (4, 1, 32)
    """
    median = statistics.median_low(lengths)
    width = 1
    while width * 2 <= median / 16:
        width *= 2
    return width


class TokenBatchSampler(ResumableSampler):
    """Batches of at most ``max_tokens`` padded tokens, grouped by length, the same count on every rank.

    The module docstring has the rules. One replica in a single process; under DDP Lightning leaves it in place
    (it is a ``DistributedSampler``), and each rank deals its own batches. Resumed like
    :class:`~lightning_gpuopt.data.resume.ResumableSampler`, in batches: :meth:`skip`.

    Args:
        lengths: each sample's length in tokens.
        max_tokens: the most padded tokens a batch may hold (its size times its longest sample).
        num_replicas: ranks sharing the dataset.
        rank: this rank.
        shuffle: random order of equal-width samples and of the batches, each epoch (``False``: by length).
        seed: the order's seed (the same on every rank).
        long_samples: a sample longer than ``max_tokens`` is refused (``"refuse"``, at construction), gets a
            batch of its own (``"alone"``; that batch exceeds the budget), or is planned at ``max_tokens`` tokens
            (``"truncate"``: its loader cuts it, see :class:`SeededBatches`).

    Raises:
        ValueError: a length below 1, a sample longer than ``max_tokens`` under ``"refuse"``, or batches too
            small to halve into a multiple of the ranks.

    Example:
        >>> sampler = TokenBatchSampler([3, 5, 4, 2, 8, 7], max_tokens=12, shuffle=False)
        >>> [[i for _, i in batch] for batch in sampler]
        [[3, 0], [5], [4], [2, 1]]
        >>> len(sampler)
        4
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        long_samples: LongSamples = "refuse",
    ) -> None:
        positive_int("max_tokens", max_tokens, unit="padded tokens a batch")
        choice("long_samples", long_samples, LongSamples)
        values = [int(n) for n in lengths]
        if not values or min(values) < 1:
            raise ValueError(
                "every sample needs a length of at least 1 token; got "
                + ("no samples" if not values else f"{min(values)} for sample {values.index(min(values))}")
            )
        longest = max(values)
        if longest > max_tokens and long_samples == "refuse":
            over = sum(n > max_tokens for n in values)
            raise ValueError(
                f"sample {values.index(longest)} has {longest} tokens, more than max_tokens={max_tokens} "
                f"({over} sample(s) do): raise max_tokens, or pass long_samples='alone' (a batch of its own) or "
                "'truncate' (cut to max_tokens)"
            )
        if long_samples == "truncate":
            values = [min(n, max_tokens) for n in values]
        super().__init__(values, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.lengths = torch.tensor(values, dtype=torch.int64)
        self.max_tokens = max_tokens
        self.width = bucket_width(values)
        self._rounded = (self.lengths + self.width - 1) // self.width * self.width
        self._sorted = sorted(self._rounded.tolist())  # the rounded lengths in planning order, every epoch's
        self._bounds = self._plan_bounds(max_tokens)

    # ------------------------------------------------------------------ the run's shapes

    def _plan_bounds(self, max_tokens: int) -> list[tuple[int, int]]:
        """Each batch's ``[start, end)`` in the samples sorted by rounded length, in dealing order (cost groups of
        ``num_replicas`` neighbours, cheapest first), at a budget of ``max_tokens``."""
        rounded = self._sorted
        bounds: list[tuple[int, int]] = []
        end = len(rounded)
        # From the longest down: each batch starts at its longest sample and takes as many as the budget allows,
        # so the longest batch holds max_tokens // longest samples whatever the budget (its cost grows smoothly
        # with the budget, which a budget chosen from memory relies on), and the remainder is the shortest.
        for i in range(len(rounded) - 1, -1, -1):
            if end - i > 1 and (end - i) * min(rounded[end - 1], max_tokens) > max_tokens:
                bounds.append((i + 1, end))
                end = i + 1
        bounds.append((0, end))
        world = self.num_replicas
        while len(bounds) % world:
            splittable = [j for j, (s, e) in enumerate(bounds) if e - s >= 2]
            if not splittable:
                raise ValueError(
                    f"{len(bounds)} batches of one sample each cannot be dealt evenly to {world} ranks: raise "
                    f"max_tokens (now {max_tokens}) so that batches hold two samples or more"
                )
            # The cheapest: its halves cost alike and fall in one group of ranks (with the epoch's remainder).
            j = min(splittable, key=lambda j: ((bounds[j][1] - bounds[j][0]) * rounded[bounds[j][1] - 1], j))
            s, e = bounds[j]
            bounds[j : j + 1] = [(s, s + (e - s) // 2), (s + (e - s) // 2, e)]
        return sorted(bounds, key=lambda b: (b[1] - b[0]) * rounded[b[1] - 1])

    def batch_shapes(self, max_tokens: int | None = None) -> list[tuple[int, int]]:
        """Each batch's ``(size, longest length)``, the length rounded up to the bucket width (a bound on every
        epoch's batch: the sizes are the same each epoch, the lengths at most this). ``max_tokens``: the batches
        another budget would form on the same samples (``None``: this sampler's), without another sampler.

        Example:
            >>> sampler = TokenBatchSampler([3, 5, 4, 2, 8, 7], max_tokens=12)
            >>> sampler.batch_shapes(), sampler.batch_shapes(16)
            ([(2, 3), (1, 7), (1, 8), (2, 5)], [(1, 2), (3, 5), (2, 8)])
        """
        bounds = self._bounds if max_tokens is None else self._plan_bounds(max_tokens)
        return [(end - start, self._sorted[end - 1]) for start, end in bounds]

    @property
    def batches_per_epoch(self) -> int:
        """Batches in an epoch, all ranks together (a multiple of ``num_replicas``, the same every epoch)."""
        return len(self._bounds)

    # ------------------------------------------------------------------ one epoch

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Every rank's batches of ``epoch``, in order: rank ``r`` runs ``[r::num_replicas]`` of this list."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        n = len(self.lengths)
        tiebreak = torch.randperm(n, generator=generator) if self.shuffle else torch.arange(n)
        order = torch.argsort(self._rounded * n + tiebreak, stable=True).tolist()
        world = self.num_replicas
        groups = len(self._bounds) // world
        group_order = torch.randperm(groups, generator=generator).tolist() if self.shuffle else range(groups)
        out = []
        for j in group_order:
            group = self._bounds[j * world : (j + 1) * world]
            for r in range(world):  # rotated: no rank always gets the group's costliest batch
                s, e = group[(r + j) % world]
                out.append(order[s:e])
        return out

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:  # type: ignore[override]
        epoch = self.epoch
        mine = self.epoch_batches(epoch)[self.rank :: self.num_replicas]
        if self._skip_epoch == epoch:
            mine = mine[self._skip_samples :]  # batches here: see skip()
        return iter([[(epoch, i) for i in batch] for batch in mine])

    def __len__(self) -> int:
        whole = len(self._bounds) // self.num_replicas
        if self._skip_epoch != self.epoch:
            return whole
        counted = self._skip_samples if self._skip_counted is None else self._skip_counted
        return counted + max(0, whole - self._skip_samples)

    def skip(self, epoch: int, batches: int, counted: int | None = None) -> None:  # type: ignore[override]
        """Start ``epoch`` past this rank's first ``batches`` batches (those a resumed run consumed); ``counted``:
        the batches the loader is taken to have handed out already (default ``batches``; see
        :meth:`ResumableSampler.skip`)."""
        if batches < 0:
            raise ValueError(f"`batches` must be >= 0, got {batches}")
        super().skip(epoch, batches, counted)


def sample_length(sample: Any, index: int) -> int:
    """A sample's length in tokens: a tensor's first dimension; in a dict, ``input_ids``'s (else the first tensor
    value's); in a tuple or list, its first tensor's; a list of ints' own length.

    Raises:
        ValueError: none of these is there (one line naming the sample and what to do).

    Example:
        >>> sample_length({"input_ids": torch.zeros(7), "label": 1}, 0), sample_length((torch.zeros(5, 3), 2), 1)
        (7, 5)
    """
    if isinstance(sample, Mapping):
        ids = sample.get("input_ids")
        parts = [ids] if isinstance(ids, torch.Tensor) else list(sample.values())
    elif isinstance(sample, (tuple, list)) and not all(isinstance(x, int) for x in sample):
        parts = list(sample)
    else:
        parts = [sample]
    for part in parts:
        if isinstance(part, torch.Tensor) and part.dim() >= 1:
            return int(part.shape[0])
        if isinstance(part, (list, tuple)) and part and all(isinstance(x, int) for x in part):
            return len(part)
    raise ValueError(
        f"the length of training sample {index} cannot be read from a {type(sample).__name__} (expected a tensor, or a "
        "dict, tuple or list holding one): give the dataset a `lengths` attribute (one int per sample), or override "
        "`sample_lengths(dataset)` in your GPUOptDataModule"
    )


class SeededBatches(Dataset):
    """A dataset view whose item, a list of ``(epoch, index)`` pairs, is those samples loaded as
    :class:`~lightning_gpuopt.data.resume.SeededSamples` loads them (a loader with ``batch_size=None`` collates
    the list). ``truncate_to``: each sample's token sequences cut to that many tokens (see :func:`truncate`)."""

    def __init__(self, samples: SeededSamples, truncate_to: int | None = None) -> None:
        self.samples, self.truncate_to = samples, truncate_to

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, keys: list[tuple[int, int]]) -> list[Any]:
        loaded = self.samples.__getitems__(list(keys))
        if self.truncate_to is None:
            return loaded
        return [truncate(sample, self.truncate_to) for sample in loaded]


def truncate(sample: Any, limit: int) -> Any:
    """``sample`` with every token sequence longer than ``limit`` cut to its first ``limit`` tokens: tensors by
    their first dimension and lists of ints, also inside dicts, tuples and lists; anything else unchanged.

    Example:
        >>> truncate({"input_ids": torch.arange(6), "label": 1}, 4)
        {'input_ids': tensor([0, 1, 2, 3]), 'label': 1}
    """
    if isinstance(sample, torch.Tensor):
        return sample[:limit] if sample.dim() >= 1 and sample.shape[0] > limit else sample
    if isinstance(sample, Mapping):
        return type(sample)({k: truncate(v, limit) for k, v in sample.items()})  # type: ignore[call-arg]
    if isinstance(sample, (list, tuple)):
        if sample and all(isinstance(x, int) for x in sample):
            return sample[:limit]
        cut = [truncate(x, limit) for x in sample]
        return type(sample)(cut) if not hasattr(sample, "_fields") else type(sample)(*cut)
    return sample
