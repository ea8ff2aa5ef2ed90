#!/usr/bin/python3
"""Writes the preprocessing test images (deterministic) into a directory.

Usage: make_images.py OUT_DIR

Each image is built with numpy and encoded by Pillow, except the PNG variants
Pillow cannot write (16-bit RGB/RGBA/LA, 2/4-bit, Adam7-interlaced, a palette
index past PLTE): those are assembled here byte by byte with zlib. The
directory gets the image files plus images.json: for each image its file,
the preprocessing options to use (min_pixels/max_pixels) and what it covers.
Goldens are computed from these files by preprocess_ref.py; nothing here is
committed.
"""
import json
import os
import struct
import sys
import zlib

import numpy as np
from PIL import Image

DEFAULT = {"min_pixels": 65536, "max_pixels": 16777216}
# Small images would all be upscaled to >= 65536 pixels by the default budget;
# a smaller budget keeps their goldens small and exercises per-call options.
SMALL = {"min_pixels": 4096, "max_pixels": 65536}


def pattern(w, h, seed):
    """RGB uint8 [h, w, 3]: gradients, a noise band and inverted stripes, so
    that resampling sees smooth areas, sharp edges and full-range noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), ((x * 5 + y * 3) % 256)],
                   -1).astype(np.int64)
    noise = rng.integers(0, 256, (h, w, 3))
    band = x >= (w * 3) // 4
    img[band] = noise[band]
    stripes = ((x // 3) % 2 == 0) & (y < max(h // 3, 1))
    img[stripes] = 255 - img[stripes]
    return img.astype(np.uint8)


def png_chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bytes(w, h, depth, color_type, raw_rows, extra=b"", interlace=0, scanlines=None):
    """A PNG from unfiltered scanlines (filter byte 0 prepended here)."""
    if scanlines is None:
        scanlines = b"".join(b"\x00" + r for r in raw_rows)
    ihdr = struct.pack(">IIBBBBB", w, h, depth, color_type, 0, 0, interlace)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + extra +
            png_chunk(b"IDAT", zlib.compress(scanlines, 9)) + png_chunk(b"IEND", b""))


def pack_bits(values, depth):
    """Packs a row of small integers MSB first (PNG sub-byte samples)."""
    per = 8 // depth
    out = bytearray()
    for i in range(0, len(values), per):
        byte = 0
        for j in range(per):
            v = int(values[i + j]) if i + j < len(values) else 0
            byte |= v << (8 - depth * (j + 1))
        out.append(byte)
    return bytes(out)


def adam7_scanlines(arr):
    """Adam7 pass images of an [h, w, c] uint8 array, filter 0, concatenated."""
    passes = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
              (0, 1, 1, 2)]
    out = b""
    for x0, y0, dx, dy in passes:
        sub = arr[y0::dy, x0::dx]
        if sub.shape[0] == 0 or sub.shape[1] == 0:
            continue
        out += b"".join(b"\x00" + row.tobytes() for row in sub)
    return out


def exif_bytes(orientation):
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    entries = []

    def add(name, note, options=SMALL):
        entries.append({"file": name, "note": note, **options})

    def save(im, name, note, options=SMALL, **kw):
        im.save(os.path.join(out_dir, name), **kw)
        add(name, note, options)

    def write(name, data, note, options=SMALL):
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(data)
        add(name, note, options)

    rgb = lambda w, h, seed: Image.fromarray(pattern(w, h, seed), "RGB")

    # Sizes and the smart_resize branches (default budget: the 2B's).
    save(rgb(1, 1, 1), "rgb_1x1.png", "1x1, upscaled to 256x256", DEFAULT, format="PNG")
    save(rgb(7, 3, 2), "rgb_7x3.png", "tiny, 3 rows", DEFAULT, format="PNG")
    save(rgb(100, 100, 3), "rgb_100x100.png", "min_pixels branch: 256x256", DEFAULT, format="PNG")
    save(rgb(300, 50, 4), "rgb_300x50.png", "50x300 (HxW) -> 128x640", DEFAULT, format="PNG")
    save(rgb(640, 480, 5), "rgb_640x480.png", "already a multiple of 32: no resize", DEFAULT,
         format="PNG")
    save(rgb(656, 656, 6), "rgb_656x656.png", "20.5 rounds to 20: 640x640", DEFAULT, format="PNG")
    save(rgb(640, 500, 7), "rgb_640x500.png", "one axis resized only (height)", DEFAULT,
         format="PNG")
    save(rgb(4000, 3000, 8), "photo_4000x3000.jpg", "12 MP baseline JPEG 4:2:0, max_pixels branch",
         {"min_pixels": 65536, "max_pixels": 1003520}, format="JPEG", quality=90, subsampling=2)
    save(rgb(1280, 720, 9), "progressive_1280x720.jpg", "progressive JPEG 4:4:4",
         {"min_pixels": 65536, "max_pixels": 409600}, format="JPEG", quality=92,
         progressive=True, subsampling=0)
    save(rgb(333, 201, 10), "rgb_422_333x201.jpg", "JPEG 4:2:2, odd sizes", format="JPEG",
         quality=85, subsampling=1)

    # Extreme aspect ratios: 200 passes, 201 is refused.
    save(rgb(2000, 10, 11), "aspect_2000x10.png", "aspect 200:1 (accepted)", DEFAULT, format="PNG")
    save(rgb(10, 2000, 12), "aspect_10x2000.png", "aspect 1:200 (accepted)", DEFAULT, format="PNG")
    save(rgb(2010, 10, 13), "aspect_2010x10.png", "aspect 201:1 (refused)", DEFAULT, format="PNG")
    save(rgb(10, 2010, 14), "aspect_10x2010.png", "aspect 1:201 (refused)", DEFAULT, format="PNG")

    # Modes convert("RGB") handles.
    grey = pattern(300, 200, 15)[:, :, 0]
    save(Image.fromarray(grey, "L"), "grey_L_300x200.png", "grey L PNG", format="PNG")
    save(Image.fromarray(pattern(250, 180, 16)[:, :, 1], "L"), "grey_250x180.jpg",
         "greyscale JPEG", format="JPEG", quality=90)
    pal = Image.fromarray(pattern(200, 150, 17)).quantize(colors=200, method=Image.MEDIANCUT,
                                                          dither=Image.NONE)
    pal.info["transparency"] = 3
    save(pal, "palette_P_trns_200x150.png", "palette P with tRNS (ignored)", format="PNG",
         transparency=3)
    rgba = np.dstack([pattern(256, 192, 18), np.random.default_rng(19).integers(0, 256, (192, 256))
                      .astype(np.uint8)])
    rgba[:20, :, 3] = 0  # fully transparent rows keep their colour
    save(Image.fromarray(rgba, "RGBA"), "rgba_256x192.png", "RGBA: alpha dropped", format="PNG")
    la = np.dstack([pattern(160, 120, 20)[:, :, 2], pattern(160, 120, 21)[:, :, 0]])
    save(Image.fromarray(la, "LA"), "la_160x120.png", "LA: alpha dropped", format="PNG")
    save(Image.fromarray(pattern(97, 61, 22)[:, :, 0] > 127).convert("1"), "bilevel_97x61.png",
         "1-bit grey", format="PNG")
    g16 = (np.random.default_rng(23).integers(0, 1024, (100, 200)) *
           (np.arange(200)[None, :] % 3 == 0) + np.arange(200)[None, :] * 300).astype(np.uint16)
    g16[:10, :10] = 65535
    save(Image.fromarray(g16, "I;16"), "grey16_200x100.png", "16-bit grey: clips at 255",
         format="PNG")
    cmyk = np.random.default_rng(24).integers(0, 256, (240, 320, 4)).astype(np.uint8)
    cmyk[:, :, :3] = pattern(320, 240, 25)
    cmyk[:, :, 3] = (np.arange(320)[None, :] * 255 // 319).astype(np.uint8)
    save(Image.fromarray(cmyk, "CMYK"), "cmyk_320x240.jpg", "CMYK JPEG (Adobe)", format="JPEG",
         quality=90)

    # PNG variants assembled by hand.
    r16 = np.random.default_rng(26).integers(0, 65536, (120, 180, 3)).astype(">u2")
    r16[:, :60] = (pattern(60, 120, 27).astype(np.uint16) * 257)
    write("rgb16_180x120.png", png_bytes(180, 120, 16, 2, [r.tobytes() for r in r16]),
          "16-bit RGB: high byte")
    a16 = np.random.default_rng(28).integers(0, 65536, (50, 70, 4)).astype(">u2")
    write("rgba16_70x50.png", png_bytes(70, 50, 16, 6, [r.tobytes() for r in a16]),
          "16-bit RGBA: high byte, alpha dropped")
    la16 = np.random.default_rng(29).integers(0, 65536, (45, 64, 2)).astype(">u2")
    write("la16_64x45.png", png_bytes(64, 45, 16, 4, [r.tobytes() for r in la16]),
          "16-bit grey+alpha: high byte")
    g2 = np.random.default_rng(30).integers(0, 4, (33, 41))
    write("grey2bit_41x33.png", png_bytes(41, 33, 2, 0, [pack_bits(r, 2) for r in g2]),
          "2-bit grey, scaled x85")
    g4 = (np.arange(57)[None, :] + np.arange(39)[:, None]) % 16
    write("grey4bit_57x39.png", png_bytes(57, 39, 4, 0, [pack_bits(r, 4) for r in g4]),
          "4-bit grey, scaled x17")
    idx = np.random.default_rng(31).integers(0, 16, (90, 120))
    plte = bytes(np.random.default_rng(32).integers(0, 256, 30).astype(np.uint8))  # 10 entries
    trns = png_chunk(b"tRNS", bytes([0, 128, 255]))
    write("palette4bit_120x90.png",
          png_bytes(120, 90, 4, 3, [pack_bits(r, 4) for r in idx], png_chunk(b"PLTE", plte) + trns),
          "4-bit palette; indices 10..15 past PLTE read as grey (i,i,i)")
    write("palette1bit_77x40.png",
          png_bytes(77, 40, 1, 3, [pack_bits(r, 1) for r in (pattern(77, 40, 33)[:, :, 0] > 99)],
                    png_chunk(b"PLTE", bytes([200, 10, 30, 5, 180, 250]))),
          "1-bit palette")
    il = pattern(123, 77, 34)
    write("interlaced_123x77.png",
          png_bytes(123, 77, 8, 2, None, interlace=1, scanlines=adam7_scanlines(il)),
          "Adam7-interlaced RGB")

    # EXIF orientation (applied before anything else; W != H shows transposes).
    for o in range(1, 9):
        save(rgb(120, 80, 40 + o), f"exif_o{o}_120x80.jpg", f"JPEG, EXIF orientation {o}",
             format="JPEG", quality=92, exif=exif_bytes(o))
    save(rgb(90, 60, 50), "exif_o6_90x60.png", "PNG eXIf orientation 6", format="PNG",
         exif=exif_bytes(6))
    save(rgb(90, 60, 51), "exif_o8_90x60.webp", "WebP EXIF orientation 8", format="WEBP",
         quality=80, exif=exif_bytes(8))

    # WebP.
    save(rgb(400, 300, 60), "webp_lossy_400x300.webp", "lossy WebP", format="WEBP", quality=75)
    save(rgb(333, 222, 61), "webp_lossless_333x222.webp", "lossless WebP", format="WEBP",
         lossless=True)
    wa = np.dstack([pattern(200, 200, 62), pattern(200, 200, 63)[:, :, 1]])
    save(Image.fromarray(wa, "RGBA"), "webp_alpha_200x200.webp", "lossy WebP with alpha (dropped)",
         format="WEBP", quality=80)
    save(Image.fromarray(wa, "RGBA"), "webp_lossless_alpha_200x200.webp",
         "lossless WebP with alpha (dropped)", format="WEBP", lossless=True, exact=True)

    frames = [rgb(160, 120, 64 + i) for i in range(3)]
    save(frames[0], "webp_animated_160x120.webp", "animated WebP: the first frame",
         format="WEBP", save_all=True, append_images=frames[1:], duration=100, quality=80)

    with open(os.path.join(out_dir, "images.json"), "w") as f:
        json.dump({"images": entries}, f, indent=1)
    print(f"wrote {len(entries)} images to {out_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
