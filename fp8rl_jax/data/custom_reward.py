"""User reward functions (``train.reward_fn``): run with a timeout, failures scored 0 and counted, never a hang.

A reward function has the signature of the built-in ones (:mod:`fp8rl_jax.data.rewards`)::

    def my_reward(completion: str, item: PromptItem) -> float

* ``completion``: the decoded response text (special tokens removed, as the trainer decodes it);
* ``item``: the :class:`fp8rl_jax.data.types.PromptItem` the completion answers: ``item.answer`` is the reference
  answer (verl's ``ground_truth``), ``item.messages`` the chat prompt (``item.prompt_text`` its last message),
  ``item.task`` the task name (verl's ``data_source``), ``item.metadata`` the dataset's extras (verl's
  ``extra_info``; read-only);
* returns a finite number (``float``, ``int`` or ``bool``): the score of the completion. GRPO normalizes scores
  within each prompt's group, so any scale works.

Bind it in gin by reference or by import path::

    import my_rewards                         # a module on sys.path / PYTHONPATH
    train.reward_fn = @my_rewards.my_reward   # needs @gin.register (or @gin.configurable) on my_reward
    # or, with no gin decorator in my_rewards.py:
    train.reward_fn = "my_rewards.my_reward"  # also "my_rewards:my_reward"
    train.reward_timeout_s = 10.0             # per completion; None = in the producer's thread, no timeout

``train.reward_fn`` replaces ``train.reward`` (the built-in name).

How it runs (:class:`CustomReward`): in a worker process (spawned, one per trainer, started when the trainer is
built), one completion at a time, with ``train.reward_timeout_s`` seconds per completion. The worker imports the
function by its module path (so it must be a module-level function of an importable module: not a lambda, a
nested function or one defined in a notebook / ``__main__``), with the parent's ``sys.path``. This is the
machinery of the math-verify scorer (:class:`fp8rl_jax.data.rewards._ScoringWorker`, kill on timeout):

* the function raises, returns something that is not a finite number, or the worker dies: the completion scores
  0.0 and counts in ``reward/failures``;
* it runs past the timeout: the worker is killed, the completion scores 0.0 and counts in ``reward/failures`` and
  ``reward/timeouts``, and a new worker starts for the next completion (its start-up is not counted in the
  timeout);
* the first failure and the first timeout each warn once (RuntimeWarning, naming the function and the error).

A worker that cannot start when the trainer is built (the module or function cannot be imported) is a
configuration error: ``ValueError`` naming ``train.reward_fn``. Gin bindings of the reward function's own
parameters are not seen in the worker (it has no gin config): give them defaults, or run it in the producer's
thread with ``train.reward_timeout_s = None`` (exceptions are still scored 0 and counted there; no timeout).
"""

from __future__ import annotations

import importlib
import math
import threading
import warnings
import weakref
from typing import Any, Callable

from fp8rl_jax.data.rewards import _ScoringWorker, serve

__all__ = ["CustomReward", "resolve_reward_fn", "reward_fn_path"]

#: seconds a new worker may take to import the user's module before the start counts as failed
WORKER_START_S = 300.0


def reward_fn_path(fn: Any) -> tuple[str, str]:
    """``(module, qualname)`` by which a worker process imports ``fn`` (a callable or a ``"mod.fn"`` /
    ``"mod:fn"`` string).

    Raises:
      ValueError: a string that names no ``module.attribute``, or a callable that cannot be imported by module path
        (a lambda, a nested function, a ``functools.partial``, a function of ``__main__``); the one-line message
        names ``train.reward_fn``.
    """
    if isinstance(fn, str):
        text = fn.strip()
        module, sep, attr = text.partition(":") if ":" in text else text.rpartition(".")
        if not module or not attr or (":" not in text and not sep):
            raise ValueError(f"train.reward_fn={fn!r}: expected an import path 'module.function' (or "
                             "'module:function')")
        return module, attr
    if not callable(fn):
        raise ValueError(f"train.reward_fn={fn!r} is a {type(fn).__name__}; expected a function "
                         "(completion: str, item: PromptItem) -> float or its import path 'module.function'")
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        raise ValueError(f"train.reward_fn={fn!r} cannot be imported by module path in the reward worker (a lambda, "
                         "nested function, partial or __main__ function): define it at the top level of an importable "
                         "module, or set train.reward_timeout_s=None to run it in the producer's thread (no timeout)")
    return module, qualname


def resolve_reward_fn(module: str, qualname: str) -> Callable:
    """Import ``module`` and return its attribute ``qualname`` (dotted for class attributes).

    Raises:
      ImportError / AttributeError: as the import or the lookup does.
      TypeError: the attribute is not callable.
    """
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{module}.{qualname} is a {type(obj).__name__}, not a function")
    return obj


def _as_score(value) -> float:
    """``value`` as a finite float, else ValueError (a bool is 0/1; None, strings, NaN, inf are refused)."""
    import numbers

    import numpy as np

    if isinstance(value, (bool, np.bool_)):
        return float(value)
    try:

        if not isinstance(value, numbers.Real):
            raise TypeError
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"returned {type(value).__name__} {str(value)[:80]!r}, not a number") from None
    if not math.isfinite(out):
        raise ValueError(f"returned {out}, not a finite number")
    return out


def _worker_main(conn, module: str, qualname: str) -> None:
    """The reward worker process: import the function, say ``"ready"`` (or send the import error and stop), then
    ``(completion, item)`` in, ``("ok", score)`` or ``("error", "Type: message")`` out, until the pipe closes.
    Ctrl-C is the parent's to handle (SIGINT ignored)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fn = resolve_reward_fn(module, qualname)
    except BaseException as e:  # noqa: BLE001 - reported to the parent as the start error
        conn.send(f"cannot import {module}.{qualname}: {type(e).__name__}: {e}".splitlines()[0])
        return

    def handle(*args):
        try:
            return ("ok", _as_score(fn(*args)))
        except BaseException as e:  # noqa: BLE001 - any failure of user code is a failed score, reported
            return ("error", f"{type(e).__name__}: {e}".splitlines()[0][:300] if str(e) else type(e).__name__)

    serve(conn, handle)


class CustomReward:
    """A user reward function run as ``train.reward_fn`` (module docstring): callable as
    ``(completion: str, item: PromptItem) -> float`` like the built-in rewards, never raising.

    Args:
      fn: the function, or its import path ``"module.function"`` / ``"module:function"``.
      timeout_s: seconds per completion (> 0), in a worker process; None runs ``fn`` in the caller's thread, no
        timeout.
      name: how messages name the binding (default ``"train.reward_fn"``).

    Attributes:
      failures, timeouts: counts since the last :meth:`take_counts` (a timeout is also a failure).
      label: ``"module.function"``.

    Raises:
      ValueError: ``fn`` cannot be imported by module path (worker mode), the import path does not resolve, or the
        worker cannot start; one line naming ``name``.
    """

    def __init__(self, fn, timeout_s: float | None = 10.0, *, name: str = "train.reward_fn"):
        if timeout_s is not None and (isinstance(timeout_s, bool) or not timeout_s > 0):
            raise ValueError(f"train.reward_timeout_s must be > 0 or None, got {timeout_s!r}")
        self.name, self.timeout_s = name, timeout_s
        self._lock = threading.Lock()
        self.failures = self.timeouts = 0
        self._warned: set[str] = set()
        self._worker = None
        if timeout_s is None and not isinstance(fn, str):
            if not callable(fn):
                reward_fn_path(fn)  # raises the one-line error
            self.fn, self.label = fn, getattr(fn, "__qualname__", repr(fn))
            return
        self._path = reward_fn_path(fn)
        self.label = ".".join(self._path)
        if isinstance(fn, str):  # a path: resolve it here too (the in-thread mode calls it; an early clear error)
            try:
                fn = resolve_reward_fn(*self._path)
            except (ImportError, AttributeError, TypeError) as e:
                raise ValueError(f"{name}={self.label!r}: {type(e).__name__}: {e}".splitlines()[0]) from None
        self.fn = fn
        if timeout_s is not None:
            try:
                self._start()
            except RuntimeError as e:
                raise ValueError(f"{name}={self.label}: {e}".splitlines()[0]) from None
            weakref.finalize(self, CustomReward._kill_worker, self._worker_box)

    # -- the worker ---------------------------------------------------------------------------------------------
    def _start(self) -> None:
        worker = _ScoringWorker(target=_worker_main, args=self._path, name="fp8rl-reward",
                                what=f"the reward worker of {self.name}={self.label}",
                                start_timeout_s=WORKER_START_S)
        self._worker = worker
        box = getattr(self, "_worker_box", None)
        if box is None:
            self._worker_box = box = [None]
        box[0] = worker

    @staticmethod
    def _kill_worker(box) -> None:
        if box and box[0] is not None:
            box[0].kill()
            box[0] = None

    def close(self) -> None:
        """Stop the worker process (a later call starts a new one)."""
        with self._lock:
            if self._worker is not None:
                self._worker.kill()
                self._worker = None
                self._worker_box[0] = None

    # -- scoring ------------------------------------------------------------------------------------------------
    def __call__(self, completion: str, item) -> float:
        """The score of ``completion`` for ``item``; 0.0 (counted) on an error or a timeout. Never raises."""
        if self.timeout_s is None:
            try:
                return _as_score(self.fn(completion, item))
            except Exception as e:  # noqa: BLE001 - user code: a failed score
                return self._failed("error", f"{type(e).__name__}: {e}")
        with self._lock:  # one completion at a time: the worker is one process
            try:
                if self._worker is None:
                    self._start()
                self._worker.conn.send((completion, item))
                if not self._worker.conn.poll(self.timeout_s):
                    self._restart()
                    self.timeouts += 1
                    return self._failed("timeout", f"ran past train.reward_timeout_s={self.timeout_s:g} s; the "
                                                   "worker was killed (a new one starts for the next completion)")
                status, value = self._worker.conn.recv()
            except Exception as e:  # noqa: BLE001 - the worker died, could not start, or the item did not pickle
                self._restart()
                return self._failed("error", f"the reward worker failed ({type(e).__name__}: {e})")
            if status == "ok":
                return float(value)
            return self._failed("error", value)

    def _restart(self) -> None:
        if self._worker is not None:
            self._worker.kill()
        self._worker = None
        self._worker_box[0] = None

    def _failed(self, kind: str, message: str) -> float:
        self.failures += 1
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"{self.name}={self.label}: {message.splitlines()[0] if message else kind}; the completion "
                          f"scored 0.0 (reward/failures counts these{', reward/timeouts the timeouts' if kind == 'timeout' else ''}; "
                          f"further {'timeouts' if kind == 'timeout' else 'failures'} are not warned about)",
                          RuntimeWarning, stacklevel=3)
        return 0.0

    def take_counts(self) -> dict[str, float]:
        """``{"reward/failures": n, "reward/timeouts": m}`` since the last call, then reset to 0."""
        with self._lock:
            out = {"reward/failures": float(self.failures), "reward/timeouts": float(self.timeouts)}
            self.failures = self.timeouts = 0
        return out

    def __repr__(self) -> str:
        how = "in the caller's thread" if self.timeout_s is None else f"worker process, {self.timeout_s:g} s timeout"
        return f"CustomReward({self.label}, {how})"
