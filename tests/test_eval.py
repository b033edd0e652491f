"""Evaluation (fp8rl_jax.trainer.evaluation, scripts/eval.py): pass@1 / mean@n / pass@n against a direct
math-verify scoring of fixed completions on real GSM8K items, Chen et al.'s pass@k formula, the trainer's
eval hook, and the eval script end to end on a tiny random model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import make_tiny_run_dir
from fp8rl_jax.rollout.types import RolloutBatch
from fp8rl_jax.trainer.evaluation import BOXED_INSTRUCTION, evaluate, load_eval_items, pass_at_k

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ref_pass_at_k(n, c, k):
    """Chen et al. 2021's numerically stable product form: 1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def test_pass_at_k_matches_product_form():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_ref_pass_at_k(n, c, k), abs=1e-12)
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)


class TableTokenizer:
    """Chat template = the user text; encode = one id per distinct prompt; decode = a completion table."""

    def __init__(self, completions):
        self.prompts: dict[str, int] = {}
        self.completions = completions  # id -> text

    def apply_chat_template(self, messages, add_generation_prompt=True):
        assert add_generation_prompt
        return messages[-1]["content"]

    def encode(self, text):
        return [self.prompts.setdefault(text, len(self.prompts))]

    def decode(self, ids):
        return self.completions[ids[0]]


class TableEngine:
    """Row j of prompt p answers with completion id ``table[p][j]`` (response length = 1 + j)."""

    def __init__(self, table):
        self.table, self.batch_sizes, self.prompt_bucket, self.buckets_seen = table, [], 8, []

    def generate(self, prompts, sp):
        self.batch_sizes.append(len(prompts))
        self.buckets_seen.append(self.prompt_bucket)
        rows = [(p[0], j) for p in prompts for j in range(sp.n)]
        ids = np.zeros((len(rows), sp.max_tokens), np.int32)
        mask = np.zeros((len(rows), sp.max_tokens), np.float32)
        for r, (p, j) in enumerate(rows):
            ids[r, 0] = self.table[p][j]
            mask[r, :1 + j] = 1
        return RolloutBatch([list(p) for p in prompts for _ in range(sp.n)], ids, np.zeros_like(mask), mask,
                            ["length" if 1 + j == sp.max_tokens else "stop" for _, j in rows],
                            np.repeat(np.arange(len(prompts), dtype=np.int32), sp.n))


def _direct_math_verify(completion, gold):
    from math_verify import parse, verify

    return float(bool(verify(parse(f"${gold}$"), parse(completion))))


def test_evaluate_matches_direct_math_verify():
    items = load_eval_items("gsm8k", 5)
    golds = [it.answer for it in items]
    assert golds[:3] == ["18", "3", "70000"]  # the file's first rows (GSM8K test order)
    wrong = str(int(golds[0]) + 1)
    completions = [f"so the answer is \\boxed{{{golds[0]}}}", f"\\boxed{{{wrong}}}", "I don't know",
                   f"Step 1 ... The final answer is {golds[1]}", f"#### {golds[2]}",
                   f"$\\boxed{{{int(golds[3]):,}}}$", f"{golds[4]} apples, then 7"]
    # prompt p, sample j -> completion id
    table = [[0, 1, 2], [3, 2, 2], [4, 4, 1], [5, 2, 1], [6, 6, 6]]
    n = 3
    eng, tok = TableEngine(table), TableTokenizer(completions)
    out = evaluate(eng, tok, "gsm8k", 5, n=n, temperature=1.0, max_tokens=3, batch_size=2, return_samples=True)
    ref = np.array([[_direct_math_verify(completions[table[p][j]], golds[p]) for j in range(n)] for p in range(5)])
    assert 0 < ref.mean() < 1 and ref.any(axis=1).mean() < 1  # a non-trivial mix
    c = ref.sum(axis=1)
    assert out["val/gsm8k/pass@1"] == pytest.approx(np.mean(c / n))
    assert out["val/gsm8k/mean@3"] == pytest.approx(ref.mean())
    assert out["val/gsm8k/pass@3"] == pytest.approx(np.mean(c > 0))
    assert out["val/gsm8k/num_examples"] == 5
    assert out["val/gsm8k/response_length/mean"] == pytest.approx(2.0)  # lengths 1, 2, 3 per prompt
    assert out["val/gsm8k/clip_ratio"] == pytest.approx(1 / 3)
    assert eng.batch_sizes == [2, 2, 2]  # the last chunk (1 prompt) is padded to the batch shape
    assert eng.buckets_seen == [64, 64, 64] and eng.prompt_bucket == 8  # bucket raised, then restored
    by_row = {(s["index"], s["completion"]): s["reward"] for s in out["samples"]}
    for p in range(5):
        for j in range(n):
            assert by_row[(p, completions[table[p][j]])] == ref[p, j]
    # prompts carry the \boxed{} instruction after the question
    assert list(tok.prompts)[0].endswith("\n" + BOXED_INSTRUCTION)


def test_evaluate_errors():
    eng, tok = TableEngine([[0]]), TableTokenizer(["x"])
    with pytest.raises(ValueError, match="unknown eval dataset 'gsm9k'"):
        evaluate(eng, tok, "gsm9k", 1)
    with pytest.raises(ValueError, match="n must be a positive int"):
        evaluate(eng, tok, "gsm8k", 1, n=0)
    with pytest.raises(ValueError, match="num_examples must be None or a positive int"):
        evaluate(eng, tok, "gsm8k", -3)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_run_dir(tmp_path_factory.mktemp("eval_tiny"))


def test_eval_script_on_tiny_model(tiny_dir, tmp_path):
    out = tmp_path / "eval.json"
    r = subprocess.run([sys.executable, "scripts/eval.py", "--model", tiny_dir, "--dataset", "math500",
                        "--num_examples", "2", "--n", "2", "--temperature", "1.0", "--max_tokens", "3",
                        "--batch_size", "2", "--precision", "bf16", "--output", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "accuracy (pass@1)" in r.stdout
    res = json.loads(out.read_text())
    clip = res["metrics"]["val/math500/clip_ratio"]
    # most answers cut at --max_tokens: the run says so and what to do (issue 31), never silently 0%
    assert ("cut at --max_tokens=3" in r.stdout) == (clip >= 0.5), (clip, r.stdout[-500:])
    m, samples = res["metrics"], res["samples"]
    assert m["val/math500/num_examples"] == 2 and len(samples) == 4
    assert all(1 <= s["length"] <= 3 for s in samples) and "cpu" in res["device"]
    golds = [it.answer for it in load_eval_items("math500", 2)]
    ref = np.array([[_direct_math_verify(s["completion"], golds[p]) for s in samples if s["index"] == p]
                    for p in range(2)])
    assert ref.shape == (2, 2)
    assert m["val/math500/pass@1"] == pytest.approx(ref.mean())
    assert m["val/math500/pass@2"] == pytest.approx(ref.any(axis=1).mean())
    bad = subprocess.run([sys.executable, "scripts/eval.py", "--dataset", "gsm9k"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "unknown --dataset 'gsm9k'" in bad.stderr and "Traceback" not in bad.stderr
