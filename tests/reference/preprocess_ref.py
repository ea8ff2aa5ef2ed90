#!/usr/bin/python3
"""Independent reference for Qwen3-VL image preprocessing (qwen3-vl-model.md §3,
the PIL path), written from the spec with Pillow and numpy.

Usage: preprocess_ref.py IMAGES_DIR OUT_DIR

Reads IMAGES_DIR/images.json (from make_images.py) and, for every image,
writes into OUT_DIR raw little-endian files
  <name>.decoded.u8   [H, W, 3] uint8 after exif_transpose + convert("RGB")
                      (only up to 2 M pixels; the manifest always has its SHA-256)
  <name>.resized.u8   [h, w, 3] uint8 after smart_resize + Pillow BICUBIC
  <name>.pixel_values.f32  [grid_t*grid_h*grid_w, 1536] float32
and OUT_DIR/goldens.json describing them (sizes, grid_thw, or the error for an
image the reference rejects).
"""
import hashlib
import json
import math
import os
import sys

import numpy as np
from PIL import Image, ImageOps

PATCH = 16
MERGE = 2
TEMPORAL = 2
MEAN = STD = 0.5
RESCALE = 1 / 255
MAX_RAW_DECODED_PIXELS = 2_000_000


def load_image(path):
    """transformers.image_utils.load_image for a file: EXIF transpose, then RGB."""
    im = Image.open(path)
    im = ImageOps.exif_transpose(im)
    return im.convert("RGB")


def smart_resize(height, width, factor, min_pixels, max_pixels):
    """HF's smart_resize (Python round() is half-to-even)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got "
                         f"{max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def normalize(resized_u8):
    """The slow processor's rescale (float64 multiply, cast to float32) and
    normalize (float32 (x - mean) / std)."""
    x = (resized_u8.astype(np.float64) * RESCALE).astype(np.float32)
    mean = np.array([MEAN] * 3, dtype=np.float32)
    std = np.array([STD] * 3, dtype=np.float32)
    return (x - mean) / std


def patchify(normalized_hwc):
    """[h, w, 3] float32 -> pixel_values [grid_h*grid_w, 3*2*16*16], grid."""
    chw = normalized_hwc.transpose(2, 0, 1)
    patches = np.stack([chw] * TEMPORAL)  # one image, repeated to a temporal patch
    _, c, h, w = patches.shape
    grid_t, grid_h, grid_w = patches.shape[0] // TEMPORAL, h // PATCH, w // PATCH
    patches = patches.reshape(grid_t, TEMPORAL, c, grid_h // MERGE, MERGE, PATCH, grid_w // MERGE,
                              MERGE, PATCH)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    flat = patches.reshape(grid_t * grid_h * grid_w, c * TEMPORAL * PATCH * PATCH)
    return np.ascontiguousarray(flat, dtype=np.float32), [grid_t, grid_h, grid_w]


def main(images_dir, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(images_dir, "images.json")) as f:
        images = json.load(f)["images"]
    results = []
    for entry in images:
        name = entry["file"]
        rec = {"file": name, "min_pixels": entry["min_pixels"], "max_pixels": entry["max_pixels"]}
        rgb = load_image(os.path.join(images_dir, name))
        decoded = np.asarray(rgb, dtype=np.uint8)
        rec["decoded"] = {"width": rgb.width, "height": rgb.height,
                          "sha256": hashlib.sha256(decoded.tobytes()).hexdigest()}
        if rgb.width * rgb.height <= MAX_RAW_DECODED_PIXELS:
            rec["decoded"]["file"] = name + ".decoded.u8"
            decoded.tofile(os.path.join(out_dir, name + ".decoded.u8"))
        try:
            h, w = smart_resize(rgb.height, rgb.width, PATCH * MERGE, entry["min_pixels"],
                                entry["max_pixels"])
        except ValueError as e:
            rec["ok"] = False
            rec["error"] = str(e)
            results.append(rec)
            continue
        resized = rgb.resize((w, h), Image.BICUBIC)
        resized_u8 = np.asarray(resized, dtype=np.uint8)
        assert resized_u8.shape == (h, w, 3)
        resized_u8.tofile(os.path.join(out_dir, name + ".resized.u8"))
        pixel_values, grid = patchify(normalize(resized_u8))
        pixel_values.astype("<f4").tofile(os.path.join(out_dir, name + ".pixel_values.f32"))
        rec.update({
            "ok": True,
            "resized": {"width": w, "height": h, "file": name + ".resized.u8"},
            "grid_thw": grid,
            "pixel_values": {"rows": pixel_values.shape[0], "cols": pixel_values.shape[1],
                             "file": name + ".pixel_values.f32"},
        })
        results.append(rec)
    with open(os.path.join(out_dir, "goldens.json"), "w") as f:
        json.dump({"images": results}, f, indent=1)
    print(f"wrote goldens for {len(results)} images "
          f"({sum(r['ok'] for r in results)} accepted) to {out_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
