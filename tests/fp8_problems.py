"""A smooth test problem for FP8 gradient checks, shared by the dot_general and training tests.

``loss(x, w) = sum(tanh(x @ w) * c)`` with float64 reference gradients written out by hand.
"""

from __future__ import annotations

import numpy as np


def smooth_problem(seed, m=6, k=200, n=70):
    """Random ``x [m, k]``, ``w [k, n]`` (scaled so ``x @ w ~ N(0, 1)``) and ``c [m, n]``, float32."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)  # y ~ N(0, 1): tanh not saturated
    c = rng.standard_normal((m, n)).astype(np.float32)
    return x, w, c


def loss64_and_grads(x, w, c):
    """The float64 loss function and its exact gradients ``dL/dx = g w^T``, ``dL/dw = x^T g``."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    g = (1 - np.tanh(x64 @ w64) ** 2) * c
    return (lambda x, w: np.sum(np.tanh(x @ w) * c)), g @ w64.T, x64.T @ g
