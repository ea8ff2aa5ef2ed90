#!/usr/bin/python3
"""Which decoder layers lose the most when rounded to 4 bits.

Runs the independent float32 reference of the language model
(tests/reference/text_ref.py) on a random prompt with the checkpoint's own
weights, then with the projections of one layer at a time (and of every
layer) replaced by their 4-bit round trip, and prints the logits cosine
against the unrounded run: the measurement behind the int4 form's int8
leading layers (services/language/model/decoder.h, kAutoInt4Int8Layers).

The 4-bit rule is the one kernels::QuantizeInt4 documents
(common/kernels/quantize_int4.h): asymmetric groups of 32 along K with the
range widened to include 0, 15 levels, round to nearest even. Written from
that description, not from the C++ code. (The f16 ratio under a per-row f32
scale changes the scale by under 0.05%, below this table's resolution.)

Usage: int4_layer_sensitivity.py --checkpoint DIR [--tokens 64]
           [--layers 0,1,2,3,14,27] [--first 2,4,8]
On the 2B shapes each forward takes a few seconds with OpenBLAS's AVX-512
kernels (OPENBLAS_CORETYPE=SkylakeX on an AVX-512 machine) and minutes with
its SSE fallback.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "tests", "reference"))
import st  # noqa: E402
import text_ref  # noqa: E402


def int4_round_trip(w, group=32):
    o, k = w.shape
    assert k % group == 0
    x = w.reshape(o, k // group, group)
    lo = x.min(-1, keepdim=True).values.clamp(max=0)
    hi = x.max(-1, keepdim=True).values.clamp(min=0)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    z = torch.round(-lo / safe).clamp(0, 15)
    q = (torch.round(x / safe) + z).clamp(0, 15)
    return torch.where(scale > 0, (q - z) * scale, torch.zeros_like(x)).reshape(o, k)


def int8_round_trip(w, group=32):
    o, k = w.shape
    x = w.reshape(o, k // group, group)
    scale = x.abs().max(-1, keepdim=True).values / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(x / safe).clamp(-127, 127) * scale).reshape(o, k)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--layers", default="", help="layers rounded alone (default: 0-3, middle, last)")
    ap.add_argument("--first", default="1,2,4", help="counts of leading int8 layers, rest int4")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = json.load(open(os.path.join(args.checkpoint, "config.json")))
    weights = {k: v.float() for k, v in st.read_checkpoint(args.checkpoint).items()
               if "visual" not in k}
    n_layers = cfg["text_config"]["num_hidden_layers"]
    projections = {}  # layer -> [names]
    for name in weights:
        if ".layers." in name and name.endswith("_proj.weight"):
            projections.setdefault(int(name.split(".layers.")[1].split(".")[0]), []).append(name)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(150000, cfg["text_config"]["vocab_size"]), (args.tokens,),
                        generator=gen).tolist()
    pos = torch.arange(args.tokens)[None].repeat(3, 1)

    def logits(w):
        return text_ref.forward(w, cfg, ids, None, [], pos, args.tokens)

    ref = logits(weights)
    four = {n: int4_round_trip(weights[n]) for l in projections for n in projections[l]}

    def row(label, rounded):
        w = dict(weights)
        w.update(rounded)
        out = logits(w)
        c = torch.nn.functional.cosine_similarity(out, ref, dim=-1)
        same = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"| {label} | {c.mean().item():.5f} | {1 - c.mean().item():.5f} | "
              f"{c.min().item():.5f} | {same:.3f} |", flush=True)

    print(f"{args.checkpoint}: {n_layers} layers, {args.tokens} random prompt tokens, logits "
          "against the unrounded float32 reference at every position\n")
    print("| rounded to 4 bits | cosine mean | 1 - cosine | cosine min | top-1 equal |")
    print("|---|---|---|---|---|")
    row("every layer", four)
    layers = ([int(x) for x in args.layers.split(",") if x] if args.layers
              else sorted({0, 1, 2, 3, n_layers // 2, n_layers - 1} & set(range(n_layers))))
    for l in layers:
        row(f"layer {l} alone", {n: four[n] for n in projections[l]})
    for k in [int(x) for x in args.first.split(",") if x]:
        mixed = dict(four)
        for l in range(min(k, n_layers)):
            for n in projections[l]:
                mixed[n] = int8_round_trip(weights[n])
        row(f"every layer, the first {k} int8", mixed)


if __name__ == "__main__":
    main()
