"""HF export of a run checkpoint (bf16 and FP8 blockwise), reloaded by ``transformers`` (and vLLM's FP8 config).

References: ``transformers`` ``AutoModelForCausalLM`` on the exported directory (for FP8: its own
``FineGrainedFP8Config(dequantize=True)`` loader), vLLM's ``Fp8Config.from_config`` for the
``quantization_config`` keys, and a float64 numpy blockwise dequantization written here.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import make_tiny_run_dir
from fp8rl_jax.models.hf_io import load_hf_dir
from fp8rl_jax.models.loading import build_model, load_checkpoint
from fp8rl_jax.trainer.checkpoint import CheckpointStore, model_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory whose checkpoint holds 'trained' (perturbed) params of a tiny Qwen2 (q/k/v bias, untied).

    Linear dims are multiples of 128: transformers' FP8 dequantizer rejects ragged scale grids (vLLM pads them).
    """
    base = tmp_path_factory.mktemp("hf_export")
    tiny = make_tiny_run_dir(base / "tiny", "qwen2", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                             num_key_value_heads=4, head_dim=32)
    cfg, params = load_checkpoint(tiny)
    rng = np.random.default_rng(0)
    trained = {k: np.asarray(v, np.float32) + rng.normal(0, 0.02, np.shape(v)).astype(np.float32)
               for k, v in params.items()}
    model = build_model(cfg, trained)
    store = CheckpointStore(str(base / "run" / "checkpoints"), async_save=False)
    store.save(7, {"params": model_state(model), "optimizer": {"step": np.int32(7)}}, {"model": tiny, "rl_step": 7})
    store.close()
    return base / "run", cfg, trained


def _export(run, out, fmt):
    import sys

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import export_hf

    assert export_hf.main([f"--run_dir={run}", f"--output={out}", f"--format={fmt}"]) == 0


def _dequant64(q, s, bs=128):
    """float64 blockwise dequantization: W[n, k] = q[n, k] * s[n // bs, k // bs]."""
    q = np.asarray(q.astype(np.float32), np.float64)
    return q * np.repeat(np.repeat(np.asarray(s, np.float64), bs, 0), bs, 1)[:q.shape[0], :q.shape[1]]


def _logits_ours(cfg, params, ids):
    import jax.numpy as jnp

    m = build_model(cfg, {k: np.asarray(v, np.float32) for k, v in params.items()})
    return np.asarray(m(jnp.asarray(ids)))


def test_bf16_export_reloads_in_transformers_with_equal_logits(run_dir, tmp_path):
    import ml_dtypes
    import torch
    import transformers

    run, cfg, trained = run_dir
    out = tmp_path / "bf16"
    _export(run, out, "bf16")
    conf = json.loads((out / "config.json").read_text())
    assert conf["torch_dtype"] == "bfloat16" and "quantization_config" not in conf
    assert (out / "tokenizer.json").exists()
    _, got, _ = load_hf_dir(str(out))
    assert set(got) == set(trained)
    for k, v in trained.items():  # exactly the bf16 rounding of the checkpoint's float32 params
        assert got[k].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(got[k], v.astype(ml_dtypes.bfloat16), err_msg=k)
    ids = np.random.default_rng(1).integers(3, 300, (2, 11)).astype(np.int32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    ours = _logits_ours(cfg, got, ids)
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=1e-4)
    # and the export is the trained model up to bf16 weight rounding
    np.testing.assert_allclose(_logits_ours(cfg, trained, ids), ref, atol=5e-2)


def test_fp8_export_loads_in_transformers_and_vllm_config(run_dir, tmp_path):
    import torch
    import transformers
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    run, cfg, trained = run_dir
    out = tmp_path / "fp8"
    _export(run, out, "fp8")
    conf = json.loads((out / "config.json").read_text())
    q = conf["quantization_config"]
    assert q == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    vq = Fp8Config.from_config(q)  # vLLM's own parser of this block
    assert vq.is_checkpoint_fp8_serialized and vq.activation_scheme == "dynamic" and vq.weight_block_size == [128, 128]
    _, got, _ = load_hf_dir(str(out))
    name = "model.layers.1.mlp.down_proj.weight"  # [128, 256]: 1x2 blocks
    assert str(got[name].dtype) == "float8_e4m3fn" and got[name + "_scale_inv"].shape == (1, 2)
    assert str(got["model.embed_tokens.weight"].dtype) == "bfloat16" and "lm_head.weight_scale_inv" not in got
    deq = {}
    for k, v in got.items():
        if k.endswith("_scale_inv"):
            continue
        deq[k] = _dequant64(v, got[k + "_scale_inv"]) if k + "_scale_inv" in got else np.asarray(v, np.float64)
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the block's max
        tol = 2.0**-4 * np.abs(trained[k]).max() + 1e-6 if k + "_scale_inv" in got else 1e-2
        np.testing.assert_allclose(deq[k], trained[k], atol=tol, err_msg=k)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), quantization_config=transformers.FineGrainedFP8Config(dequantize=True), dtype=torch.float32).eval()
    sd = hf.state_dict()
    np.testing.assert_allclose(sd[name].numpy(), deq[name], rtol=1e-6, atol=1e-7)
    ids = np.random.default_rng(2).integers(3, 300, (2, 9)).astype(np.int32)
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(_logits_ours(cfg, deq, ids), ref, atol=2e-4, rtol=1e-4)


def test_export_errors_are_clear(run_dir, tmp_path, capsys):
    import sys

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import export_hf

    assert export_hf.main([f"--run_dir={tmp_path / 'nope'}", f"--output={tmp_path / 'o'}"]) == 2
    assert "checkpoint directory not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert export_hf.main([f"--run_dir={tmp_path / 'empty'}", f"--output={tmp_path / 'o'}"]) == 2
    assert "no checkpoint in" in capsys.readouterr().err
    run, _, _ = run_dir
    assert export_hf.main([f"--run_dir={run}", f"--output={tmp_path / 'o'}", "--step=3"]) == 2
    assert "holds steps [7]" in capsys.readouterr().err
    from fp8rl_jax.trainer.hf_export import export_hf_dir

    with pytest.raises(ValueError, match="fp4"):
        export_hf_dir(str(tmp_path / "o"), run_dir[1], run_dir[2], fmt="fp4")
