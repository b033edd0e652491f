"""Common prompt item, dataset protocol and the deterministic, resumable batch iterator.

Every prompt source of the RL loop (reasoning-gym tasks, GSM8K, MATH-500) yields ``PromptItem``s and
implements ``PromptDataset``: ``len``, integer indexing and ``iterate_batches``. The batch stream is a pure
function of ``(len(dataset), batch_size, seed, position)``, so storing the integer ``position`` of a
``BatchIterator`` (items consumed so far) in a checkpoint and passing it back as ``start_index`` resumes
the exact same stream.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True)
class PromptItem:
    """One prompt of a task with its reference answer.

    Attributes:
      messages: chat messages, ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``, ready for a
        chat template (the last one is the user turn the model answers).
      answer: the reference answer as a string (a plain number for reasoning-gym and GSM8K, LaTeX for MATH).
      task: the task name (``"chain_sum"``, ``"basic_arithmetic"``, ``"gsm8k"``, ``"math500"``); reward
        functions use it to pick the task's scorer.
      metadata: task-specific extras (source index, the raw question, reasoning-gym's own metadata, the
        reference solution, ...). Treat as read-only.
    """

    messages: list[dict]
    answer: str
    task: str
    metadata: dict = dataclasses.field(default_factory=dict)

    @property
    def prompt_text(self) -> str:
        """Content of the last message (the user question), for logging."""
        return self.messages[-1]["content"] if self.messages else ""


@runtime_checkable
class PromptDataset(Protocol):
    """What the RL loop needs from a prompt source.

    ``__getitem__`` takes an int in ``[0, len)`` (negative indices count from the end) and returns a
    ``PromptItem``; ``iterate_batches(batch_size, seed, start_index=0)`` returns an infinite deterministic
    iterator of ``list[PromptItem]`` (see ``BatchIterator``).
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> PromptItem: ...

    def iterate_batches(self, batch_size: int, seed: int, start_index: int = 0,
                        shuffle: bool = True) -> Iterator[list[PromptItem]]: ...


def _check_nonneg_int(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


class BatchIterator:
    """Infinite, deterministic, resumable batch iterator over an indexable dataset.

    The stream is the concatenation of epochs; epoch ``e`` visits every index once, in the order
    ``numpy.random.default_rng([seed, e]).permutation(n)`` (or ``0..n-1`` when ``shuffle=False``). Batch
    ``k`` holds the items at stream positions ``[start + k*B, start + (k+1)*B)``; batches run across epoch
    boundaries without dropping or padding, so a batch larger than the dataset repeats items.

    Resume: ``position`` (an int, items consumed so far) or ``state_dict()`` can be stored; a new iterator
    built with ``start_index=position`` (or ``BatchIterator.from_state``) yields the identical remaining
    batches.

    Raises (at construction):
      TypeError: non-integer ``batch_size``/``seed``/``start_index``.
      ValueError: ``batch_size < 1``, negative ``seed``/``start_index``, or an empty dataset.
    """

    def __init__(self, dataset: Any, batch_size: int, seed: int, start_index: int = 0,
                 shuffle: bool = True):
        self.dataset = dataset
        self.batch_size = _check_nonneg_int("batch_size", batch_size, 1)
        self.seed = _check_nonneg_int("seed", seed)
        self.shuffle = bool(shuffle)
        self._position = _check_nonneg_int("start_index", start_index)
        self._n = len(dataset)
        if self._n == 0:
            raise ValueError("cannot iterate batches over an empty dataset")
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    @property
    def position(self) -> int:
        """Number of items consumed so far (including ``start_index``); pass it back as ``start_index``."""
        return self._position

    def state_dict(self) -> dict:
        """Small JSON-serializable state: ``{"position", "batch_size", "seed", "shuffle"}``."""
        return {"position": self._position, "batch_size": self.batch_size, "seed": self.seed,
                "shuffle": self.shuffle}

    @classmethod
    def from_state(cls, dataset: Any, state: dict) -> "BatchIterator":
        """Rebuild an iterator from ``state_dict()`` output (KeyError if a key is missing)."""
        return cls(dataset, batch_size=state["batch_size"], seed=state["seed"],
                   start_index=state["position"], shuffle=state.get("shuffle", True))

    def index_at(self, position: int) -> int:
        """Dataset index of the item at stream ``position``."""
        epoch, offset = divmod(position, self._n)
        if not self.shuffle:
            return offset
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self._n)
            self._perm_epoch = epoch
        return int(self._perm[offset])

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> list[PromptItem]:
        start = self._position
        batch = [self.dataset[self.index_at(p)] for p in range(start, start + self.batch_size)]
        self._position = start + self.batch_size
        return batch


class IndexedDataset:
    """Mixin giving ``iterate_batches`` to any class with ``__len__`` and ``__getitem__``."""

    def iterate_batches(self, batch_size: int, seed: int, start_index: int = 0,
                        shuffle: bool = True) -> BatchIterator:
        """Infinite deterministic batch iterator; see ``BatchIterator`` for order, resume and errors."""
        return BatchIterator(self, batch_size, seed, start_index=start_index, shuffle=shuffle)


class ListDataset(IndexedDataset):
    """A ``PromptDataset`` over an in-memory sequence of ``PromptItem`` (used for GSM8K and MATH-500).

    Args:
      items: the items; copied into a tuple.
      name: a label for ``repr``.
    """

    def __init__(self, items: Sequence[PromptItem], name: str = "dataset"):
        self._items = tuple(items)
        self.name = name

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> PromptItem:
        """Item at ``index`` (int; negative counts from the end). Raises IndexError out of range."""
        return self._items[operator.index(index)]

    def __iter__(self) -> Iterator[PromptItem]:
        return iter(self._items)

    def __repr__(self) -> str:
        return f"ListDataset(name={self.name!r}, len={len(self)})"
