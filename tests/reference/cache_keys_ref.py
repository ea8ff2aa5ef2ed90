#!/usr/bin/env python3
"""Regenerates the pinned embedding-cache keys of embedding_cache_test
(EmbeddingCacheKeys.MatchTheDocumentedLayout) from the documented layout in
services/vision/cache_key.h, with Python's hashlib only: an independent
reference for the byte layout of the bytes key and the pixel key.

    /usr/bin/python3 tests/reference/cache_keys_ref.py

Changing a key's layout invalidates every disk tier in the field: bump the
domain string (".v1") when that is intended.
"""
import hashlib
import struct


def le64(v):
    return struct.pack("<q", v) if v < 0 else struct.pack("<Q", v)


def context(min_pixels, max_pixels, fingerprint):
    return le64(min_pixels) + le64(max_pixels) + le64(len(fingerprint)) + fingerprint


def bytes_key(image_bytes, ctx):
    content = hashlib.sha256(image_bytes).digest()
    return hashlib.sha256(b"vlm.embedding_cache.bytes.v1\0" + content + ctx).hexdigest()


def pixel_key(rgb, width, height, ctx):
    return hashlib.sha256(b"vlm.embedding_cache.pixels.v1\0" + le64(width) + le64(height) + ctx +
                          le64(len(rgb)) + rgb).hexdigest()


def main():
    # The test's kContext: min_pixels 3136, max_pixels 12845056, fingerprint "fp-test".
    ctx = context(3136, 12845056, b"fp-test")
    print("KeyForImageBytes(\"hello\")        ", bytes_key(b"hello", ctx))
    print("KeyForPixels(bytes 0..11, 2, 2)  ", pixel_key(bytes(range(12)), 2, 2, ctx))


if __name__ == "__main__":
    main()
