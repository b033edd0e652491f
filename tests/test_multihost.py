"""Multi-process training (issue 19): two JAX processes on localhost joined with ``jax.distributed`` (gloo
collectives on CPU), one CPU device each, a ``data=2`` mesh across them, run two RL steps of the real trainer
(each process with its own embedded engine generating its own half of the prompts, the halves all-gathered;
process 0 writes the run files, both write the checkpoint). The reference is the same config in one process on one
device: the same rollouts (token for token), losses and gradient norms within float32 tolerance, the same
parameters after two updates.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


def _child(process_id: int, port: int, out: str, model: str, nproc: int) -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    from fp8rl_jax.trainer import distributed

    distributed.initialize(distributed.DistributedConfig(coordinator_address=f"127.0.0.1:{port}",
                                                         num_processes=nproc, process_id=process_id))
    import jax

    from fp8rl_jax.models.decoder import named_params
    from fp8rl_jax.trainer import RLTrainer, TrainConfig, train
    from test_checkpoint import fixed_length_dataset, text_reward

    cfg = TrainConfig(output_dir=out, model=model, num_steps=2, prompts_per_step=2, samples_per_prompt=2,
                      max_tokens=4, rollout_precision="float32", learning_rate=1e-2, progress_bar=False,
                      checkpoint_every=1, plots=False, mesh="data=2" if nproc > 1 else None)
    tr = RLTrainer(cfg, dataset=fixed_length_dataset())
    tr.reward_fn = text_reward
    calls = []  # what this process's engine generated: (prompts, row_offset, response tokens) per call
    generate = tr.engine.generate

    def recording_generate(prompts, sp, *args, **kwargs):
        rb = generate(prompts, sp, *args, **kwargs)
        calls.append([len(prompts), kwargs.get("row_offset", 0), rb.response_token_ids.tolist()])
        return rb

    tr.engine.generate = recording_generate
    history = train(cfg, trainer=tr)
    params = {k: distributed.to_host(v).astype(np.float64).tolist()
              for k, v in named_params(tr.model).items() if k.endswith("layers.0.mlp.up_proj.weight")}
    with open(os.path.join(os.path.dirname(out), f"result_{os.path.basename(out)}_{process_id}.json"), "w") as f:
        json.dump({"history": history, "params": params, "calls": calls, "processes": jax.process_count(),
                   "devices": jax.device_count()}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _result(tmp_path, run: str, process_id: int) -> dict:
    return json.loads((tmp_path / f"result_{run}_{process_id}.json").read_text())


@pytest.mark.slow
def test_two_processes_run_two_rl_steps_like_one(tmp_path):
    from conftest import make_tiny_smollm2_vocab_dir

    model = make_tiny_smollm2_vocab_dir(tmp_path / "m")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    from conftest import xla_flags_for_one_device

    env["XLA_FLAGS"] = xla_flags_for_one_device()  # one CPU device per process
    def run(pid, port, name, n):  # output to files: a full pipe would stall one process at the shutdown barrier
        log = open(tmp_path / f"{name}_{pid}.log", "w")
        return subprocess.Popen([sys.executable, HERE, str(pid), str(port), str(tmp_path / name), model, str(n)],
                                cwd=ROOT, env=env, text=True, stdout=log, stderr=subprocess.STDOUT)

    def check(p, name, pid):
        p.wait(timeout=600)
        text = (tmp_path / f"{name}_{pid}.log").read_text()
        assert p.returncode == 0, "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("@"))[-4000:]

    check(run(0, 0, "one", 1), "one", 0)
    port = _free_port()
    procs = [run(i, port, "two", 2) for i in range(2)]
    for i, p in enumerate(procs):
        check(p, "two", i)
    one, two = _result(tmp_path, "one", 0), [_result(tmp_path, "two", i) for i in range(2)]
    assert one["processes"] == 1 and all(t["processes"] == 2 and t["devices"] == 2 for t in two)
    # a real update: an all-reduced gradient that is not trivially zero
    assert any(m["actor/grad_norm"] > 0 for m in one["history"])
    # the rollout is split: each process generated its own prompt (2 rows) with the global rows' noise, and the
    # two halves are the one-process rollout token for token (the gathered batch trains both processes)
    assert [c[:2] for c in one["calls"]] == [[2, 0]] * 2
    for pid, t in enumerate(two):
        assert [c[:2] for c in t["calls"]] == [[1, 2 * pid]] * 2
    for step in range(2):
        assert two[0]["calls"][step][2] + two[1]["calls"][step][2] == one["calls"][step][2]
    for t in two:  # every process ends with the same two steps and parameters as the one-process run
        assert [m["step"] for m in t["history"]] == [1, 2]
        for m1, m2 in zip(one["history"], t["history"]):
            assert m1["reward/mean"] == m2["reward/mean"]
            np.testing.assert_allclose(m2["actor/loss"], m1["actor/loss"], rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(m2["actor/grad_norm"], m1["actor/grad_norm"], rtol=1e-4)
        for k, v in one["params"].items():
            np.testing.assert_allclose(np.asarray(t["params"][k]), np.asarray(v), rtol=1e-5, atol=1e-6)
    run_dir = tmp_path / "two"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]  # written once (process 0), not twice
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]


def test_gather_rollout_rebuilds_rows_routing_and_finish_reasons():
    """One process: gather_rollout of a slice (first prompt 1 of 3) keeps every field, maps prompt_index into the
    step's prompt list, and slices the -1-padded prompt routing record back to each prompt's length."""
    from fp8rl_jax.rollout.types import RolloutBatch
    from fp8rl_jax.trainer.distributed import gather_rollout

    rng = np.random.default_rng(0)
    prompts = [[1, 2], [3, 4, 5, 6], [7]]
    n, t, layers, k = 2, 3, 2, 2
    local = RolloutBatch(prompt_token_ids=[prompts[1]] * n + [prompts[2]] * n,
                         response_token_ids=rng.integers(0, 50, (4, t)).astype(np.int32),
                         rollout_logprobs=rng.standard_normal((4, t)).astype(np.float32),
                         response_mask=np.ones((4, t), np.float32), finish_reason=["stop", "length", "length", "stop"],
                         prompt_index=np.array([0, 0, 1, 1], np.int32), weights_version=7,
                         routed_experts=rng.integers(0, 4, (4, t, layers, k)).astype(np.int32),
                         prompt_routed_experts=[rng.integers(0, 4, (len(p), layers, k)).astype(np.int32)
                                                for p in [prompts[1]] * n + [prompts[2]] * n])
    got = gather_rollout(local, prompts, first_prompt=1)
    assert got.prompt_token_ids == local.prompt_token_ids and got.finish_reason == local.finish_reason
    assert got.prompt_index.tolist() == [1, 1, 2, 2] and got.weights_version == 7
    for f in ("response_token_ids", "rollout_logprobs", "response_mask", "routed_experts"):
        np.testing.assert_array_equal(getattr(got, f), getattr(local, f))
        assert getattr(got, f).dtype == getattr(local, f).dtype
    for a, b in zip(got.prompt_routed_experts, local.prompt_routed_experts):
        np.testing.assert_array_equal(a, b)


if __name__ == "__main__":
    _child(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
