"""Reward functions: ``reward_fn(completion: str, item: PromptItem) -> float``.

* ``chain_sum_reward``: extract the final number (``extract_final_answer``) and score it with
  reasoning-gym's own ``score_answer`` for ``item.task`` (the reference scorer), binarized to {0, 1}
  (reasoning-gym gives partial credit ``len(gold)/len(answer)`` when the gold string is a substring).
* ``math_verify_reward``: HuggingFace math-verify, which parses LaTeX/plain expressions with sympy and
  checks equivalence (``1/2 == 0.5 == \\frac{1}{2}``); for GSM8K and MATH.

Any model text (empty, garbage, huge numbers, unbalanced braces) gives 0.0 instead of raising.

A user's own function of the same signature is bound with ``train.reward_fn`` (gin) and runs in a worker process of
this module's :class:`_ScoringWorker` with a timeout: :mod:`fp8rl_jax.data.custom_reward`.
"""

from __future__ import annotations

import functools
import re
import threading
from decimal import Decimal, InvalidOperation
from typing import Callable

from fp8rl_jax.data.types import PromptItem

RewardFn = Callable[[str, PromptItem], float]

# A number: optional sign (ASCII '-', '+' or Unicode minus) that is not a binary operator (not preceded by
# a word character, ')' or ']'), then digits with optional 1,000-style grouping, then an optional decimal
# part. A trailing period ("is 7.") is not part of the number.
_NUMBER_RE = re.compile(
    r"(?:(?<![\w)\]])[-+\u2212])?(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?", re.ASCII)
_FULL_NUMBER_RE = re.compile(
    r"[-+\u2212]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?\.?", re.ASCII)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# Numbers longer than this are never canonicalized (int(Decimal) on huge values is slow); they are still
# compared exactly by the scorer.
_MAX_CANON_LEN = 200


def _clean_number(token: str) -> str:
    """Strip grouping commas, a leading '+', a trailing period; Unicode minus -> '-'."""
    s = token.replace(",", "").replace("\u2212", "-").rstrip(".")
    return s[1:] if s.startswith("+") else s


def last_boxed_content(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, else None.

    Braces are matched by depth counting, so nested groups (``\\boxed{\\frac{1}{2}}``) are kept whole. An
    unclosed last box (a truncated completion) is skipped in favour of an earlier closed one. Linear time.
    """
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    limit = len(text)
    for start in reversed(starts):
        depth = 1
        i = start
        while i < limit:
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
            i += 1
        # An unclosed box swallows everything after it, so an earlier box can only close before it.
        limit = start
    return None


def extract_final_answer(completion: str) -> str | None:
    """The final answer of a completion as a string, or None when there is none.

    Rules: if the text has a balanced ``\\boxed{...}``, the answer is its (last) content; when that content
    is a plain number (``$`` and spaces ignored) it is cleaned like below, else returned stripped (e.g.
    ``"\\frac{1}{2}"``). Otherwise the answer is the last number in the text: negatives (``-3``, Unicode
    minus; a ``-`` right after a digit, letter or closing bracket is a binary minus, so ``"10-3"`` gives
    ``"3"``), ``1,000``-style grouping (commas removed), decimals (``"7.0"`` kept as is), and a sentence's
    trailing period (``"is 7."`` gives ``"7"``). A leading ``+`` is dropped. Scientific notation is not
    recognized. Non-string input returns None. Never raises.
    """
    if not isinstance(completion, str) or not completion:
        return None
    try:
        boxed = last_boxed_content(completion)
        if boxed is not None:
            compact = boxed.replace("$", "").replace(" ", "").strip()
            if _FULL_NUMBER_RE.fullmatch(compact):
                return _clean_number(compact)
            stripped = boxed.strip()
            return stripped if stripped else None
        last = None
        for last in _NUMBER_RE.finditer(completion):
            pass
        return _clean_number(last.group(0)) if last is not None else None
    except Exception:  # defensive: extraction must never break the RL loop
        return None


def canonical_number(answer: str) -> str:
    """``"7.0"`` -> ``"7"``, ``"-0"`` -> ``"0"``, ``"+3.50"`` -> ``"3.5"``; non-numbers are returned unchanged."""
    s = answer.strip().replace(",", "")
    if len(s) > _MAX_CANON_LEN or not _FULL_NUMBER_RE.fullmatch(s):
        return answer
    try:
        d = Decimal(_clean_number(s))
    except InvalidOperation:
        return answer
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


@functools.lru_cache(maxsize=None)
def _rg_scorer(task: str):
    import reasoning_gym  # local: keeps `import rewards` cheap for math-only users

    return reasoning_gym.get_score_answer_fn(task)


def chain_sum_reward(completion: str, item: PromptItem) -> float:
    """1.0 if the completion's final answer is right for a reasoning-gym item, else 0.0.

    The answer from ``extract_final_answer`` is canonicalized (``"7.0"`` -> ``"7"``; reasoning-gym's
    ``chain_sum`` scorer already tolerates this, ``basic_arithmetic``'s compares strings) and scored with
    ``reasoning_gym.get_score_answer_fn(item.task)`` on the entry ``{"question", "answer", "metadata"}``
    rebuilt from ``item``; a score below 1 (reasoning-gym's partial substring credit) counts as 0.

    Args:
      completion: model text.
      item: a ``PromptItem`` from ``ReasoningGymDataset`` (any reasoning-gym task name in ``item.task``).

    Returns:
      0.0 or 1.0; 0.0 for any text without a correct final number, never raises on the text.

    Raises:
      ValueError: ``item.task`` is not a registered reasoning-gym task (a configuration error).
    """
    scorer = _rg_scorer(item.task)
    entry = {"question": item.metadata.get("question", ""), "answer": item.answer,
             "metadata": item.metadata.get("reasoning_gym", {})}
    try:
        answer = extract_final_answer(completion)
        if answer is None:
            return 0.0
        score = scorer(canonical_number(answer), entry)
        return 1.0 if score is not None and float(score) >= 1.0 else 0.0
    except Exception:
        return 0.0


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@functools.lru_cache(maxsize=8192)
def _parse_gold(answer: str, timeout: int | None):
    from math_verify import parse

    gold = answer.strip()
    if not (gold.startswith("$") or gold.startswith("\\(") or gold.startswith("\\[")):
        gold = f"${gold}$"
    return parse(gold, parsing_timeout=timeout)


def math_verify_reward(completion: str, item: PromptItem, timeout_seconds: int | None = 5,
                       max_chars: int | None = 20_000) -> float:
    """1.0 if math-verify judges the completion's answer equivalent to ``item.answer``, else 0.0.

    The gold answer (LaTeX, e.g. ``\\frac{1}{2}``, or a GSM8K number) is wrapped in ``$...$`` and parsed
    with ``math_verify.parse``; the completion is parsed with math-verify's default extraction (LaTeX and
    plain expressions; ``\\boxed{}`` has priority); ``math_verify.verify(gold, pred)`` decides
    (numeric equality to its default precision, symbolic equality, sets, intervals, ...).

    math-verify times out with ``signal.alarm``, which works only on a process's main thread. Off the main thread
    (the asynchronous trainer's rollout producer, docs/ASYNC.md) with a timeout, the completion is scored in a
    worker process (one, spawned on first use, a daemon that ignores Ctrl-C), on its main thread, where the
    timeouts work; a worker still busy ``2 * timeout_seconds + 30`` s later (stuck in C code that no signal
    interrupts, e.g. a huge integer power) is killed with a RuntimeWarning, the completion scores 0.0 and the next
    call starts a new worker.

    Args:
      completion: model text; only its last ``max_chars`` characters are parsed (None: all).
      item: a ``PromptItem`` whose ``answer`` is a LaTeX or plain answer.
      timeout_seconds: per-parse/compare timeout in seconds (None: none, and scored in this thread).

    Returns:
      0.0 or 1.0; never raises on the text (parse failures, timeouts and garbage give 0.0).
    """
    if not isinstance(completion, str) or not completion.strip():
        return 0.0
    if timeout_seconds is None or _on_main_thread():
        return _math_verify_score(completion, item.answer, timeout_seconds, max_chars)
    return _score_in_worker(completion, item.answer, timeout_seconds, max_chars)


def _math_verify_score(completion: str, answer: str, timeout: int | None, max_chars: int | None) -> float:
    """:func:`math_verify_reward` on this thread (``timeout`` needs the main thread: signal.alarm)."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    try:
        gold = _parse_gold(answer, timeout)
        if not gold:
            return 0.0
        text = completion[-max_chars:] if max_chars else completion
        pred = parse(text, parsing_timeout=timeout)
        if not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0
    except (Exception, TimeoutException):
        return 0.0


_WORKER_LOCK = threading.Lock()
_WORKER = None  # _ScoringWorker, started on first use
_WORKER_GRACE_S = 30.0  # beyond 2 x the timeout before a busy worker is killed
_WORKER_START_S = 300.0  # for a new worker to import math-verify (not counted in the kill clock)


def _worker_main(conn) -> None:
    """The scoring worker process: ``(completion, answer, timeout, max_chars)`` in, a score out, until the parent
    closes the pipe or dies (EOF). Ctrl-C is the parent's to handle (SIGINT ignored here)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import math_verify  # noqa: F401 - imported before "ready", so the kill clock never covers it

    serve(conn, _math_verify_score)


def serve(conn, handle) -> None:
    """A scoring worker's loop: send ``"ready"``, then for each argument tuple received send ``handle(*args)``, until
    the parent closes the pipe or dies (EOF / OSError). Shared by the math-verify worker and user reward workers
    (:mod:`fp8rl_jax.data.custom_reward`)."""
    conn.send("ready")
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(handle(*args))


class _ScoringWorker:
    """One spawned daemon process running ``target(conn, *args)`` over a pipe (a daemon: killed at the parent's exit;
    it exits by itself when the parent dies). The default target is :func:`_worker_main` (math-verify); user reward
    functions (``train.reward_fn``) use :func:`fp8rl_jax.data.custom_reward._worker_main`.

    The target sends ``"ready"`` once set up (imports done: not counted in any scoring time limit), or a one-line
    error text and returns; the constructor waits up to ``start_timeout_s`` for it.

    Raises:
      RuntimeError: the worker did not become ready (timed out, died, or sent an error, quoted).
    """

    def __init__(self, target=None, args: tuple = (), name: str = "fp8rl-math-verify",
                 what: str = "the math-verify scoring worker", start_timeout_s: float = _WORKER_START_S):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main if target is None else target, args=(child, *args),
                                   daemon=True, name=name)
        self.process.start()
        child.close()
        try:
            msg = self.conn.recv() if self.conn.poll(start_timeout_s) else None
        except (EOFError, OSError):
            msg = "the process exited before it was ready"
        if msg != "ready":
            self.kill()
            raise RuntimeError(f"{what} did not start within {start_timeout_s:g} s" if msg is None
                               else f"{what} did not start: {msg}")

    def score(self, args: tuple, limit_s: float) -> float | None:
        """The worker's score for ``args``, or None when it has not answered within ``limit_s`` seconds."""
        self.conn.send(args)
        return self.conn.recv() if self.conn.poll(limit_s) else None

    def kill(self) -> None:
        """Kill the process (whatever it is doing) and close the pipe; idempotent."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


def _score_in_worker(completion: str, answer: str, timeout: int, max_chars: int | None) -> float:
    """:func:`_math_verify_score` in the worker process (its main thread: math-verify's timeouts work there);
    a worker that has not answered within ``2 * timeout + _WORKER_GRACE_S`` s is killed (0.0, warned) and a new one
    starts at the next call; a worker that died or cannot start gives 0.0 too (never raises)."""
    import warnings

    global _WORKER
    limit = 2 * timeout + _WORKER_GRACE_S
    # one completion at a time: the worker is one process (scorers in other threads wait here, up to `limit` each)
    with _WORKER_LOCK:
        try:
            if _WORKER is None:
                _WORKER = _ScoringWorker()
            score = _WORKER.score((completion, answer, timeout, max_chars), limit)
            if score is not None:
                return score
            warnings.warn(f"math_verify_reward: the scoring worker ran past {limit:g} s on a completion "
                          f"(ending {completion[-80:]!r}) despite math-verify's {timeout} s timeout; it was killed "
                          "and the completion scored 0.0", RuntimeWarning, stacklevel=3)
        except Exception as e:  # noqa: BLE001 - a worker that died or cannot start: 0.0, a new worker next time
            warnings.warn(f"math_verify_reward: the scoring worker failed ({type(e).__name__}: {e}); the completion "
                          "scored 0.0 and a new worker starts at the next call", RuntimeWarning, stacklevel=3)
        if _WORKER is not None:
            _WORKER.kill()
            _WORKER = None
        return 0.0


REWARD_FNS: dict[str, RewardFn] = {
    "chain_sum": chain_sum_reward,
    "basic_arithmetic": chain_sum_reward,
    "reasoning_gym": chain_sum_reward,
    "math_verify": math_verify_reward,
}


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered under ``name`` (see ``REWARD_FNS``).

    Raises:
      ValueError: unknown name; the message lists the valid names.
    """
    try:
        return REWARD_FNS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown reward function {name!r}; valid names: {', '.join(sorted(REWARD_FNS))}") from None
