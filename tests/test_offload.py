"""Optimizer-state offload during rollout (train.offload_optimizer, fp8rl_jax.trainer.offload).

References: the optimizer's own arrays before the move (bit for bit after a round trip), and a run of the same
config without offload (identical metrics and final params: offload changes where the state waits, not what it is).
"""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

from conftest import make_tiny_run_dir
from fp8rl_jax.data.types import ListDataset, PromptItem
from fp8rl_jax.trainer import RLTrainer, TrainConfig, train
from fp8rl_jax.trainer.offload import move_optimizer_state, optimizer_memory_kinds


def test_round_trip_moves_every_array_and_keeps_values():
    import jax

    model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    x = jax.numpy.ones((3, 8))
    grads = nnx.grad(lambda m: (m(x) ** 2).sum())(model)
    opt.update(model, grads)  # non-zero moments
    before = [(np.asarray(l).copy(), l.sharding) for l in jax.tree.leaves(nnx.state(opt, nnx.OptState))]
    assert optimizer_memory_kinds(opt) == {"device"}
    moved = move_optimizer_state(opt, "pinned_host")
    assert moved == sum(a.nbytes for a, _ in before) and optimizer_memory_kinds(opt) == {"pinned_host"}
    assert move_optimizer_state(opt, "pinned_host") == 0  # already there
    move_optimizer_state(opt, "device")
    after = jax.tree.leaves(nnx.state(opt, nnx.OptState))
    for (a, sh), b in zip(before, after):
        assert b.sharding == sh and np.array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(np.asarray(b)).view(np.uint8))
    with pytest.raises(ValueError, match="has no 'hbm_somewhere' memory"):
        move_optimizer_state(opt, "hbm_somewhere")


def _reward(text: str, item) -> float:
    return float(sum(text.encode()) % 3 == 0)


def _run(tiny_dir, out, offload: bool):
    data = ListDataset([PromptItem(messages=[{"role": "user", "content": f"{a}+{b}="}], answer=str(a + b),
                                   task="toy") for a in range(10) for b in range(10)], name="toy")
    cfg = TrainConfig(output_dir=str(out), model=tiny_dir, num_steps=2, prompts_per_step=2, samples_per_prompt=4,
                      max_tokens=6, rollout_precision="float32", learning_rate=3e-2, progress_bar=False,
                      plots=False, offload_optimizer=offload)
    tr = RLTrainer(cfg, dataset=data)
    tr.reward_fn = _reward
    return train(cfg, trainer=tr), tr


def test_offloaded_run_equals_plain_run(tmp_path):
    from fp8rl_jax.models.decoder import named_params

    tiny = make_tiny_run_dir(tmp_path / "tiny")
    hist_a, tr_a = _run(tiny, tmp_path / "plain", False)
    hist_b, tr_b = _run(tiny, tmp_path / "offload", True)
    assert any(m["actor/grad_norm"] > 0 for m in hist_a), "degenerate run: no gradient, nothing to compare"
    for a, b in zip(hist_a, hist_b):
        assert b["memory/optimizer_offloaded_gb"] > 0 and b["timing/offload_s"] >= 0
        keep = [k for k in a if not k.startswith(("timing/", "memory/"))]
        assert {k: a[k] for k in keep} == {k: b[k] for k in keep}
    assert optimizer_memory_kinds(tr_b.optimizer) == {"device"}  # back for the next update / checkpoint
    pa, pb = named_params(tr_a.model), named_params(tr_b.model)
    assert all(np.array_equal(np.asarray(pa[k]), np.asarray(pb[k])) for k in pa)
