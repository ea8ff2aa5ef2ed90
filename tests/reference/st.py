"""Minimal safetensors reader/writer for the Python references (no `safetensors` package).

Format (docs/qwen3-vl-model.md §2): 8-byte little-endian header length n, n bytes of
JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the raw little-endian data; offsets count from the first byte after the header.
A model directory holds model.safetensors or shards listed by model.safetensors.index.json.
"""
import json
import os
import struct

import torch

_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
    "F32": torch.float32, "F64": torch.float64,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def read_file(path):
    """Returns ({name: tensor}, metadata) for one .safetensors file (tensors are copies)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n].decode("utf-8"))
    base = 8 + n
    metadata = header.pop("__metadata__", {}) or {}
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        shape = list(info["shape"])
        raw = bytearray(data[base + begin:base + end])  # writable copy for frombuffer
        if end == begin:
            t = torch.empty(shape, dtype=dtype)
        else:
            t = torch.frombuffer(raw, dtype=dtype).reshape(shape)
        tensors[name] = t
    return tensors, metadata


def read_checkpoint(path):
    """{name: tensor} of a model directory (single file or shards) or one file."""
    if os.path.isfile(path):
        return read_file(path)[0]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(read_file(os.path.join(path, shard))[0])
        return tensors
    return read_file(os.path.join(path, "model.safetensors"))[0]


def write_file(path, tensors, metadata=None):
    """Writes {name: tensor} (contiguous little-endian copies) to one file, atomically."""
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = path + ".tmp.%d" % os.getpid()
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)
    os.replace(tmp, path)
