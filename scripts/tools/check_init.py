#!/usr/bin/python3
"""Sanity check of a vlm-make-checkpoint initialisation (not a golden reference).

Runs a rough float32 forward of the text decoder (RMSNorm, q/k norm, rotary,
GQA causal attention, SwiGLU, tied or untied head) and of the ViT (LayerNorm,
attention without rotary, tanh-GELU MLP, mergers) with NumPy over a written
checkpoint, and prints what a random model must get right to be useful in
tests: hidden-state RMS per layer (no blow-up, no collapse), the top-1/top-2
logit margin of greedy decoding (clear margins survive bf16 rounding), how
often the prediction is just the input token again, and how often changing
the first prompt token changes the greedy continuation (context sensitivity).

Usage: /usr/bin/python3 scripts/tools/check_init.py CHECKPOINT_DIR [--steps N]
"""
import argparse
import json
import os
import sys

import numpy as np


def open_checkpoint(path):
    """name -> (file, dtype, shape, begin, end) over one file or an index."""
    index = os.path.join(path, "model.safetensors.index.json")
    files = ([os.path.join(path, f) for f in sorted(set(json.load(open(index))["weight_map"].values()))]
             if os.path.exists(index) else [os.path.join(path, "model.safetensors")])
    tensors = {}
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            b, e = info["data_offsets"]
            tensors[name] = (f, info["dtype"], info["shape"], base + b, base + e)
    return tensors


class Weights:
    def __init__(self, path):
        self.index = open_checkpoint(path)
        self.maps = {}

    def __contains__(self, name):
        return name in self.index

    def __getitem__(self, name):
        f, dtype, shape, b, e = self.index[name]
        if f not in self.maps:
            self.maps[f] = np.memmap(f, dtype=np.uint8, mode="r")
        raw = self.maps[f][b:e]
        if dtype == "BF16":
            x = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif dtype == "F32":
            x = raw.view(np.float32).astype(np.float32)
        else:
            raise ValueError(f"{name}: dtype {dtype}")
        return x.reshape(shape)


def rms(x):
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def rms_norm(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def layer_norm(x, w, b, eps=1e-6):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


class Text:
    def __init__(self, w, cfg):
        self.w, self.c = w, cfg["text_config"]
        c = self.c
        self.L, self.H, self.nh, self.nkv, self.hd = (c["num_hidden_layers"], c["hidden_size"],
                                                      c["num_attention_heads"], c["num_key_value_heads"],
                                                      c["head_dim"])
        self.eps = c["rms_norm_eps"]
        theta = c.get("rope_theta") or c["rope_parameters"]["rope_theta"]
        self.inv = 1.0 / (theta ** (np.arange(0, self.hd, 2, dtype=np.float32) / self.hd))
        self.embed = w["model.language_model.embed_tokens.weight"]
        self.head = w["lm_head.weight"] if "lm_head.weight" in w else self.embed
        # Cache float32 layers for small models; the 2B converts per use (RAM).
        small = self.L * self.H * self.H < 50_000_000
        self.layers = [self._layer(l) for l in range(self.L)] if small else None
        self.norm = w["model.language_model.norm.weight"]

    def _layer(self, l):
        p = f"model.language_model.layers.{l}."
        names = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
        return {n: self.w[p + n + ".weight"] for n in names}

    def forward(self, ids, stats=None):
        S = len(ids)
        x = self.embed[ids].astype(np.float32)
        # Text-only positions (i, i, i): every MRoPE axis carries the same index.
        f = np.arange(S, dtype=np.float32)[:, None] * self.inv[None, :]
        emb = np.concatenate([f, f], -1)
        cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
        mask = np.triu(np.full((S, S), -np.inf, dtype=np.float32), 1)
        group = self.nh // self.nkv
        if stats is not None:
            stats.append(("embed", rms(x)))
        for l in range(self.L):
            W = self.layers[l] if self.layers is not None else self._layer(l)
            h = rms_norm(x, W["input_layernorm"], self.eps)
            q = (h @ W["self_attn.q_proj"].T).reshape(S, self.nh, self.hd)
            k = (h @ W["self_attn.k_proj"].T).reshape(S, self.nkv, self.hd)
            v = (h @ W["self_attn.v_proj"].T).reshape(S, self.nkv, self.hd)
            q = rms_norm(q, W["self_attn.q_norm"], self.eps)
            k = rms_norm(k, W["self_attn.k_norm"], self.eps)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            o = np.empty((S, self.nh, self.hd), dtype=np.float32)
            ent = []
            for i in range(self.nh):
                s = q[:, i] @ k[:, i // group].T / np.sqrt(self.hd) + mask
                s = np.exp(s - s.max(-1, keepdims=True))
                p = s / s.sum(-1, keepdims=True)
                ent.append(float(np.mean(1.0 / np.sum(p * p, -1))))  # effective attended tokens
                o[:, i] = p @ v[:, i // group]
            a = o.reshape(S, -1) @ W["self_attn.o_proj"].T
            x = x + a
            n = rms_norm(x, W["post_attention_layernorm"], self.eps)
            g = n @ W["mlp.gate_proj"].T
            m = (g / (1 + np.exp(-g)) * (n @ W["mlp.up_proj"].T)) @ W["mlp.down_proj"].T
            x = x + m
            if stats is not None:
                stats.append((f"layer {l}", rms(x), rms(a), rms(m), float(np.mean(ent))))
        h = rms_norm(x[-1], self.norm, self.eps)
        return h @ self.head.T

    def greedy(self, ids, steps):
        ids = list(ids)
        margins, repeats, out = [], 0, []
        for _ in range(steps):
            logits = self.forward(np.array(ids))[:151669]  # ids >= 151669 are padding (spec §5.4)
            top2 = np.partition(logits, -2)[-2:]
            margins.append(float(top2[1] - top2[0]))
            nxt = int(np.argmax(logits))
            repeats += nxt == ids[-1]
            out.append(nxt)
            ids.append(nxt)
        return out, margins, repeats, float(np.std(logits))


def vision_stats(w, cfg, rng):
    v = cfg["vision_config"]
    hv, depth, nh = v["hidden_size"], v["depth"], v["num_heads"]
    ms = v["spatial_merge_size"]
    n = 64  # an 8x8 patch grid, already in merge order for this purpose
    pe = w["model.visual.patch_embed.proj.weight"].reshape(hv, -1)
    pix = rng.uniform(-1, 1, size=(n, pe.shape[1])).astype(np.float32)
    x = pix @ pe.T + w["model.visual.patch_embed.proj.bias"]
    pos = w["model.visual.pos_embed.weight"]
    x = x + pos[rng.integers(0, pos.shape[0], n)]
    rows = [("patch+pos", rms(x))]
    taps = []
    hd = hv // nh
    for i in range(depth):
        p = f"model.visual.blocks.{i}."
        h = layer_norm(x, w[p + "norm1.weight"], w[p + "norm1.bias"])
        qkv = (h @ w[p + "attn.qkv.weight"].T + w[p + "attn.qkv.bias"]).reshape(n, 3, nh, hd)
        o = np.empty((n, nh, hd), dtype=np.float32)
        for j in range(nh):
            s = qkv[:, 0, j] @ qkv[:, 1, j].T / np.sqrt(hd)
            s = np.exp(s - s.max(-1, keepdims=True))
            o[:, j] = (s / s.sum(-1, keepdims=True)) @ qkv[:, 2, j]
        x = x + o.reshape(n, hv) @ w[p + "attn.proj.weight"].T + w[p + "attn.proj.bias"]
        h = layer_norm(x, w[p + "norm2.weight"], w[p + "norm2.bias"])
        h = h @ w[p + "mlp.linear_fc1.weight"].T + w[p + "mlp.linear_fc1.bias"]
        h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
        x = x + h @ w[p + "mlp.linear_fc2.weight"].T + w[p + "mlp.linear_fc2.bias"]
        rows.append((f"block {i}", rms(x)))
        if i in v["deepstack_visual_indexes"]:
            taps.append(x.copy())

    def merger(prefix, x, post):
        from math import erf
        if not post:
            x = layer_norm(x, w[prefix + "norm.weight"], w[prefix + "norm.bias"])
        x = x.reshape(-1, hv * ms * ms)
        if post:
            x = layer_norm(x, w[prefix + "norm.weight"], w[prefix + "norm.bias"])
        h = x @ w[prefix + "linear_fc1.weight"].T + w[prefix + "linear_fc1.bias"]
        h = 0.5 * h * (1 + np.vectorize(erf)(h / np.sqrt(2)))
        return h @ w[prefix + "linear_fc2.weight"].T + w[prefix + "linear_fc2.bias"]

    rows.append(("merger out", rms(merger("model.visual.merger.", x, False))))
    for k, t in enumerate(taps):
        rows.append((f"deepstack {k} out", rms(merger(f"model.visual.deepstack_merger_list.{k}.", t, True))))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    args = ap.parse_args()
    cfg = json.load(open(os.path.join(args.checkpoint, "config.json")))
    w = Weights(args.checkpoint)
    rng = np.random.default_rng(0)
    text = Text(w, cfg)

    # Spec §7.2 a): a chat prompt with an image placeholder, as token ids.
    chat = [151644, 872, 198, 151652, 151655, 151653, 74785, 419, 2168, 13, 151645, 198, 151644, 77091, 198]
    prompts = [chat] + [list(rng.integers(0, 151643, size=int(rng.integers(4, 24))))
                        for _ in range(args.prompts - 1)]

    stats = []
    text.forward(np.array(prompts[1]), stats)
    print("text decoder, prompt of", len(prompts[1]), "tokens")
    print(f"  {'':10s} {'resid RMS':>10s} {'attn out':>9s} {'mlp out':>9s} {'attended':>9s}")
    for row in stats:
        print(f"  {row[0]:10s} {row[1]:10.3f}" + ("" if len(row) == 2 else
                                                   f" {row[2]:9.3f} {row[3]:9.3f} {row[4]:9.2f}"))

    all_margins, repeats, total, changed, logit_std = [], 0, 0, 0, []
    for p in prompts:
        out, margins, rep, std = text.greedy(p, args.steps)
        alt = list(p)
        alt[0] = (alt[0] + 1) % 151643
        out2, _, _, _ = text.greedy(alt, args.steps)
        all_margins += margins
        repeats += rep
        total += len(out)
        changed += out != out2
        logit_std.append(std)
        print(f"  prompt len {len(p):2d}: greedy {out}  margins {' '.join(f'{m:.2f}' for m in margins)}"
              f"{'  (changes with token 0)' if out != out2 else ''}")
    m = np.array(all_margins)
    print(f"logit std {np.mean(logit_std):.2f}; top1-top2 margin over {len(m)} greedy steps: "
          f"median {np.median(m):.2f}, p10 {np.percentile(m, 10):.2f}, min {m.min():.3f}")
    print(f"prediction == input token: {repeats}/{total}; continuation changes when token 0 changes: "
          f"{changed}/{len(prompts)}")

    print("vision encoder (8x8 random patches, no rotary)")
    for name, value in vision_stats(w, cfg, rng):
        print(f"  {name:18s} RMS {value:.3f}")
    print(f"  (text embedding RMS {rms(text.embed[:4096]):.3f})")


if __name__ == "__main__":
    sys.exit(main())
