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


def _make_run(base, arch, **kw):
    """A run directory (``base/run``) whose checkpoint holds 'trained' (perturbed) params of a tiny ``arch``."""
    tiny = make_tiny_run_dir(base / "tiny", arch, **kw)
    cfg, params = load_checkpoint(tiny)
    rng = np.random.default_rng(0)
    trained = {k: np.asarray(v, np.float32) + rng.normal(0, 0.02, np.shape(v)).astype(np.float32)
               for k, v in params.items()}
    model = build_model(cfg, trained)
    store = CheckpointStore(str(base / "run" / "checkpoints"), async_save=False)
    store.save(7, {"params": model_state(model), "optimizer": {"step": np.int32(7)}}, {"model": tiny, "rl_step": 7})
    store.close()
    return base / "run", cfg, trained


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run of a tiny Qwen2 (q/k/v bias, untied) whose linear dims are all multiples of 128: every linear FP8."""
    return _make_run(tmp_path_factory.mktemp("hf_export"), "qwen2", hidden_size=128, intermediate_size=256,
                     num_attention_heads=4, num_key_value_heads=4, head_dim=32)


@pytest.fixture(scope="module")
def ragged_run(tmp_path_factory):
    """A run of a tiny tied Llama with SmolLM2's kinds of ragged shapes (2 layers, hidden 128, 4x96 heads, 2 KV):

    q_proj [384, 128] aligned but fused with k/v_proj [192, 128] (SmolLM2's 192-row k_proj; transformers would
    read it with 96-row blocks, vLLM's qkv_proj cannot place it); gate/up_proj [320, 128] (both loaders);
    down_proj [128, 320] (transformers only: ``Weight shape (128, 320) not divisible by scale grid (1, 3)``);
    o_proj [128, 384] loadable: the only FP8 linear.
    """
    return _make_run(tmp_path_factory.mktemp("hf_export_ragged"), "llama", tie=True, hidden_size=128,
                     intermediate_size=320, num_attention_heads=4, num_key_value_heads=2, head_dim=96)


def _export(run, out, fmt):
    import sys

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import export_hf

    old = os.umask(0o022)  # a user's usual umask: files come out 0644
    try:
        assert export_hf.main([f"--run_dir={run}", f"--output={out}", f"--format={fmt}"]) == 0
    finally:
        os.umask(old)


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
    # every linear is 128-aligned: only lm_head is listed (an explicit list replaces transformers' default skip)
    assert q == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                 "modules_to_not_convert": ["lm_head"], "ignored_layers": ["lm_head"]}
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


def _safetensors_header(path):
    """The JSON header of a safetensors file (``__metadata__`` included), parsed by hand."""
    import struct

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


_RAGGED_BF16 = [f"model.layers.{i}.{m}" for i in range(2) for m in
                ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.q_proj",
                 "self_attn.v_proj")]


def test_fp8_export_of_ragged_model_keeps_unloadable_layers_bf16_and_loads_in_transformers(ragged_run, tmp_path,
                                                                                          capsys):
    """Issue 17 item 3: SmolLM2-like shapes. The layers neither loader can read as 128x128 blockwise FP8 are bf16,
    listed under both loaders' keys, named in one printed line; transformers loads and generates from the
    directory with no extra arguments, and its logits match our dequantized weights."""
    import torch
    import transformers

    from fp8rl_jax.export import is_quantized_linear

    run, cfg, trained = ragged_run
    out = tmp_path / "fp8"
    _export(run, out, "fp8")
    lines = capsys.readouterr().out.strip().splitlines()
    # (e) one line naming the bf16 layers and why, then the usual "wrote" line
    assert len(lines) == 2 and lines[1].startswith("wrote fp8 HF directory"), lines
    line = lines[0]
    assert line.startswith("fp8 export: kept 12 of 14 linear weights in bf16 so that transformers and vLLM load")
    for part in ("modules_to_not_convert and ignored_layers",
                 "self_attn.k_proj, self_attn.v_proj in layers 0-1 (transformers: dim 192 is neither a multiple of "
                 "128 nor <= 128; vLLM: 192 rows, a qkv_proj shard needs a multiple of 128)",
                 "self_attn.q_proj in layers 0-1 (vLLM fuses it with k_proj, v_proj into qkv_proj",
                 "mlp.down_proj in layers 0-1 (transformers: dim 320 is neither a multiple of 128 nor <= 128)",
                 "mlp.gate_proj, mlp.up_proj in layers 0-1 (transformers: dim 320"):
        assert part in line, (part, line)
    assert "o_proj" not in line

    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["modules_to_not_convert"] == q["ignored_layers"] == ["lm_head"] + _RAGGED_BF16

    # (b) listed layers are bf16 without scales; the others e4m3 with ceil-grid weight_scale_inv
    _, got, _ = load_hf_dir(str(out))
    deq = {}
    for k, v in trained.items():
        module = k[:-len(".weight")]
        if k.endswith("o_proj.weight"):
            assert str(got[k].dtype) == "float8_e4m3fn", k
            assert got[k + "_scale_inv"].dtype == np.float32 and got[k + "_scale_inv"].shape == (1, 3), k
            deq[k] = _dequant64(got[k], got[k + "_scale_inv"])
            np.testing.assert_allclose(deq[k], v, atol=2.0**-4 * np.abs(v).max(), err_msg=k)
        else:
            assert str(got[k].dtype) == "bfloat16" and k + "_scale_inv" not in got, k
            assert (module in q["modules_to_not_convert"]) == is_quantized_linear(k), k
            deq[k] = np.asarray(got[k], np.float64)
    assert set(got) == set(trained) | {f"model.layers.{i}.self_attn.o_proj.weight_scale_inv" for i in range(2)}

    # (d) safetensors as `safetensors.torch.save_file` writes it: metadata format pt, mode 0644 under umask 022
    st = out / "model.safetensors"
    assert _safetensors_header(st)["__metadata__"] == {"format": "pt"}
    assert oct(os.stat(st).st_mode & 0o777) == oct(0o644)

    # (a) transformers with no quantization argument (on CPU it dequantizes FP8 by itself), float32 so the
    # comparison is not blurred by bf16 activations
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    hf.eval()
    sd = hf.state_dict()
    for k in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        # FP8: q * s formed in float32 (one rounding of the exact product); bf16: exact upcast
        np.testing.assert_allclose(sd[k].numpy(), deq[k], rtol=2.0**-23, atol=0, err_msg=k)
    ids = np.random.default_rng(2).integers(3, 300, (2, 9)).astype(np.int32)
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    ours = _logits_ours(cfg, deq, ids)
    # same weights, both float32: only summation order differs (2 layers, K <= 384; logits ~O(1))
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=1e-4)
    with torch.no_grad():
        gen = hf.generate(torch.as_tensor(ids, dtype=torch.long), max_new_tokens=4, do_sample=False,
                          pad_token_id=0).numpy()
    assert gen.shape == (2, 13) and (gen[:, :9] == ids).all()
    np.testing.assert_array_equal(gen[:, 9], ours[:, -1].argmax(-1))  # greedy step 1 agrees with our logits


def test_fp8_export_loads_with_transformers_defaults_and_generates(ragged_run, tmp_path):
    """The README's command, then `AutoModelForCausalLM.from_pretrained(dir)` with nothing else (bf16, the config's
    dtype) and `generate`, in a subprocess: bf16 GEMMs run there under ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 (the
    pytest process never runs a bf16 torch matmul: oneDNN's AMX kernel dies with SIGILL on this CPU)."""
    import subprocess
    import sys

    run, _, _ = ragged_run
    out = tmp_path / "fp8"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "export_hf.py"), f"--run_dir={run}",
                        "--format=fp8", f"--output={out}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [ln.split(":")[0] for ln in r.stdout.strip().splitlines()] == ["fp8 export", f"wrote fp8 HF directory {out}"]
    code = ("import sys, torch, transformers\n"
            "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
            "ids = torch.tensor([[5, 17, 42, 7]])\n"
            "with torch.no_grad():\n"
            "    g = m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)\n"
            "print(m.dtype, g.shape[1] - ids.shape[1], type(m.model.layers[0].self_attn.o_proj).__name__)\n")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16", HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["torch.bfloat16", "5", "Linear"]  # dequantized on CPU, 5 new tokens


def test_fp8_export_without_fallback_is_what_transformers_rejected(ragged_run, tmp_path, caplog):
    """Control: the same model with every linear FP8 (the old export). transformers refuses it (its load report
    names ``Weight shape (320, 128) not divisible by scale grid (3, 1)``, then ``RuntimeError``), and its
    dequantizer would read the 192-row k_proj with 96-row blocks (no error, wrong values). The fallback is what
    makes the directory load."""
    import torch
    import transformers
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from fp8rl_jax.export import export_weights
    from fp8rl_jax.models.hf_io import save_hf_dir
    from fp8rl_jax.trainer.hf_export import fp8_quantization_config

    _, cfg, trained = ragged_run
    w = {k: np.asarray(v) for k, v in export_weights(trained, "fp8_blockwise").tensors.items()}
    save_hf_dir(str(tmp_path / "old"), cfg, w,
                extra_config={"torch_dtype": "bfloat16", "quantization_config": fp8_quantization_config()})
    with pytest.raises(RuntimeError, match="automatic conversion of the weights"):
        transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "old"), dtype=torch.float32)
    assert "not divisible by scale grid (3, 1)" in caplog.text  # transformers' load report (a warning)
    k = "model.layers.0.self_attn.k_proj.weight"
    assert w[k].shape == (192, 128) and w[k + "_scale_inv"].shape == (2, 1)
    q8 = torch.from_numpy(w[k].view(np.uint8).copy()).view(torch.float8_e4m3fn)
    mis = Fp8Dequantize(None)._dequantize_one(q8, torch.from_numpy(w[k + "_scale_inv"].copy()), torch.float32).numpy()
    right = _dequant64(w[k], w[k + "_scale_inv"])
    np.testing.assert_allclose(mis[:96], right[:96], rtol=1e-6)
    s0, s1 = w[k + "_scale_inv"][:, 0]
    np.testing.assert_allclose(mis[96:128], right[96:128] * (s1 / s0), rtol=1e-6)  # block 1's scale on rows 96-127


def test_vllm_and_transformers_skip_exactly_the_bf16_layers(ragged_run, tmp_path):
    """(c) vLLM's own `Fp8Config.from_config` + `is_layer_skipped` (per fused layer, as `get_quant_method` calls it)
    and transformers' own FP8 module replacement (the GPU path, run on the meta device) skip exactly the layers
    stored bf16, and give the FP8 ones the file's scale grid."""
    import torch
    import transformers
    from transformers.integrations.finegrained_fp8 import FP8Linear, replace_with_fp8_linear
    from transformers.quantizers.auto import AutoHfQuantizer
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
    from vllm.model_executor.models.llama import LlamaForCausalLM

    run, cfg, _ = ragged_run
    out = tmp_path / "fp8"
    _export(run, out, "fp8")
    conf = json.loads((out / "config.json").read_text())
    q = conf["quantization_config"]
    _, got, _ = load_hf_dir(str(out))

    vq = Fp8Config.from_config(q)
    vq.apply_vllm_mapper(LlamaForCausalLM.hf_to_vllm_mapper)
    fused = LlamaForCausalLM.packed_modules_mapping
    for i in range(cfg.num_hidden_layers):
        for layer, shards in (("self_attn.qkv_proj", ["q_proj", "k_proj", "v_proj"]), ("self_attn.o_proj", None),
                              ("mlp.gate_up_proj", ["gate_proj", "up_proj"]), ("mlp.down_proj", None)):
            prefix = f"model.layers.{i}.{layer}"
            parent = prefix.rsplit(".", 1)[0]
            names = [f"{parent}.{s}.weight" for s in shards] if shards else [prefix + ".weight"]
            in_file_bf16 = {str(got[n].dtype) == "bfloat16" for n in names}
            assert len(in_file_bf16) == 1, prefix  # a fused group is all FP8 or all bf16
            assert is_layer_skipped(prefix, vq.ignored_layers, fused, match_mode=vq.ignored_layers_match_mode) \
                == in_file_bf16.pop(), prefix
    # a list that split a fused group would be refused by vLLM: the closure is needed
    with pytest.raises(ValueError, match="some but not all shards"):
        is_layer_skipped("model.layers.0.self_attn.qkv_proj", ["model.layers.0.self_attn.k_proj"], fused)

    # transformers' replacement of nn.Linear by FP8Linear (what it does with a GPU, dequantize=False)
    hq = AutoHfQuantizer.from_config(dict(q), pre_quantized=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(out)))
    skip = hq.get_modules_to_not_convert(model, hq.quantization_config.modules_to_not_convert,
                                         model._keep_in_fp32_modules)
    assert hq.quantization_config.dequantize is False
    replace_with_fp8_linear(model, modules_to_not_convert=skip, quantization_config=hq.quantization_config,
                            pre_quantized=True)
    fp8_modules = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert set(fp8_modules) == {k[:-len(".weight_scale_inv")] for k in got if k.endswith("_scale_inv")}
    for n, m in fp8_modules.items():
        assert tuple(m.weight_scale_inv.shape) == got[n + ".weight_scale_inv"].shape, n
    assert not isinstance(model.lm_head, FP8Linear)


def test_fp8_layer_rule_on_real_architectures(tmp_path):
    """SmolLM2-135M (the README's model): every linear has a 576 (or 192-row) dim, so all 210 stay bf16 and the
    line says why; Qwen3-0.6B-like shapes keep everything FP8; a MoE layer's experts go together. The vLLM rule is
    the one the rollout bridge uses (`rollout_bridge.vllm_engine.fp8_block_alignment_problems`)."""
    import dataclasses

    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    import rollout_bridge.vllm_engine as ve
    from fp8rl_jax import export
    from fp8rl_jax.models.config import ModelConfig, hf_param_shapes
    from fp8rl_jax.trainer.hf_export import bf16_fallback_summary

    assert ve.fp8_block_alignment_problems is export.fp8_block_alignment_problems
    smol = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                       eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    shapes = hf_param_shapes(smol)
    kept = export.fp8_unloadable_linears(shapes)
    assert len(kept) == 210 == sum(map(export.is_quantized_linear, shapes))
    line = bf16_fallback_summary(kept, 210, 210)
    assert "\n" not in line and "kept 210 of 210" in line and "in layers 0-29" in line
    assert "dim 576 is neither a multiple of 128" in line and "192 rows, a qkv_proj shard" in line
    assert export.fp8_block_alignment_problems(smol) == [
        "q_proj has 576 output rows, not a multiple of 128", "k_proj has 192 output rows, not a multiple of 128",
        "v_proj has 192 output rows, not a multiple of 128"]

    qwen3 = dataclasses.replace(smol, model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                                num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_hidden_layers=2)
    assert export.fp8_unloadable_linears(hf_param_shapes(qwen3)) == {}

    moe = dataclasses.replace(qwen3, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=(1,))
    kept = export.fp8_unloadable_linears(hf_param_shapes(moe))
    assert list(kept) == ["model.layers.0.mlp.experts"]  # layer 1 is dense (3072): FP8
    assert "96 rows, a gate_up_proj shard" in kept["model.layers.0.mlp.experts"]
    assert is_layer_skipped("model.layers.0.mlp.experts", list(kept))  # vLLM's FusedMoE rule
    assert not is_layer_skipped("model.layers.1.mlp.experts", list(kept))
    w = export.export_weights({k: np.ones(s, np.float32) for k, s in hf_param_shapes(moe).items()},
                              "fp8_blockwise", unquantized=tuple(kept)).tensors
    assert str(w["model.layers.0.mlp.experts.3.down_proj.weight"].dtype) == "bfloat16"
    assert "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv" not in w
    assert str(w["model.layers.1.mlp.down_proj.weight"].dtype) == "float8_e4m3fn"


def test_safetensors_files_respect_umask(tmp_path):
    """(d) a restrictive umask still applies: 0027 gives 0640 (the writer's own 0600 is not kept either way)."""
    from fp8rl_jax.models.config import ModelConfig
    from fp8rl_jax.models.hf_io import save_hf_dir

    cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=4, eos_token_id=1, pad_token_id=0)
    old = os.umask(0o027)
    try:
        save_hf_dir(str(tmp_path / "a"), cfg, {"x": np.ones((2, 2), np.float32)})
        save_hf_dir(str(tmp_path / "b"), cfg, {"x": np.ones((64, 2), np.float32), "y": np.ones((64, 2), np.float32)},
                    max_shard_bytes=600)
    finally:
        os.umask(old)
    files = [tmp_path / "a" / "model.safetensors"] + sorted((tmp_path / "b").glob("*.safetensors"))
    assert len(files) == 3
    for f in files:
        assert os.stat(f).st_mode & 0o777 == 0o640, f
        assert _safetensors_header(f)["__metadata__"] == {"format": "pt"}
