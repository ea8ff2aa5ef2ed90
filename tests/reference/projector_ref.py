#!/usr/bin/python3
"""Independent float32 reference of the Qwen3-VL patch mergers (docs/qwen3-vl-model.md §4.6).

Final merger (model.visual.merger, post-shuffle norm off):
    y = LayerNorm_hidden(x) per patch -> view [N/4, 4*hidden] -> fc1 -> exact GELU -> fc2
Deepstack mergers (model.visual.deepstack_merger_list.<j>, post-shuffle norm on):
    view [N/4, 4*hidden] -> LayerNorm_{4*hidden} -> fc1 -> exact GELU -> fc2
Four consecutive rows (one 2x2 block in merge order) form one merged token.

Usage: projector_ref.py --checkpoint DIR --features FILE --out FILE
  FILE = a vision golden (vision_ref.py): last_hidden, deepstack.<j>, grid_thw.
  Writes image_embeds [N/4, out_hidden] and deepstack_embeds.<j>, plus the inputs.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402
from vision_ref import gelu_erf, layer_norm, vision_prefix  # noqa: E402


def merger(weights, name, x, unit, postshuffle_norm):
    W = lambda field: weights[name + field].float()  # noqa: E731
    n, hidden = x.shape
    assert n % unit == 0, "patch count %d is not a multiple of %d" % (n, unit)
    if postshuffle_norm:
        y = layer_norm(x.reshape(n // unit, unit * hidden), W("norm.weight"), W("norm.bias"))
    else:
        y = layer_norm(x, W("norm.weight"), W("norm.bias")).reshape(n // unit, unit * hidden)
    y = gelu_erf(y @ W("linear_fc1.weight").T + W("linear_fc1.bias"))
    return y @ W("linear_fc2.weight").T + W("linear_fc2.bias")


def project(weights, vcfg, last_hidden, taps):
    """Returns (image_embeds, [deepstack_embeds_j])."""
    p = vision_prefix(weights)
    unit = vcfg["spatial_merge_size"] ** 2
    embeds = merger(weights, p + "merger.", last_hidden.float(), unit, False)
    ds = [merger(weights, p + "deepstack_merger_list.%d." % j, tap.float(), unit, True)
          for j, tap in enumerate(taps)]
    return embeds, ds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--features", required=True, help="vision golden file (vision_ref.py)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with open(os.path.join(args.checkpoint, "config.json")) as f:
        vcfg = json.load(f)["vision_config"]
    weights = st.read_checkpoint(args.checkpoint)
    feats, _ = st.read_file(args.features)
    taps = [feats["deepstack.%d" % j] for j in range(len(vcfg["deepstack_visual_indexes"]))]
    embeds, ds = project(weights, vcfg, feats["last_hidden"], taps)
    out = dict(feats)
    out["image_embeds"] = embeds
    for j, e in enumerate(ds):
        out["deepstack_embeds.%d" % j] = e
    st.write_file(args.out, out, {"producer": "tests/reference/projector_ref.py"})
    print("%d patches -> %d merged tokens -> %s" % (feats["last_hidden"].shape[0],
                                                    embeds.shape[0], args.out))


if __name__ == "__main__":
    main()
