#!/usr/bin/python3
"""Independent float32 reference of the Qwen3-VL language model (docs/qwen3-vl-model.md §5, §6).

Written from the spec, not from the C++ code: plain torch in float32, every formula spelled
out, no KV cache (each greedy step recomputes the whole sequence), an explicit causal mask,
grouped-query attention by expanding the kv heads. Image features are deterministic random
pre-projector features (what the language service receives over the wire) fed through
projector_ref.py.

For each case it writes <out-dir>/text_<case>.safetensors holding the inputs
  input_ids [S] I64, grid_thw [n, 3] I64, features.last_hidden [N, vh] F32,
  features.deepstack.<j> [N, vh] F32, image_embeds [M, H], deepstack_embeds.<j> [M, H]
and the outputs
  positions [3, S] I64 (get_rope_index, §6.1), rope_delta [1] I64,
  greedy [G] I64 (G greedy tokens after the prompt),
  logits [S + G - 1, vocab] F32: logits at every position of prompt + greedy[:-1]
  (row S - 1 + i predicts greedy[i]).

Usage: text_ref.py --checkpoint DIR --out-dir DIR [--cases a,b] [--greedy 32]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402
from projector_ref import project  # noqa: E402

# Token ids (spec §7.1 added tokens, §7.2 renderings and golden encodings).
IM_START, IM_END, NL = 151644, 151645, 198
SYSTEM, USER, ASSISTANT = 8948, 872, 77091
VISION_START, VISION_END, IMAGE_PAD = 151652, 151653, 151655
HELPFUL = [2610, 525, 264, 10950, 17847, 13]            # "You are a helpful assistant."
PAY = [40, 3278, 2291, 400, 16, 11, 17, 18, 19, 13, 20, 15]  # "I'll pay $1,234.50"
DESCRIBE = [74785, 419, 2168, 13]                       # "Describe this image."
HELLO, HELLO_WORLD = [9707], [21927, 1879]              # "Hello", " Hello world"


def image(n_pads):
    return [VISION_START] + [IMAGE_PAD] * n_pads + [VISION_END]


def assistant_prompt():
    return [IM_END, NL, IM_START, ASSISTANT, NL]


# name -> (feature seed, grids (t, h, w) in patches, token ids). Pads = t*h*w/4 per image.
CASES = {
    # system + user text turn (§7.2 b without the image)
    "text": (0, [], [IM_START, SYSTEM, NL] + HELPFUL + [IM_END, NL, IM_START, USER, NL] + PAY
             + assistant_prompt()),
    # §7.2 a) with a 96x128 image: grid (1, 6, 8) -> 12 pads
    "one_image": (11, [(1, 6, 8)], [IM_START, USER, NL] + image(12) + DESCRIBE
                  + assistant_prompt()),
    # two images with text between (§6.1 two-image shape): grids (1,4,4) and (1,6,8)
    "two_images": (12, [(1, 4, 4), (1, 6, 8)],
                   [IM_START, USER, NL] + image(4) + HELLO + image(12) + HELLO_WORLD + DESCRIBE
                   + assistant_prompt()),
}


def language_prefix(weights):
    for prefix in ("model.language_model.", "language_model.", "model."):
        if prefix + "norm.weight" in weights:
            return prefix
    raise ValueError("no language model in checkpoint")


def head_weight(weights, cfg, prefix):
    """§2 tied-head rule: tied -> embed_tokens (or lm_head if only it exists); untied -> lm_head."""
    tied = cfg["text_config"].get("tie_word_embeddings", cfg.get("tie_word_embeddings"))
    embed = weights.get(prefix + "embed_tokens.weight")
    head = weights.get("lm_head.weight")
    if tied:
        table = embed if embed is not None else head
        return table, table
    assert embed is not None and head is not None, "untied checkpoint needs both tables"
    return embed, head


def rope_index(ids, grids, merge):
    """§6.1 get_rope_index for one sequence: ([3, S] positions, rope_delta)."""
    s = len(ids)
    pos = torch.zeros(3, s, dtype=torch.int64)
    st_idx, nxt = 0, 0
    for (t, h, w) in grids:
        ed = ids.index(IMAGE_PAD, st_idx)
        assert ed > 0 and ids[ed - 1] == VISION_START
        for i in range(st_idx, ed):
            pos[:, i] = nxt + (i - st_idx)
        base = nxt + (ed - st_idx)
        hm, wm = h // merge, w // merge
        i = ed
        for ti in range(t):
            for r in range(hm):
                for c in range(wm):
                    pos[0, i], pos[1, i], pos[2, i] = base + ti, base + r, base + c
                    i += 1
        st_idx = i
        nxt = int(pos[:, :i].max()) + 1
    for i in range(st_idx, s):
        pos[:, i] = nxt + (i - st_idx)
    rope_delta = (int(pos.max()) + 1 if s else 0) - s
    return pos, rope_delta


def mrope_cos_sin(pos, head_dim, theta, section):
    """§6.2 interleaved MRoPE: cos, sin [S, head_dim] float32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = pos.float()[:, :, None] * inv[None, None, :]  # [3, S, D/2]
    f = freqs[0].clone()
    for j in range(head_dim // 2):
        if j % 3 == 1 and j < 3 * section[1]:
            f[:, j] = freqs[1, :, j]
        elif j % 3 == 2 and j < 3 * section[2]:
            f[:, j] = freqs[2, :, j]
    emb = torch.cat([f, f], dim=-1)
    return emb.cos(), emb.sin()


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def forward(weights, cfg, ids, image_embeds, deepstack, pos, n_prompt):
    """§5: logits [S, vocab] float32 for the whole sequence. Image pads are spliced (and
    get deepstack) only among the first n_prompt tokens: generated tokens are always text."""
    tc = cfg["text_config"]
    p = language_prefix(weights)
    W = lambda name: weights[p + name].float()  # noqa: E731
    embed, head = head_weight(weights, cfg, p)
    eps = tc["rms_norm_eps"]
    nh, nkv, d = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    section = (tc.get("rope_scaling") or tc.get("rope_parameters"))["mrope_section"]
    theta = tc.get("rope_theta") or tc["rope_parameters"]["rope_theta"]
    s = len(ids)
    ids_t = torch.tensor(ids, dtype=torch.int64)
    x = embed.float()[ids_t].clone()
    visual = (ids_t == IMAGE_PAD) & (torch.arange(s) < n_prompt)
    if int(visual.sum()):
        x[visual] = image_embeds.float()
    cos, sin = mrope_cos_sin(pos, d, theta, section)
    cos, sin = cos[:, None, :], sin[:, None, :]
    mask = torch.full((s, s), float("-inf")).triu(1)
    for layer in range(tc["num_hidden_layers"]):
        L = "layers.%d." % layer
        h = rms_norm(x, W(L + "input_layernorm.weight"), eps)
        q = (h @ W(L + "self_attn.q_proj.weight").T).view(s, nh, d)
        k = (h @ W(L + "self_attn.k_proj.weight").T).view(s, nkv, d)
        v = (h @ W(L + "self_attn.v_proj.weight").T).view(s, nkv, d)
        q = rms_norm(q, W(L + "self_attn.q_norm.weight"), eps)
        k = rms_norm(k, W(L + "self_attn.k_norm.weight"), eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        group = nh // nkv
        k = k.repeat_interleave(group, dim=1)  # q head i uses kv head i // group
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("ihd,jhd->hij", q, k) / (d ** 0.5) + mask
        o = torch.einsum("hij,jhd->ihd", torch.softmax(scores, dim=-1), v).reshape(s, nh * d)
        x = x + o @ W(L + "self_attn.o_proj.weight").T
        n = rms_norm(x, W(L + "post_attention_layernorm.weight"), eps)
        gate = n @ W(L + "mlp.gate_proj.weight").T
        up = n @ W(L + "mlp.up_proj.weight").T
        x = x + (torch.nn.functional.silu(gate) * up) @ W(L + "mlp.down_proj.weight").T
        if layer < len(deepstack) and int(visual.sum()):
            x[visual] = x[visual] + deepstack[layer].float()
    h = rms_norm(x, W("norm.weight"), eps)
    return h @ head.float().T


def make_case(weights, cfg, name, greedy_steps, out_path):
    seed, grids, ids = CASES[name]
    vc = cfg["vision_config"]
    merge = vc["spatial_merge_size"]
    vh = vc["hidden_size"]
    n_patches = sum(t * h * w for (t, h, w) in grids)
    gen = torch.Generator().manual_seed(seed)
    last_hidden = torch.randn(n_patches, vh, generator=gen)
    taps = [torch.randn(n_patches, vh, generator=gen) for _ in vc["deepstack_visual_indexes"]]
    out = {"input_ids": torch.tensor(ids, dtype=torch.int64)}
    if grids:
        image_embeds, deepstack = project(weights, vc, last_hidden, taps)
        out["grid_thw"] = torch.tensor(grids, dtype=torch.int64)
        out["features.last_hidden"] = last_hidden
        for j, tap in enumerate(taps):
            out["features.deepstack.%d" % j] = tap
        out["image_embeds"] = image_embeds
        for j, e in enumerate(deepstack):
            out["deepstack_embeds.%d" % j] = e
    else:
        image_embeds, deepstack = None, []
    assert sum(t * h * w // (merge * merge) for (t, h, w) in grids) == ids.count(IMAGE_PAD)
    pos, rope_delta = rope_index(ids, grids, merge)
    out["positions"] = pos
    out["rope_delta"] = torch.tensor([rope_delta], dtype=torch.int64)

    # Greedy continuation, recomputing the whole sequence at every step.
    seq = list(ids)
    greedy = []
    for _ in range(greedy_steps):
        full_pos, _ = rope_index(seq, grids, merge)
        logits = forward(weights, cfg, seq, image_embeds, deepstack, full_pos, len(ids))
        token = int(torch.argmax(logits[-1]))
        greedy.append(token)
        seq.append(token)
    # Logits at every position of prompt + greedy[:-1].
    full = list(ids) + greedy[:-1]
    full_pos, _ = rope_index(full, grids, merge)
    assert torch.equal(full_pos[:, len(ids):],
                       torch.arange(len(ids), len(full)).expand(3, -1) + rope_delta)
    out["logits"] = forward(weights, cfg, full, image_embeds, deepstack, full_pos, len(ids))
    out["greedy"] = torch.tensor(greedy, dtype=torch.int64)
    st.write_file(out_path, out, {"case": name, "producer": "tests/reference/text_ref.py"})
    print("%s: S=%d, rope_delta=%d, greedy %s -> %s" % (name, len(ids), rope_delta, greedy[:8],
                                                        out_path))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="model directory")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--greedy", type=int, default=32, help="greedy tokens per case")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with open(os.path.join(args.checkpoint, "config.json")) as f:
        cfg = json.load(f)
    weights = st.read_checkpoint(args.checkpoint)
    os.makedirs(args.out_dir, exist_ok=True)
    for name in args.cases.split(","):
        make_case(weights, cfg, name, args.greedy,
                  os.path.join(args.out_dir, "text_%s.safetensors" % name))


if __name__ == "__main__":
    main()
