"""Issue 37's layout: each timed kernel module has a ``main`` (``python -m fp8rl_jax.kernels.<module>``) that times
it against XLA's path at the Qwen3 shapes on a GPU. Here each ``main`` runs its ``--smoke`` case (a tiny shape in
the kernel's interpreter on the CPU) so that the ``main`` functions keep working between GPU runs; the table must
hold one row per case with positive times and the kernel's name on the title line. The kernels' numerics are tested
against float64 references elsewhere (tests/test_mosaic_gemm.py, tests/test_decode_gemm_mgpu.py,
tests/test_fp8_pallas.py, tests/test_fp8_attention_kernel.py, tests/test_grouped_matmul.py); the timings themselves
mean something only on the GPU."""

from __future__ import annotations

import importlib
import re

import pytest

from fp8rl_jax.kernels import timing

MAINS = {"mosaic_gemm": ("W8A8 Mosaic GPU GEMM", 1), "decode_gemm_mgpu": ("FP8 swap-AB decode GEMM", 1),
         "pallas_quant": ("FP8 quantization kernels", 2), "pallas_attention": ("FP8 KV decode attention", 1),
         "pallas_grouped": ("Grouped W8A8 expert GEMM", 1)}


@pytest.mark.parametrize("module", sorted(MAINS))
def test_kernel_main_smoke_prints_its_table(module, capsys):
    title, n_rows = MAINS[module]
    importlib.import_module(f"fp8rl_jax.kernels.{module}").main(["--smoke"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith(title), lines[0]
    header = re.split(r"\s{2,}", lines[1].strip())  # print_table joins right-justified cells with two spaces
    rows = [re.split(r"\s{2,}", ln.strip()) for ln in lines[2:]]
    assert len(rows) == n_rows and all(len(r) == len(header) for r in rows), lines
    us_cols = [i for i, h in enumerate(header) if h.endswith(" us")]
    assert len(us_cols) >= 2, header  # the kernel and XLA's path
    for row in rows:
        assert all(float(row[i]) > 0 for i in us_cols), row


def test_per_call_us_refuses_no_iterations():
    with pytest.raises(ValueError, match="iters must be >= 1"):
        timing.per_call_us(lambda x: x, (1.0,), iters=0)
