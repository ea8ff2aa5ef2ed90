#!/usr/bin/python3
"""Where the int8 decoder loses fidelity: each error source alone, simulated in torch.

Runs the Qwen3 text decoder (docs/qwen3-vl-model.md §5, text only, no KV cache) over one
teacher-forced token sequence, once per variant of its linear layers, and prints the logits
cosine of each variant against the bf16 path (bf16 weights, bf16 activations between steps,
f32 sums), the quantity `vlm-bench-decoder --fidelity` and decoder_kernels_test measure on the
C++ decoder. Variants separate:
  - weight quantization alone (exact activations): int8 per output channel, or per group of
    32/64/128 along K (one scale per group and channel, like llama.cpp's Q8_0);
  - activation quantization alone (exact weights): int8 per block of 32 (what GemvInt8 did),
    int16 per block of 32/256 or per row;
  - their combinations, and the LM head quantized per channel;
  - with --per_projection: int8 per group of 32 on one projection kind at a time (q, k, v, o,
    gate, up, down; the others bf16), then on all of them, to see whether one kind dominates.
Quantization is symmetric round-to-nearest with scale max|v| / (2^(b-1) - 1), as
common/kernels/quantize.cc and gemv_int8.cc compute it.

Usage: int8_fidelity.py --checkpoint DIR [--tokens 48] [--seed 5] [--variants a,b,...]
       [--per_projection]
The checkpoint is memory-mapped (the 2B one is 4.3 GB; peak RSS stays around one layer in f32
plus the LM head).
"""
import argparse
import json
import mmap
import os
import struct
import sys

import torch

_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}


def open_checkpoint(path):
    """{name: tensor view over a read-only mmap} of model.safetensors (single file)."""
    f = open(os.path.join(path, "model.safetensors"), "rb")
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    (n,) = struct.unpack("<Q", mm[:8])
    header = json.loads(mm[8:8 + n].decode("utf-8"))
    header.pop("__metadata__", None)
    base = 8 + n
    out = {}
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer over a read-only buffer: never written
        for name, info in header.items():
            begin, end = info["data_offsets"]
            dt = _DTYPES[info["dtype"]]
            count = (end - begin) // torch.tensor([], dtype=dt).element_size()
            out[name] = torch.frombuffer(mm, dtype=dt, count=count, offset=base + begin).reshape(
                info["shape"])
    return out


def bf16(t):
    return t.to(torch.bfloat16).float()


def quant_rows(v, bits, group):
    """v [..., K] f32 quantized symmetric per `group` along K (0: the whole row), dequantized."""
    lim = 2 ** (bits - 1) - 1
    k = v.shape[-1]
    g = k if group == 0 else group
    pad = (-k) % g
    vp = torch.nn.functional.pad(v, (0, pad)) if pad else v
    blocks = vp.reshape(*vp.shape[:-1], -1, g)
    d = blocks.abs().amax(-1, keepdim=True) / lim
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.round(blocks * inv), -lim, lim)
    return (q * d).reshape(vp.shape)[..., :k]


# variant -> (weight quantization (bits, group) or None, activation quantization or None,
#             LM head quantization or None)
VARIANTS = {
    "w8ch": ((8, 0), None, None),
    "w8g128": ((8, 128), None, None),
    "w8g64": ((8, 64), None, None),
    "w8g32": ((8, 32), None, None),
    "a8b32": (None, (8, 32), None),
    "a16b32": (None, (16, 32), None),
    "a16b256": (None, (16, 256), None),
    "a16row": (None, (16, 0), None),
    "w8ch_a8b32": ((8, 0), (8, 32), None),       # GemvInt8 before this study
    "w8ch_a16b32": ((8, 0), (16, 32), None),
    "w8ch_a16b256": ((8, 0), (16, 256), None),
    "w8ch_a16row": ((8, 0), (16, 0), None),
    "w8g32_a8b32": ((8, 32), (8, 32), None),
    "w8g128_a16b128": ((8, 128), (16, 128), None),
    "w8g64_a16b64": ((8, 64), (16, 64), None),
    "w8g32_a16b32": ((8, 32), (16, 32), None),
    "w8g128_a16b128_head8g128": ((8, 128), (16, 128), (8, 128)),
    "head8ch": (None, None, (8, 0)),
}


def make_linear(weights, wq, aq, only=None):
    """only: quantize the weights only of projections whose name contains it."""
    cache = {}

    def weight(name):
        w = weights[name].float()
        if wq is None or (only is not None and only not in name):
            return w
        if name not in cache:
            cache.clear()  # one weight at a time: bounded memory
            cache[name] = quant_rows(w, *wq)
        return cache[name]

    def linear(x, name):
        # x: [S, K] (bf16 values) -> [S, N] rounded to bf16, as the C++ kernels store it
        xin = quant_rows(x, *aq) if aq is not None else x
        return bf16(xin @ weight(name).T)

    return linear


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def forward(weights, tc, prefix, ids, linear, head):
    """logits [S, vocab] f32 of a text sequence; activations kept in bf16 between steps."""
    eps = tc["rms_norm_eps"]
    nh, nkv, d = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    theta = tc.get("rope_theta") or tc["rope_parameters"]["rope_theta"]
    s = len(ids)
    W = lambda n: weights[prefix + n].float()  # noqa: E731
    x = weights[prefix + "embed_tokens.weight"][torch.tensor(ids)].float()
    # text positions: all three MRoPE sections equal, so plain 1-D RoPE
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(s).float()[:, None] * inv[None, :]
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    mask = torch.full((s, s), float("-inf")).triu(1)
    for layer in range(tc["num_hidden_layers"]):
        L = prefix + "layers.%d." % layer
        h = bf16(rms_norm(x, W("layers.%d.input_layernorm.weight" % layer), eps))
        q = linear(h, L + "self_attn.q_proj.weight").view(s, nh, d)
        k = linear(h, L + "self_attn.k_proj.weight").view(s, nkv, d)
        v = linear(h, L + "self_attn.v_proj.weight").view(s, nkv, d)
        q = rms_norm(q, W("layers.%d.self_attn.q_norm.weight" % layer), eps)
        k = rms_norm(k, W("layers.%d.self_attn.k_norm.weight" % layer), eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        scores = torch.einsum("ihd,jhd->hij", q, k) / (d ** 0.5) + mask
        o = bf16(torch.einsum("hij,jhd->ihd", torch.softmax(scores, -1), v).reshape(s, nh * d))
        x = bf16(x + linear(o, L + "self_attn.o_proj.weight"))
        n = bf16(rms_norm(x, W("layers.%d.post_attention_layernorm.weight" % layer), eps))
        a = bf16(torch.nn.functional.silu(linear(n, L + "mlp.gate_proj.weight")) *
                 linear(n, L + "mlp.up_proj.weight"))
        x = bf16(x + linear(a, L + "mlp.down_proj.weight"))
    h = bf16(rms_norm(x, W("norm.weight"), eps))
    return head(h)


def stats(ref, got):
    cos = torch.nn.functional.cosine_similarity(ref.double(), got.double(), dim=-1)
    top = ref.topk(2, dim=-1)
    margin = top.values[:, 0] - top.values[:, 1]
    clear = margin > 1
    agree = (got.argmax(-1) == top.indices[:, 0])
    return cos.min().item(), cos.mean().item(), int(clear.sum()), int((agree & clear).sum()), \
        int(agree.sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per_projection", action="store_true",
                    help="int8 per group of 32 on one projection kind at a time")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with open(os.path.join(args.checkpoint, "config.json")) as f:
        cfg = json.load(f)
    tc = cfg["text_config"]
    weights = open_checkpoint(args.checkpoint)
    prefix = next(p for p in ("model.language_model.", "language_model.", "model.")
                  if p + "norm.weight" in weights)
    table = weights[prefix + "embed_tokens.weight"]  # tied head (both checkpoints)
    head_bf16 = lambda h: h @ table.float().T  # noqa: E731
    head_q = {}
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, tc["vocab_size"], (args.tokens,), generator=g).tolist()

    plain = lambda x, name: bf16(x @ weights[name].float().T)  # noqa: E731
    with torch.no_grad():
        ref = forward(weights, tc, prefix, ids, plain, head_bf16)
        f32 = forward(weights, tc, prefix, ids, lambda x, name: x @ weights[name].float().T,
                      head_bf16)
        print("%s: %d teacher-forced positions of random tokens; cosine against the bf16 path"
              % (args.checkpoint.rstrip("/").split("/")[-1], args.tokens))
        print("\n| variant | weights | activations | LM head | cosine min | cosine mean |"
              " greedy equal (all) | bf16 margin > 1 | equal there |")
        print("|---|---|---|---|---|---|---|---|---|")

        def row(name, wq, aq, hq, got):
            mn, mean, clear, agree_clear, agree = stats(ref, got)
            desc = lambda q, what: "bf16" if q is None else "int%d per %s" % (  # noqa: E731
                q[0], "channel" if (q[1] == 0 and what == "w") else
                "row" if q[1] == 0 else "%s %d" % ("group" if what == "w" else "block", q[1]))
            print("| %s | %s | %s | %s | %.6f | %.6f | %d/%d | %d | %d |" % (
                name, desc(wq, "w"), desc(aq, "a"), desc(hq, "w"), mn, mean,
                agree, args.tokens, clear, agree_clear))
            sys.stdout.flush()

        row("f32 activations (no bf16 rounding)", None, None, None, f32)
        if args.per_projection:
            for kind in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj", None):
                wq = (8, 32)
                row("w8g32 on %s only" % kind if kind else "w8g32 on all", wq, None, None,
                    forward(weights, tc, prefix, ids, make_linear(weights, wq, None, kind),
                            head_bf16))
            return
        for name in args.variants.split(","):
            wq, aq, hq = VARIANTS[name]
            if hq and hq not in head_q:
                head_q.clear()
                head_q[hq] = quant_rows(table.float(), *hq)
            head = (lambda h: h @ head_q[hq].T) if hq else head_bf16
            row(name, wq, aq, hq, forward(weights, tc, prefix, ids, make_linear(weights, wq, aq),
                                          head))


if __name__ == "__main__":
    main()
