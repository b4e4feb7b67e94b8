"""Fidelity metrics of a decoded message against the original (numpy, float64 accumulation).

Definitions (x original, y decoded, sums over all elements of all messages given):
  SQNR (dB)           10·log10(Σ x² / Σ (y − x)²)          (∞ when exact)
  max relative error  max over messages of max|y − x| / max|x|  (relative to the message's absmax:
                      an element-wise ratio is unbounded near zero)
  cosine similarity   Σ x·y / (‖x‖·‖y‖)
"""

from __future__ import annotations

import numpy as np


def _pairs(x, y):
    xs = x if isinstance(x, list | tuple) else [x]
    ys = y if isinstance(y, list | tuple) else [y]
    return [(np.asarray(a, np.float64), np.asarray(b, np.float64)) for a, b in zip(xs, ys, strict=True)]


def sqnr_db(x, y) -> float:
    """Energy-weighted signal-to-quantization-noise ratio over one message or a list of them."""
    sig = noise = 0.0
    for a, b in _pairs(x, y):
        sig += float(np.sum(a * a))
        noise += float(np.sum((b - a) ** 2))
    return db_from_powers(sig, noise)


def db_from_powers(signal: float, noise: float) -> float:
    """10·log10(signal / noise) of summed powers Σx², Σ(y − x)²: ∞ when noise is 0, −∞ when only the
    signal is 0, NaN when either is NaN."""
    if np.isnan(signal) or np.isnan(noise):
        return float("nan")
    if noise == 0.0:
        return float("inf")
    return float(10 * np.log10(signal / noise)) if signal > 0 else float("-inf")


def max_rel_error(x, y) -> float:
    """max over messages of ‖y − x‖∞ / ‖x‖∞ (messages that are all zero count if y is not)."""
    worst = 0.0
    for a, b in _pairs(x, y):
        m = float(np.max(np.abs(a))) if a.size else 0.0
        e = float(np.max(np.abs(b - a))) if a.size else 0.0
        worst = max(worst, e / m if m > 0 else (0.0 if e == 0 else float("inf")))
    return worst


def cosine(x, y) -> float:
    """Cosine similarity of the concatenated messages."""
    dot = nx = ny = 0.0
    for a, b in _pairs(x, y):
        dot += float(np.sum(a * b))
        nx += float(np.sum(a * a))
        ny += float(np.sum(b * b))
    return dot / np.sqrt(nx * ny) if nx > 0 and ny > 0 else float(nx == ny)
