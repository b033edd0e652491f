"""DAPO dynamic sampling, soft overlong punishment and overlong filtering (fp8rl_jax.trainer.dapo), checked
against float64 / plain-Python references of the published rules (DAPO arXiv 2503.14476 eq. 11-13, verl
``DAPORewardManager`` and ``recipe/dapo`` ``filter_groups``), and wired through ``RLTrainer.step``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import make_tiny_run_dir
from fp8rl_jax.rollout.types import RolloutBatch
from fp8rl_jax.trainer import dapo


def _ref_penalty(length, l_max, l_b, factor):
    """DAPO eq. 13, written out case by case in float64."""
    if length <= l_max - l_b:
        return 0.0
    return float((l_max - l_b - length) / l_b * factor)


@pytest.mark.parametrize("l_max,l_b,factor", [(32, 8, 1.0), (100, 100, 0.5), (17, 3, 2.0), (5, 1, 1.0)])
def test_overlong_penalty_matches_formula(l_max, l_b, factor):
    lengths = np.arange(0, l_max + 1)
    got = dapo.overlong_penalty(lengths, l_max, l_b, factor)
    want = np.array([_ref_penalty(int(L), l_max, l_b, factor) for L in lengths])
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)
    assert got[-1] == pytest.approx(-factor)  # full penalty exactly at the budget
    assert np.all(got[: l_max - l_b + 1] == 0)


def test_overlong_penalty_errors():
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        dapo.overlong_penalty([1, 2], 8, 9)
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        dapo.overlong_penalty([1, 2], 8, 0)
    with pytest.raises(ValueError, match="penalty_factor"):
        dapo.overlong_penalty([1, 2], 8, 2, -1.0)
    with pytest.raises(ValueError, match=r"1-D"):
        dapo.overlong_penalty(np.ones((2, 2)), 8, 2)


def test_kept_groups_matches_all_equal_rule(rng):
    for n in (1, 2, 4, 5):
        vals = rng.integers(0, 2, size=12 * n).astype(float)
        vals[:n] = 0.3  # an all-equal non-binary group
        ref = [n == 1 or len(set(vals[g * n:(g + 1) * n].tolist())) > 1 for g in range(12)]
        assert dapo.kept_groups(vals, n).tolist() == ref
    with pytest.raises(ValueError, match="divisible by group_size=3"):
        dapo.kept_groups(np.zeros(7), 3)


def _scored_batch(values, n, tag, width=6, finish=None):
    """A ScoredBatch whose texts name (tag, row) so selections can be traced; scores = values."""
    rows = len(values)
    rb = RolloutBatch(prompt_token_ids=[[tag, r // n] for r in range(rows)],
                      response_token_ids=np.full((rows, width), tag, np.int32),
                      rollout_logprobs=np.zeros((rows, width), np.float32),
                      response_mask=np.ones((rows, width), np.float32),
                      finish_reason=finish or ["stop"] * rows,
                      prompt_index=np.repeat(np.arange(rows // n, dtype=np.int32), n))
    items = [f"item{tag}.{g}" for g in range(rows // n)]
    v = np.asarray(values, np.float64)
    return dapo.ScoredBatch(rb, items, [f"{tag}:{r}" for r in range(rows)], v, v - 0.25 * (v > 0.5))


def _ref_dynamic_sampling(batches, B, n, max_gen):
    """Plain-Python verl filter_groups: keep non-constant groups in order until B, then cut."""
    kept, k = [], 0
    for k, vals in enumerate(batches, start=1):
        for g in range(len(vals) // n):
            grp = vals[g * n:(g + 1) * n]
            if n == 1 or len(set(grp)) > 1:
                kept.append((k - 1, g))
        if len(kept) >= B:
            return kept[:B], k
        if max_gen > 0 and k >= max_gen:
            return None, k
    raise AssertionError("reference ran out of batches")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dynamic_sampling_refills_like_reference(seed):
    rng = np.random.default_rng(seed)
    B, n = 4, 3
    batches = [rng.integers(0, 2, size=B * n).tolist() for _ in range(30)]
    calls = iter(range(30))

    def gen():
        k = next(calls)
        return _scored_batch(batches[k], n, tag=k)

    out, metrics = dapo.dynamic_sampling(gen, B, n, max_num_gen_batches=0, metric="acc")
    ref, num_batches = _ref_dynamic_sampling(batches, B, n, 0)
    assert metrics["dapo/num_gen_batches"] == num_batches
    want_texts = [f"{k}:{g * n + j}" for k, g in ref for j in range(n)]
    assert out.texts == want_texts
    assert out.items == [f"item{k}.{g}" for k, g in ref]
    want_scores = np.array([batches[k][g * n + j] for k, g in ref for j in range(n)], float)
    np.testing.assert_array_equal(out.scores, want_scores)
    assert out.rollout.response_token_ids.shape == (B * n, 6)
    np.testing.assert_array_equal(out.rollout.prompt_index, np.repeat(np.arange(B), n))
    gen_groups = [(k, g) for k in range(num_batches) for g in range(B)]
    kept_all = sum(1 for k, g in gen_groups if len(set(batches[k][g * n:(g + 1) * n])) > 1)
    assert metrics["dapo/kept_groups_fraction"] == pytest.approx(kept_all / len(gen_groups))
    all_rows = np.concatenate([batches[k] for k in range(num_batches)]).astype(float)
    assert metrics["dapo/gen_score_mean"] == pytest.approx(all_rows.mean())


def test_dynamic_sampling_limit_raises_and_metric_choice():
    n = 2
    const = [1.0, 1.0, 0.0, 0.0]  # both groups constant in score
    with pytest.raises(ValueError, match=r"num_gen_batches=3 >= max_num_gen_batches=3"):
        dapo.dynamic_sampling(lambda: _scored_batch(const, n, 0), 2, n, max_num_gen_batches=3)
    # "seq_reward" filters on the penalized reward: rewards 1-0.25 vs 1 still constant per group here, but a
    # group with scores [1, 1] and different penalties is kept under seq_reward and dropped under acc
    sb = _scored_batch([1.0, 1.0, 0.0, 1.0], n, 0)
    sb.rewards = np.array([1.0, 0.5, 0.0, 1.0])
    out, m = dapo.dynamic_sampling(lambda: sb, 2, n, max_num_gen_batches=1, metric="seq_reward")
    assert m["dapo/kept_groups_fraction"] == 1.0 and out.texts == ["0:0", "0:1", "0:2", "0:3"]
    with pytest.raises(ValueError, match="num_gen_batches=1 >= max_num_gen_batches=1"):
        dapo.dynamic_sampling(lambda: sb, 2, n, max_num_gen_batches=1, metric="acc")
    with pytest.raises(ValueError, match="unknown filter_groups metric 'bogus'"):
        dapo.dynamic_sampling(lambda: sb, 2, n, metric="bogus")


def test_overlong_filter_mask():
    mask = np.ones((3, 4), np.float32)
    mask[1, 2:] = 0
    out = dapo.overlong_filter_mask(mask, ["length", "stop", "length"])
    np.testing.assert_array_equal(out, np.stack([np.zeros(4), mask[1], np.zeros(4)]))
    assert mask.sum() == 10  # input untouched
    with pytest.raises(ValueError, match="3 rows but finish_reason has 2"):
        dapo.overlong_filter_mask(mask, ["stop", "stop"])


# -- through the trainer ----------------------------------------------------------------------------------

class ScriptedEngine:
    """A RolloutEngine returning scripted responses: row r of call k is 'yes'/'no' plus filler up to a scripted
    length. Lets the test know every reward and length, so the trainer's DAPO metrics have a reference."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, 0
        self.yes, self.no, self.fill = tok.encode("y")[0], tok.encode("n")[0], tok.encode(".")[0]

    def generate(self, prompts, sp):
        answers, lengths = self.script[self.calls]
        self.calls += 1
        rows = len(prompts) * sp.n
        assert rows == len(answers)
        ids = np.full((rows, sp.max_tokens), 0, np.int32)
        mask = np.zeros((rows, sp.max_tokens), np.float32)
        for r, (a, L) in enumerate(zip(answers, lengths)):
            ids[r, :L] = self.fill
            ids[r, 0] = self.yes if a else self.no
            mask[r, :L] = 1
        return RolloutBatch([list(p) for p in prompts for _ in range(sp.n)], ids, -0.5 * mask, mask,
                            ["length" if L == sp.max_tokens else "stop" for L in lengths],
                            np.repeat(np.arange(len(prompts), dtype=np.int32), sp.n))

    def update_weights(self, weights):
        pass

    def close(self):
        pass


def test_train_dynamic_sampling_overlong_and_eval_hook(tmp_path_factory):
    """One RL step through train(): DAPO metrics against the scripted rewards/lengths, and val/ lines at
    step 0 and 1 equal to evaluate() on the same (deterministic) eval engine."""
    import json

    from fp8rl_jax.models.loading import load_tokenizer_for
    from fp8rl_jax.trainer import RLTrainer, TrainConfig, train
    from fp8rl_jax.trainer.evaluation import evaluate
    from test_eval import TableEngine, TableTokenizer

    d = make_tiny_run_dir(tmp_path_factory.mktemp("dapo_tiny"))
    out_dir = tmp_path_factory.mktemp("dapo_run")
    B, n, T, Lb, factor = 2, 2, 8, 4, 0.5
    cfg = TrainConfig(output_dir=str(out_dir), model=d, num_steps=1, prompts_per_step=B, samples_per_prompt=n,
                      max_response_length=T, rollout_precision="bf16", learning_rate=1e-3, progress_bar=False,
                      checkpoint_every=0, plots=False, filter_groups=True, max_num_gen_batches=5,
                      overlong_buffer_len=Lb, overlong_penalty_factor=factor, overlong_filter=True,
                      eval_every=1, eval_num_examples=3, eval_batch_size=2, verify_sync="off")
    # call 0: group0 constant (dropped), group1 mixed (kept); call 1: group0 constant, group1 mixed -> done.
    script = [([1, 1, 1, 0], [3, 8, 6, 2]), ([0, 0, 0, 1], [8, 1, 5, 8])]
    eng = ScriptedEngine(load_tokenizer_for(d), script)
    # an engine without score() cannot have its syncs content-checked: refused unless verify_sync="off" (issue 31)
    with pytest.raises(ValueError, match="verify_sync='every_step' cannot be honoured: ScriptedEngine has no score"):
        RLTrainer(dataclasses.replace(cfg, verify_sync="every_step"), engine=eng)
    tr = RLTrainer(cfg, engine=eng)
    tr.reward_fn = lambda text, item: 1.0 if text.startswith("y") else 0.0

    # eval goes to a table engine: GSM8K golds 18, 3, 70000 -> completions right, right, wrong
    eval_engine, eval_tok = TableEngine([[0], [1], [2]]), TableTokenizer(["\\boxed{18}", "3", "\\boxed{5}"])
    orig = tr.maybe_evaluate

    def maybe_evaluate(step=None):
        saved = tr.engine, tr.tokenizer
        tr.engine, tr.tokenizer = eval_engine, eval_tok
        try:
            return orig(step)
        finally:
            tr.engine, tr.tokenizer = saved

    tr.maybe_evaluate = maybe_evaluate
    hist = train(cfg, trainer=tr)
    assert len(hist) == 1 and tr.engine is eng
    lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1]
    want = evaluate(eval_engine, eval_tok, "gsm8k", 3, n=1, temperature=0.0, max_tokens=T, batch_size=2)
    assert want["val/gsm8k/pass@1"] == pytest.approx(2 / 3)
    for line in lines:
        for key in ("val/gsm8k/pass@1", "val/gsm8k/mean@1", "val/gsm8k/num_examples"):
            assert line[key] == pytest.approx(want[key])
    assert "reward/mean" not in lines[0]

    m = lines[1]
    assert eng.calls == 2 and m["dapo/num_gen_batches"] == 2.0
    assert m["dapo/kept_groups_fraction"] == pytest.approx(2 / 4)
    kept_scores = np.array([1.0, 0.0, 0.0, 1.0])
    kept_lengths = np.array([6, 2, 5, 8])
    pen = np.array([_ref_penalty(L, T, Lb, factor) for L in kept_lengths])
    assert m["reward/mean"] == pytest.approx(float(np.mean(kept_scores + pen)), abs=1e-6)
    assert m["reward/score_mean"] == pytest.approx(0.5)
    assert m["dapo/overlong_penalty_mean"] == pytest.approx(float(pen.mean()))
    assert m["dapo/overlong_filtered_fraction"] == pytest.approx(1 / 4)  # the kept length-8 row
    assert m["response_length/mean"] == pytest.approx(kept_lengths.mean())
    assert np.isfinite(m["actor/loss"]) and m["step"] == 1
