#!/usr/bin/python3
"""Fidelity of 4-bit group-quantized weight variants (common/kernels/quantize_int4.h).

For each variant: relative RMS error of the dequantized weight, and cosine /
max relative error of y = W·x against the exact product, on gaussian weights
and on heavy-tailed ones (Student t, 3 degrees of freedom, plus a few large
outlier columns), with activations that have outlier channels like a
decoder's hidden state. Variants: symmetric (q in [-8, 7], scale = the
group's signed extreme / -8, or |max| / 7 with q in [-7, 7]) or asymmetric
(min/max with a 4-bit zero point), groups of 32 / 64 / 128, scales in f16
(relative to a per-row f32 scale, as the int8 weights do) or bf16.

Usage: scripts/bench/int4_fidelity.py [--n 1024] [--k 2048] [--seed 1]
"""
import argparse

import numpy as np


def to_bf16(a):
    b = np.asarray(a, dtype=np.float32).view(np.uint32)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return b.view(np.float32)


def round_scale(s, row_scale, kind):
    if kind == "f16":
        return row_scale * (s / row_scale).astype(np.float16).astype(np.float32)
    return to_bf16(s)


def quantize(w, group, mode, scale_kind):
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    row_amax = np.abs(w).max(axis=1, keepdims=True)[:, :, None]
    row_amax = np.where(row_amax > 0, row_amax, 1.0).astype(np.float32)
    if mode == "sym8":  # q in [-8, 7], the signed extreme maps to -8
        idx = np.abs(g).argmax(axis=2)[:, :, None]
        ext = np.take_along_axis(g, idx, axis=2)
        s = round_scale(-ext / 8.0, row_amax, scale_kind)
        inv = np.where(s != 0, 1.0 / np.where(s != 0, s, 1), 0)
        q = np.clip(np.rint(g * inv), -8, 7)
        return (q * s).reshape(n, k)
    if mode == "sym7":  # q in [-7, 7]
        s = round_scale(np.abs(g).max(axis=2, keepdims=True) / 7.0, row_amax, scale_kind)
        inv = np.where(s > 0, 1.0 / np.where(s > 0, s, 1), 0)
        q = np.clip(np.rint(g * inv), -7, 7)
        return (q * s).reshape(n, k)
    # asym: w ≈ s·(u - z), u in [0, 15], z in [0, 15]
    lo = np.minimum(g.min(axis=2, keepdims=True), 0)
    hi = np.maximum(g.max(axis=2, keepdims=True), 0)
    s = round_scale((hi - lo) / 15.0, row_amax, scale_kind)
    inv = np.where(s > 0, 1.0 / np.where(s > 0, s, 1), 0)
    z = np.clip(np.rint(-lo * inv), 0, 15)
    u = np.clip(np.rint(g * inv) + z, 0, 15)
    return ((u - z) * s).reshape(n, k)


def bytes_per_weight(group, mode):
    return 0.5 + 2.0 / group + (1.0 / group if mode == "asym" else 0)  # u8 zero points


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    gauss = (rng.standard_normal((a.n, a.k)) * 0.02).astype(np.float32)
    heavy = (rng.standard_t(3, (a.n, a.k)) * 0.02).astype(np.float32)
    heavy[:, rng.choice(a.k, 8, replace=False)] *= 10
    x = rng.standard_normal((16, a.k)).astype(np.float32)
    x[:, rng.choice(a.k, 4, replace=False)] *= 20  # outlier channels
    print(f"{'weights':8} {'variant':6} {'group':>5} {'scale':>5} {'B/w':>6} {'w relRMS':>9} "
          f"{'y cosine':>9} {'y max rel':>9}")
    for name, w in (("gaussian", gauss), ("heavy", heavy)):
        w = to_bf16(w)
        y = x @ w.T
        for mode in ("sym8", "sym7", "asym"):
            for group in (32, 64, 128):
                for sk in ("f16", "bf16"):
                    d = quantize(w, group, mode, sk)
                    yq = x @ d.T
                    rel = np.sqrt(((d - w) ** 2).mean() / (w ** 2).mean())
                    cos = np.mean(np.sum(y * yq, 1) / np.linalg.norm(y, axis=1) / np.linalg.norm(yq, axis=1))
                    mx = np.abs(yq - y).max() / np.abs(y).max()
                    print(f"{name:8} {mode:6} {group:5} {sk:>5} {bytes_per_weight(group, mode):6.4f} "
                          f"{rel:9.5f} {cos:9.6f} {mx:9.5f}")


if __name__ == "__main__":
    main()
