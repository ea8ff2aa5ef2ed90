#!/usr/bin/python3
"""Independent float32 reference of the Qwen3-VL vision tower (docs/qwen3-vl-model.md §4.1-§4.5).

Written from the spec, not from the C++ code: plain torch, every formula spelled out,
untiled attention per image. Produces golden files (safetensors, F32) holding the inputs
(pixel_values, grid_thw) and the outputs: last_hidden = output of the last block (before
the merger) and deepstack.<j> = output of block deepstack_visual_indexes[j].

Usage:
  vision_ref.py --checkpoint DIR --out-dir DIR            # the built-in synthetic cases
  vision_ref.py --checkpoint DIR --pixels FILE --out FILE  # pixel_values + grid_thw from a
                                                           # safetensors file
  vision_ref.py --checkpoint DIR --preprocess-goldens DIR --out-dir DIR
      # every accepted image of preprocess_ref.py's goldens.json (up to --max-patches
      # each), batched into one call: vision_images.safetensors
  add --with-projector to also write the projector outputs (projector_ref.py).
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402

LN_EPS = 1e-6          # vision LayerNorm eps, hard-coded in the reference model (§1)
ROTARY_THETA = 10000.0  # vision rotary base (§4.3)

# Built-in cases: name -> (seed, [(t, h, w), ...]). Grids in patches.
CASES = {
    "one_4x4": (1, [(1, 4, 4)]),             # a 64x64 image
    "one_6x8": (2, [(1, 6, 8)]),             # a 96x128 image
    "two_images": (3, [(1, 4, 4), (1, 6, 8)]),  # two attention segments
    "wide_2x40": (4, [(1, 2, 40)]),          # extreme aspect ratio
    "two_frames": (5, [(2, 4, 6)]),          # t = 2: two segments, same positions
    "large_52x56": (6, [(1, 52, 56)]),       # more patches per axis than the 48x48 table
}


def vision_prefix(weights):
    for prefix in ("model.visual.", "visual."):
        if prefix + "patch_embed.proj.weight" in weights:
            return prefix
    raise ValueError("no vision tower in checkpoint")


def layer_norm(x, w, b):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + LN_EPS) * w + b


def gelu_tanh(z):
    return 0.5 * z * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z ** 3)))


def gelu_erf(z):
    return 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))


def merge_order(h, w, m):
    """(row, col) of each patch in merge order (bh, bw, ih, iw), raster within 2x2 blocks."""
    rows, cols = [], []
    for bh in range(h // m):
        for bw in range(w // m):
            for ih in range(m):
                for iw in range(m):
                    rows.append(bh * m + ih)
                    cols.append(bw * m + iw)
    return rows, cols


def position_embedding(table, t, h, w, m):
    """§4.2: corner-aligned bilinear interpolation of the G x G table, merge order."""
    g = int(math.isqrt(table.shape[0]))
    assert g * g == table.shape[0]
    hs = torch.linspace(0, g - 1, h, dtype=torch.float32)
    ws = torch.linspace(0, g - 1, w, dtype=torch.float32)
    out = torch.empty(h, w, table.shape[1], dtype=torch.float32)
    for r in range(h):
        h0 = int(hs[r].item())          # truncation
        h1 = min(h0 + 1, g - 1)
        dh = hs[r] - h0                 # float32
        for c in range(w):
            w0 = int(ws[c].item())
            w1 = min(w0 + 1, g - 1)
            dw = ws[c] - w0
            out[r, c] = (table[h0 * g + w0] * ((1 - dh) * (1 - dw))
                         + table[h0 * g + w1] * ((1 - dh) * dw)
                         + table[h1 * g + w0] * (dh * (1 - dw))
                         + table[h1 * g + w1] * (dh * dw))
    rows, cols = merge_order(h, w, m)
    one_frame = out[torch.tensor(rows), torch.tensor(cols)]  # [h*w, hidden], merge order
    return one_frame.repeat(t, 1)


def rotary_cos_sin(t, h, w, m, head_dim):
    """§4.3: per patch f = [row * inv, col * inv], emb = [f, f]; cos/sin [t*h*w, head_dim]."""
    dim = head_dim // 2
    inv = 1.0 / (ROTARY_THETA ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rows, cols = merge_order(h, w, m)
    r = torch.tensor(rows, dtype=torch.float32).repeat(t)
    c = torch.tensor(cols, dtype=torch.float32).repeat(t)
    f = torch.cat([r[:, None] * inv[None, :], c[:, None] * inv[None, :]], dim=1)
    emb = torch.cat([f, f], dim=1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def vision_forward(weights, vcfg, pixel_values, grids):
    """Returns (last_hidden [N, hidden], [tap [N, hidden] for each deepstack index])."""
    p = vision_prefix(weights)
    W = lambda name: weights[p + name].float()  # noqa: E731
    hidden = vcfg["hidden_size"]
    heads = vcfg["num_heads"]
    head_dim = hidden // heads
    m = vcfg["spatial_merge_size"]
    n = pixel_values.shape[0]
    assert n == sum(t * h * w for t, h, w in grids)

    # §4.1 patch embedding (Conv3d with kernel = stride == a linear over 1536 columns)
    wpe = W("patch_embed.proj.weight").reshape(hidden, -1)
    x = pixel_values.float() @ wpe.T + W("patch_embed.proj.bias")

    # §4.2 position embedding, §4.3 rotary
    table = W("pos_embed.weight")
    x = x + torch.cat([position_embedding(table, t, h, w, m) for t, h, w in grids])
    cs = [rotary_cos_sin(t, h, w, m, head_dim) for t, h, w in grids]
    cos = torch.cat([c for c, _ in cs])[:, None, :]  # [N, 1, head_dim]
    sin = torch.cat([s for _, s in cs])[:, None, :]

    # one segment per image and frame
    bounds = [0]
    for t, h, w in grids:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)

    act = gelu_erf if vcfg["hidden_act"] == "gelu" else gelu_tanh
    taps = {}
    for i in range(vcfg["depth"]):
        b = "blocks.%d." % i
        hn = layer_norm(x, W(b + "norm1.weight"), W(b + "norm1.bias"))
        qkv = hn @ W(b + "attn.qkv.weight").T + W(b + "attn.qkv.bias")
        q = qkv[:, 0 * hidden:1 * hidden].reshape(n, heads, head_dim)
        k = qkv[:, 1 * hidden:2 * hidden].reshape(n, heads, head_dim)
        v = qkv[:, 2 * hidden:3 * hidden].reshape(n, heads, head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = torch.empty_like(q)
        for s0, s1 in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (z[s0:s1].transpose(0, 1) for z in (q, k, v))  # [heads, len, head_dim]
            scores = qs @ ks.transpose(1, 2) / math.sqrt(head_dim)
            probs = torch.softmax(scores, dim=-1)
            o[s0:s1] = (probs @ vs).transpose(0, 1)
        x = x + o.reshape(n, hidden) @ W(b + "attn.proj.weight").T + W(b + "attn.proj.bias")
        hn = layer_norm(x, W(b + "norm2.weight"), W(b + "norm2.bias"))
        hn = act(hn @ W(b + "mlp.linear_fc1.weight").T + W(b + "mlp.linear_fc1.bias"))
        x = x + hn @ W(b + "mlp.linear_fc2.weight").T + W(b + "mlp.linear_fc2.bias")
        taps[i] = x
    return x, [taps[j] for j in vcfg["deepstack_visual_indexes"]]


def synthetic_pixels(seed, grids, patch_dim):
    g = torch.Generator().manual_seed(seed)
    n = sum(t * h * w for t, h, w in grids)
    return torch.rand(n, patch_dim, generator=g, dtype=torch.float32) * 2 - 1


def load_vision_config(checkpoint):
    with open(os.path.join(checkpoint, "config.json")) as f:
        return json.load(f)["vision_config"]


def make_golden(weights, vcfg, pixel_values, grids, out_path, with_projector, name):
    last, taps = vision_forward(weights, vcfg, pixel_values, grids)
    tensors = {"pixel_values": pixel_values.float().contiguous(),
               "grid_thw": torch.tensor(grids, dtype=torch.int64).reshape(-1, 3),
               "last_hidden": last}
    for j, tap in enumerate(taps):
        tensors["deepstack.%d" % j] = tap
    if with_projector:
        import projector_ref
        embeds, ds_embeds = projector_ref.project(weights, vcfg, last, taps)
        tensors["image_embeds"] = embeds
        for j, e in enumerate(ds_embeds):
            tensors["deepstack_embeds.%d" % j] = e
    st.write_file(out_path, tensors, {"case": name, "producer": "tests/reference/vision_ref.py"})
    label = name if len(name) < 40 else name[:37] + "..."
    print("%s: %d patches, %d image(s) -> %s" % (label, pixel_values.shape[0], len(grids), out_path))


def preprocessed_images(golden_dir, max_patches):
    """(names, pixel_values, grids) of the accepted images of preprocess_ref.py's output."""
    with open(os.path.join(golden_dir, "goldens.json")) as f:
        records = json.load(f)["images"]
    names, pixels, grids = [], [], []
    for rec in records:
        if not rec.get("ok"):
            continue
        pv = rec["pixel_values"]
        if pv["rows"] > max_patches:
            continue
        raw = open(os.path.join(golden_dir, pv["file"]), "rb").read()
        t = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(pv["rows"], pv["cols"])
        names.append(os.path.basename(rec["file"]))
        pixels.append(t)
        grids.append(tuple(int(v) for v in rec["grid_thw"]))
    return names, torch.cat(pixels), grids


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="model directory (config.json + weights)")
    ap.add_argument("--out-dir", help="write vision_<case>.safetensors for the built-in cases")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated built-in cases")
    ap.add_argument("--pixels", help="safetensors with pixel_values and grid_thw (or image_grid_thw)")
    ap.add_argument("--out", help="output file for --pixels")
    ap.add_argument("--preprocess-goldens", help="preprocess_ref.py output directory")
    ap.add_argument("--max-patches", type=int, default=4096,
                    help="skip preprocessed images with more patches than this")
    ap.add_argument("--with-projector", action="store_true",
                    help="also write image_embeds and deepstack_embeds.<j> (projector_ref.py)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    vcfg = load_vision_config(args.checkpoint)
    weights = st.read_checkpoint(args.checkpoint)
    patch_dim = (vcfg["in_channels"] * vcfg["temporal_patch_size"] * vcfg["patch_size"] ** 2)
    if args.pixels:
        if not args.out:
            ap.error("--pixels needs --out")
        inputs, _ = st.read_file(args.pixels)
        grid = inputs.get("grid_thw", inputs.get("image_grid_thw"))
        grids = [tuple(int(v) for v in row) for row in grid.reshape(-1, 3).tolist()]
        make_golden(weights, vcfg, inputs["pixel_values"].float(), grids, args.out,
                    args.with_projector, os.path.basename(args.pixels))
        return
    if not args.out_dir:
        ap.error("give --out-dir (built-in cases) or --pixels/--out")
    os.makedirs(args.out_dir, exist_ok=True)
    if args.preprocess_goldens:
        names, pixels, grids = preprocessed_images(args.preprocess_goldens, args.max_patches)
        if not names:
            sys.exit("no accepted images in " + args.preprocess_goldens)
        make_golden(weights, vcfg, pixels, grids,
                    os.path.join(args.out_dir, "vision_images.safetensors"),
                    args.with_projector, "images:" + ",".join(names))
        return
    for name in args.cases.split(","):
        seed, grids = CASES[name]
        pixels = synthetic_pixels(seed, grids, patch_dim)
        make_golden(weights, vcfg, pixels, grids,
                    os.path.join(args.out_dir, "vision_%s.safetensors" % name),
                    args.with_projector, name)


if __name__ == "__main__":
    main()
