"""User reward functions bound in gin (issue 39 item 12): ``train.reward_fn = @my_module.my_reward``.

References: the reward module is written to a temporary directory outside the package (imported through
``sys.path`` by the parent and by the spawned worker); the scores the trainer logs are recomputed here by calling the
same function in this process; a reward that raises scores 0 and is counted; one that sleeps past the timeout
scores 0, is counted, and leaves no hung worker behind.
"""

from __future__ import annotations

import argparse
import time
import uuid

import numpy as np
import pytest

from fp8rl_jax.data.custom_reward import CustomReward, reward_fn_path
from fp8rl_jax.data.types import ListDataset, PromptItem

REWARDS = '''
import os
import time

import gin


@gin.register
def length_reward(completion, item):
    """Depends on the completion and on the item (so both reach the worker intact)."""
    return float(len(completion) % 3 == 0) + 0.25 * float(item.answer == "7")


def boom(completion, item):
    raise ValueError("boom on purpose")


def slow_when(completion, item):
    if completion.startswith("slow"):
        time.sleep(60)
    return 1.0


def always_slow(completion, item):
    time.sleep(60)
    return 1.0


def not_a_number(completion, item):
    return "high"


def dies_when(completion, item):
    if completion == "die":
        os._exit(3)
    return 2.0
'''

ITEM = PromptItem(messages=[{"role": "user", "content": "3+4="}], answer="7", task="toy")


@pytest.fixture(scope="module")
def reward_module(tmp_path_factory):
    """The name of a fresh module outside the package, on sys.path for this module's tests."""
    import sys

    d = tmp_path_factory.mktemp("user_rewards")
    name = f"my_rewards_{uuid.uuid4().hex[:8]}"
    (d / f"{name}.py").write_text(REWARDS)
    sys.path.insert(0, str(d))
    yield name
    sys.path.remove(str(d))
    sys.modules.pop(name, None)


def test_worker_scores_like_the_function_and_counts_failures(reward_module):
    mod = __import__(reward_module)
    r = CustomReward(f"{reward_module}.length_reward", timeout_s=20.0)
    for text in ("abc", "abcd", ""):
        assert r(text, ITEM) == mod.length_reward(text, ITEM)
    other = PromptItem(messages=ITEM.messages, answer="8", task="toy")
    assert r("abc", other) == 1.0
    assert r.take_counts() == {"reward/failures": 0.0, "reward/timeouts": 0.0}
    bad = CustomReward(getattr(mod, "boom"), timeout_s=20.0)
    with pytest.warns(RuntimeWarning, match="boom on purpose"):
        assert bad("x", ITEM) == 0.0
    assert bad("y", ITEM) == 0.0  # warned once only
    assert bad.take_counts() == {"reward/failures": 2.0, "reward/timeouts": 0.0}
    assert bad.take_counts() == {"reward/failures": 0.0, "reward/timeouts": 0.0}
    nan = CustomReward(f"{reward_module}:not_a_number", timeout_s=20.0)
    with pytest.warns(RuntimeWarning, match="returned str 'high', not a number"):
        assert nan("x", ITEM) == 0.0
    dies = CustomReward(f"{reward_module}.dies_when", timeout_s=20.0)
    with pytest.warns(RuntimeWarning, match="reward worker failed"):
        assert dies("die", ITEM) == 0.0
    assert dies("live", ITEM) == 2.0  # a new worker took over
    assert dies.take_counts()["reward/failures"] == 1.0
    for x in (r, bad, nan, dies):
        x.close()


def test_a_reward_past_the_timeout_scores_zero_and_the_worker_is_replaced(reward_module):
    r = CustomReward(f"{reward_module}.slow_when", timeout_s=0.5)
    t0 = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="ran past train.reward_timeout_s=0.5 s"):
        assert r("slow one", ITEM) == 0.0
    assert time.perf_counter() - t0 < 10  # the worker was killed, not waited for (it sleeps 60 s)
    old = r._worker
    assert old is None  # killed; the next call starts a new one
    assert r("fast", ITEM) == 1.0
    assert r.take_counts() == {"reward/failures": 1.0, "reward/timeouts": 1.0}
    r.close()


def test_in_thread_mode_and_clear_errors(reward_module):
    mod = __import__(reward_module)
    inline = CustomReward(lambda c, item: 1 / 0, timeout_s=None)  # a lambda is fine in the caller's thread
    with pytest.warns(RuntimeWarning, match="ZeroDivisionError"):
        assert inline("x", ITEM) == 0.0
    assert inline.take_counts()["reward/failures"] == 1.0
    assert CustomReward(mod.length_reward, timeout_s=None)("abc", ITEM) == 1.25
    with pytest.raises(ValueError, match="train.reward_fn=.*cannot be imported by module path"):
        CustomReward(lambda c, item: 1.0, timeout_s=5.0)
    with pytest.raises(ValueError, match=r"train.reward_fn='no_such_module_zz.f': ModuleNotFoundError"):
        CustomReward("no_such_module_zz.f", timeout_s=5.0)
    with pytest.raises(ValueError, match=r"train.reward_fn=.*AttributeError"):
        CustomReward(f"{reward_module}.missing", timeout_s=5.0)
    with pytest.raises(ValueError, match="expected an import path"):
        reward_fn_path("nodot")
    assert reward_fn_path(mod.boom) == (reward_module, "boom")
    from fp8rl_jax.trainer import TrainConfig

    with pytest.raises(ValueError, match="train.reward_fn=3 is a int"):
        TrainConfig(reward_fn=3)
    with pytest.raises(ValueError, match="train.reward_timeout_s must be > 0"):
        TrainConfig(reward_timeout_s=0)


def test_gin_bound_reward_in_a_tiny_training_run(reward_module, tmp_path):
    """``train.reward_fn = @<module>.length_reward`` through the command line's gin parsing; two steps score with it
    in the worker (the logged reward is recomputed here); then a raising reward and one past the timeout score 0 and
    are counted in reward/failures and reward/timeouts."""
    import gin

    from conftest import make_tiny_run_dir
    from fp8rl_jax.trainer import RLTrainer
    from fp8rl_jax.trainer.cli import config_from_gin_flags

    mod = __import__(reward_module)
    tiny = make_tiny_run_dir(tmp_path / "tiny")
    params = [f"import {reward_module}", f"train.reward_fn = @{reward_module}.length_reward",
              "train.reward_timeout_s = 0.5", f"train.model = '{tiny}'", "train.num_steps = 4",
              "train.prompts_per_step = 2", "train.samples_per_prompt = 2", "train.max_tokens = 4",
              "train.rollout_precision = 'float32'", "train.progress_bar = False", "train.verify_sync = 'off'"]
    try:
        cfg, err = config_from_gin_flags(argparse.Namespace(gin_file=[], gin_param=params,
                                                            output_dir=str(tmp_path / "out")))
    finally:
        gin.clear_config()
    assert err is None, err
    assert callable(cfg.reward_fn) and cfg.reward_fn.__qualname__ == "length_reward"
    data = ListDataset([PromptItem(messages=[{"role": "user", "content": f"{a}+{b}="}], answer=str(a + b),
                                   task="toy") for a in range(10) for b in range(10)], name="toy")
    tr = RLTrainer(cfg, dataset=data)
    assert isinstance(tr.reward_fn, CustomReward) and tr.reward_fn.label == f"{reward_module}.length_reward"
    for _ in range(2):
        items = next(iter(data.iterate_batches(2, seed=cfg.seed, start_index=tr.batches.position)))
        m = tr.step()
        expect = [mod.length_reward(t, items[i // 2]) for i, t in enumerate(tr.last_texts)]
        assert m["reward/mean"] == pytest.approx(float(np.mean(expect)), abs=1e-6)
        assert m["reward/failures"] == 0 and m["reward/timeouts"] == 0
    tr.reward_fn = CustomReward(mod.boom, timeout_s=5.0)
    with pytest.warns(RuntimeWarning, match="boom on purpose"):
        m = tr.step()
    assert m["reward/failures"] == 4 and m["reward/timeouts"] == 0 and m["reward/mean"] == 0
    tr.reward_fn = CustomReward(f"{reward_module}.always_slow", timeout_s=0.3)
    t0 = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="ran past"):
        m = tr.step()
    assert m["reward/failures"] == 4 and m["reward/timeouts"] == 4 and m["reward/mean"] == 0
    assert time.perf_counter() - t0 < 60  # four kills and restarts, never the 60 s sleeps
    tr.reward_fn.close()
