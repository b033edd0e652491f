"""Prompt datasets from a local file in verl's RL data layout (e.g. DAPO-Math-17k, AIME-2024 parquets).

verl's RL datasets (``verl.utils.dataset.rl_dataset.RLHFDataset``; the files written by
``examples/data_preprocess/*.py`` and shipped with ``recipe/dapo``) hold one row per prompt with the columns

* ``data_source``: a label such as ``"math_dapo"`` (kept in ``PromptItem.metadata``),
* ``prompt``: the chat, a list of ``{"role", "content"}`` messages (verl's ``data.prompt_key``),
* ``ability``: e.g. ``"MATH"``,
* ``reward_model``: ``{"style": "rule", "ground_truth": <answer str>}``,
* ``extra_info``: ``{"index", "split", ...}``.

``prompt_file_dataset`` reads such rows from ``.parquet`` (through pyarrow, if installed), ``.jsonl``,
``.jsonl.gz`` or ``.json`` (a list of rows) into a ``ListDataset`` of ``PromptItem``s whose ``answer`` is the
ground truth, for ``rewards.math_verify_reward``. A plain-string ``prompt`` becomes one user message, and a
row without the answer column may carry a top-level ``answer`` instead.

Note: verl's ``dapo-math-17k.parquet`` stores its ~17.9k prompts 100 times each (1.79M rows) and
``aime-2024.parquet`` its 30 problems 32 times; ``dedup=True`` keeps the first copy of each.
"""

from __future__ import annotations

import gzip
import json
import os
from typing import Any, Iterable, Iterator

import gin

from fp8rl_jax.data.types import ListDataset, PromptItem

#: File name endings ``prompt_file_dataset`` reads (matched case-insensitively, longest first).
SUPPORTED_EXTENSIONS = (".jsonl.gz", ".jsonl", ".json", ".parquet")
_ROLES = ("system", "user", "assistant")
_MISSING = object()


def _extension(path: str) -> str:
    name = os.path.basename(path).lower()
    for ext in SUPPORTED_EXTENSIONS:
        if name.endswith(ext):
            return ext
    raise ValueError(f"{path}: unknown file extension; supported: {', '.join(SUPPORTED_EXTENSIONS)}")


def _iter_jsonl(path: str, opener) -> Iterator[tuple[int, Any]]:
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {i} is not valid JSON: {e}") from None


def _iter_json(path: str) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8") as f:
        try:
            rows = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: a .json prompt file must hold a list of rows, got {type(rows).__name__}")
    return iter(enumerate(rows))


def _iter_parquet(path: str, columns: Iterable[str]) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {path} needs the 'pyarrow' package (pip install pyarrow), which is not "
                          f"installed; or convert the file to .jsonl") from e
    pf = pq.ParquetFile(path)
    names = set(pf.schema_arrow.names)
    wanted = [c for c in dict.fromkeys(columns) if c in names]  # only the columns we use: less memory
    i = 0
    # streamed in record batches: with ``dedup``/``limit`` only the kept rows stay in memory
    for batch in pf.iter_batches(batch_size=8192, columns=wanted or None):
        for row in batch.to_pylist():
            yield i, row
            i += 1


def _lookup(row: dict, dotted_key: str) -> Any:
    """``row["a"]["b"]`` for ``"a.b"``; ``_MISSING`` when a level is absent, None or not a dict."""
    value: Any = row
    for part in dotted_key.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            return _MISSING
        value = value[part]
    return value


def _messages(path: str, i: int, prompt: Any, prompt_key: str, system_prompt: str | None,
              instruction: str | None) -> list[dict]:
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)) and prompt:
        messages = []
        for j, m in enumerate(prompt):
            if (not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str)):
                raise ValueError(f"{path}: row {i}: field '{prompt_key}[{j}]' is not a chat message "
                                 f"{{'role': one of {list(_ROLES)}, 'content': str}}: {m!r:.200}")
            messages.append({"role": m["role"], "content": m["content"]})
    else:
        raise ValueError(f"{path}: row {i}: field '{prompt_key}' must be a string or a non-empty list of chat "
                         f"messages, got {type(prompt).__name__}")
    if not messages[-1]["content"].strip():
        raise ValueError(f"{path}: row {i}: field '{prompt_key}' has an empty last message")
    if instruction:
        last = messages[-1]
        messages[-1] = {"role": last["role"], "content": f"{last['content']}\n{instruction}"}
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _answer(path: str, i: int, row: dict, answer_key: str) -> str:
    value, field = _lookup(row, answer_key), answer_key
    if value is _MISSING and answer_key != "answer":
        value, field = _lookup(row, "answer"), "answer"
    if value is _MISSING:
        fallback = " (or 'answer')" if answer_key != "answer" else ""
        raise ValueError(f"{path}: row {i}: field '{answer_key}'{fallback} is missing")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{path}: row {i}: field '{field}' must be a string or a number, got "
                         f"{type(value).__name__}")
    answer = str(value).strip()
    if not answer:
        raise ValueError(f"{path}: row {i}: field '{field}' is empty")
    return answer


@gin.configurable
def prompt_file_dataset(path: str, prompt_key: str = "prompt", answer_key: str = "reward_model.ground_truth",
                        system_prompt: str | None = None, instruction: str | None = None,
                        limit: int | None = None, dedup: bool = False, task: str = "math") -> ListDataset:
    """Read a verl-layout RL prompt file into a ``ListDataset`` of ``PromptItem``s, in file order.

    Row layout (verl ``RLHFDataset``): ``row[prompt_key]`` is a list of chat messages ``[{"role": "system" |
    "user" | "assistant", "content": str}, ...]`` (extra keys dropped) or a plain string (one user message);
    the reference answer is at the dotted ``answer_key`` (nested dicts: ``"reward_model.ground_truth"`` is
    ``row["reward_model"]["ground_truth"]``), else at a top-level ``"answer"``; a number becomes its ``str``.
    Item: ``PromptItem(messages, answer (stripped str), task, metadata={"index": row index in the file
    (0-based; the line number for .jsonl), "data_source": row["data_source"] (only if present)})``.

    Args:
      path: a ``.parquet`` (needs pyarrow; only the used columns are read), ``.jsonl``, ``.jsonl.gz`` or
        ``.json`` (a list of row objects) file; ``~`` is expanded. gin: ``prompt_file_dataset.path``.
      prompt_key: column of the prompt (verl ``data.prompt_key``); dotted for nested dicts.
      answer_key: dotted path of the reference answer.
      system_prompt: prepended as a system message unless the row's chat already starts with one.
      instruction: appended on a new line to the last message's content (None or "": nothing).
      limit: keep only the first ``limit`` items (after ``dedup``); None: all.
      dedup: drop rows whose (messages, answer) repeat an earlier row (verl's DAPO-Math-17k parquet repeats
        every prompt 100 times).
      task: ``PromptItem.task`` of every item (``"math"``: scored by ``rewards.math_verify_reward``).

    Returns:
      a ``ListDataset`` named after the file.

    Raises:
      FileNotFoundError: ``path`` is not a file.
      ImportError: a ``.parquet`` file without pyarrow installed (the message names the package).
      ValueError: unknown extension (the message lists the supported ones); a bad ``limit``; a line that is
        not JSON or a row that is not an object; a missing/malformed prompt or a missing/empty/non-scalar
        answer (the message names the row index and the field); a file with no rows.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be None or a positive int, got {limit!r}")
    path = os.path.expanduser(os.fspath(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file not found: {path!r}")
    ext = _extension(path)
    if ext == ".parquet":
        rows = _iter_parquet(path, [prompt_key.split(".")[0], answer_key.split(".")[0], "answer", "data_source"])
    elif ext == ".json":
        rows = _iter_json(path)
    else:
        rows = _iter_jsonl(path, gzip.open if ext == ".jsonl.gz" else open)
    items: list[PromptItem] = []
    seen: set[str] = set()
    n_rows = 0
    for i, row in rows:
        if limit is not None and len(items) >= limit:
            break
        n_rows += 1
        if not isinstance(row, dict):
            raise ValueError(f"{path}: row {i} is not an object, got {type(row).__name__}")
        prompt = _lookup(row, prompt_key)
        if prompt is _MISSING:
            raise ValueError(f"{path}: row {i}: field '{prompt_key}' is missing")
        messages = _messages(path, i, prompt, prompt_key, system_prompt, instruction)
        answer = _answer(path, i, row, answer_key)
        if dedup:
            key = json.dumps([messages, answer], ensure_ascii=False)
            if key in seen:
                continue
            seen.add(key)
        metadata: dict = {"index": i}
        if row.get("data_source") is not None:
            metadata["data_source"] = row["data_source"]
        items.append(PromptItem(messages=messages, answer=answer, task=task, metadata=metadata))
    if n_rows == 0:
        raise ValueError(f"{path}: the file has no rows")
    return ListDataset(items, name=os.path.basename(path))
