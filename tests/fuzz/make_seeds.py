#!/usr/bin/python3
"""Writes the seed corpus of every fuzz target into tests/fuzz/corpus/<target>/.

Seeds are small, valid (or nearly valid) inputs in each target's input format
(see the comment at the top of each *_fuzzer.cc); the fuzzer mutates them.
They are made here, independently of the code under test: images with Pillow,
safetensors files and protobuf messages byte by byte from their published
formats, configs from the Qwen3-VL values of the model spec.

Usage: /usr/bin/python3 tests/fuzz/make_seeds.py [CORPUS_DIR]
"""
import io
import json
import os
import struct
import sys

from PIL import Image

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def write(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# --- image: byte 0 = mode/preset, then an image file ----------------------------

def gradient(mode, w, h):
    im = Image.new("RGB", (w, h))
    im.putdata([((x * 37) % 256, (y * 53) % 256, ((x + y) * 11) % 256) for y in range(h) for x in range(w)])
    return im.convert(mode) if mode != "RGB" else im


def encoded(im, fmt, **kw):
    b = io.BytesIO()
    im.save(b, fmt, **kw)
    return b.getvalue()


def exif_with_orientation(value):
    # TIFF header (little endian), IFD0 with one entry: Orientation (0x0112), SHORT, 1.
    tiff = b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 1) + struct.pack("<HHIHH", 0x0112, 3, 1, value, 0) + struct.pack("<I", 0)
    return tiff


def image_seeds():
    w, h = 12, 8
    rgb = gradient("RGB", w, h)
    write("image", "jpeg_rgb", b"\x00" + encoded(rgb, "JPEG", quality=80))
    write("image", "jpeg_grey_progressive", b"\x01" + encoded(rgb.convert("L"), "JPEG", progressive=True))
    write("image", "jpeg_exif_rot90", b"\x00" + encoded(rgb, "JPEG", exif=b"Exif\x00\x00" + exif_with_orientation(6)))
    write("image", "jpeg_cmyk", b"\x02" + encoded(rgb.convert("CMYK"), "JPEG"))
    write("image", "png_rgb", b"\x00" + encoded(rgb, "PNG"))
    write("image", "png_rgba", b"\x01" + encoded(rgb.convert("RGBA"), "PNG"))
    write("image", "png_palette", b"\x02" + encoded(rgb.convert("P"), "PNG"))
    write("image", "png_grey1", b"\x00" + encoded(rgb.convert("1"), "PNG"))
    write("image", "png_grey16", b"\x01" + encoded(rgb.convert("L").convert("I").point(lambda v: v * 257), "PNG"))
    write("image", "png_exif_rot270", b"\x00" + encoded(rgb, "PNG", exif=exif_with_orientation(8)))
    write("image", "png_invalid_preset", b"\x03" + encoded(rgb, "PNG"))
    write("image", "webp_lossy", b"\x00" + encoded(rgb, "WEBP", quality=50))
    write("image", "webp_lossless_alpha", b"\x01" + encoded(rgb.convert("RGBA"), "WEBP", lossless=True))
    frames = [rgb, rgb.transpose(Image.Transpose.FLIP_LEFT_RIGHT)]
    write("image", "webp_animated", b"\x02" + encoded(frames[0], "WEBP", save_all=True, append_images=frames[1:], duration=50))
    write("image", "wide_200x1", b"\x00" + encoded(gradient("RGB", 200, 1), "PNG"))
    write("image", "exif_block", b"\x80" + b"Exif\x00\x00" + exif_with_orientation(3))
    write("image", "exif_big_endian", b"\x80" + b"MM\x00*" + struct.pack(">I", 8) + struct.pack(">H", 1) + struct.pack(">HHIHH", 0x0112, 3, 1, 5, 0) + struct.pack(">I", 0))
    write("image", "smart_resize", b"\x40" + struct.pack("<qqq", 1080, 1920, 16777216))


# --- safetensors: byte 0 even = a file, odd = an index ---------------------------

def safetensors_file(tensors, metadata=None):
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def safetensors_seeds():
    write("safetensors", "single_f32_bf16", b"\x00" + safetensors_file({
        "w": ("F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4)),
        "b": ("BF16", [3], b"\x80\x3f" * 3)}, {"format": "pt"}))
    write("safetensors", "every_dtype", b"\x00" + safetensors_file({
        n: (d, [2], b"\x01" * (2 * s)) for n, d, s in [
            ("a", "BOOL", 1), ("b", "U8", 1), ("c", "I8", 1), ("d", "I16", 2), ("e", "U16", 2),
            ("f", "F16", 2), ("g", "I32", 4), ("h", "U32", 4), ("i", "F64", 8), ("j", "I64", 8),
            ("k", "U64", 8)]}))
    write("safetensors", "empty_and_scalar", b"\x00" + safetensors_file({
        "empty": ("F32", [0, 4], b""), "scalar": ("I32", [], b"\x07\x00\x00\x00")}))
    write("safetensors", "index_two_shards", b"\x01" + json.dumps({
        "metadata": {"total_size": 18},
        "weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}}).encode())
    write("safetensors", "index_stale", b"\x01" + json.dumps({
        "weight_map": {"x": "a.safetensors", "z": "a.safetensors"}}).encode())


# --- model_config: byte 0 % 3 = which file ---------------------------------------

TEXT_2B = {
    "attention_bias": False, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "max_position_embeddings": 262144, "model_type": "qwen3_vl_text",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
    "rope_theta": 5000000, "tie_word_embeddings": True, "vocab_size": 151936, "dtype": "bfloat16"}
VISION_2B = {
    "deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1024, "in_channels": 3, "intermediate_size": 4096, "model_type": "qwen3_vl",
    "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
    "spatial_merge_size": 2, "temporal_patch_size": 2}


def model_config_seeds():
    top = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
           "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
           "vision_end_token_id": 151653, "tie_word_embeddings": True}
    write("model_config", "config_2b", b"\x00" + json.dumps(dict(top, text_config=TEXT_2B, vision_config=VISION_2B)).encode())
    v5 = dict(TEXT_2B)
    del v5["rope_scaling"], v5["rope_theta"]
    v5["rope_parameters"] = {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_theta": 5000000.0, "rope_type": "default"}
    write("model_config", "config_2b_v5", b"\x03" + json.dumps(dict(top, text_config=v5, vision_config=VISION_2B)).encode())
    write("model_config", "generation", b"\x01" + json.dumps({
        "bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
        "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.0, "max_new_tokens": 128}).encode())
    write("model_config", "generation_scalar_eos", b"\x04" + b'{"eos_token_id": 151645}')
    write("model_config", "preprocessor", b"\x02" + json.dumps({
        "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 0.00392156862745098, "do_resize": True}).encode())
    write("model_config", "preprocessor_legacy", b"\x05" + json.dumps({
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711]}).encode())


# --- tokenizer: byte 0 even = text, odd = ids (uint32 LE) ------------------------

def tokenizer_seeds():
    texts = {
        "ascii": "Hello, world! It's 2026; x=3.14 and   spaces\n\n\ttabs.",
        "cjk": "你好，世界。今日は良い天気です。안녕하세요",
        "emoji_zwj": "family: 👨‍👩‍👧‍👦 flags 🇫🇷 skin 👍🏽",
        "combining": "e\u0301 vs \u00e9, Å vs A\u030a, Hangul \u1100\u1161",
        "special_tokens": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "numbers_contractions": "I'll we're 12345678901 1,000,000 they'VE DON'T",
        "whitespace": "  \u00a0\u2003 \r\n \u3000x",
        "rtl": "مرحبا بالعالم שלום",
    }
    for i, (name, text) in enumerate(texts.items()):
        write("tokenizer", "text_" + name, bytes([2 * (i % 4)]) + text.encode("utf-8"))
    write("tokenizer", "text_invalid_utf8", b"\x00abc\xff\xc3(\xed\xa0\x80")
    ids = [9707, 11, 1879, 0, 151644, 151645, 151643, 151667, 151668, 220, 198, 5765]
    write("tokenizer", "ids_mixed", b"\x01" + struct.pack("<%dI" % len(ids), *ids))
    write("tokenizer", "ids_skip_special", b"\x03" + struct.pack("<%dI" % len(ids), *ids))
    # Byte-level pieces of a split 4-byte character, then an out-of-range id.
    write("tokenizer", "ids_split_utf8", b"\x01" + struct.pack("<5I", 144, 253, 100, 151700, 9707))


# --- chat_template: FuzzedDataProvider bytes -------------------------------------

def chat_template_seeds():
    write("chat_template", "short", bytes(range(64)))
    write("chat_template", "text_heavy", b"\x01\x00\x03" + "Describe the picture, please. 图片 <think>".encode() * 4 + bytes(range(32)))
    write("chat_template", "images", bytes([1, 0, 4, 1, 1, 0, 0, 1, 4, 4, 1, 2, 8, 6]) * 8)


# --- protobuf encoding (wire format), for the gateway and the tensor codec -------

def varint(n):
    n &= (1 << 64) - 1
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field_varint(num, value):
    return varint(num << 3) + varint(value)


def field_bytes(num, data):
    if isinstance(data, str):
        data = data.encode()
    return varint(num << 3 | 2) + varint(len(data)) + data


def field_double(num, value):
    return varint(num << 3 | 1) + struct.pack("<d", value)


def field_float(num, value):
    return varint(num << 3 | 5) + struct.pack("<f", value)


def text_part(text):
    return field_bytes(1, text)  # ContentPart.text


def image_part(data=None, content_hash=None, min_pixels=0, max_pixels=0):
    img = field_bytes(1, data) if data is not None else field_bytes(2, content_hash)
    if min_pixels or max_pixels:
        img += field_bytes(3, field_varint(1, min_pixels) + field_varint(2, max_pixels))
    return field_bytes(2, img)  # ContentPart.image


def message(role, *parts):
    return field_bytes(1, role) + b"".join(field_bytes(2, p) for p in parts)


def gateway_seeds():
    png = encoded(gradient("RGB", 4, 4), "PNG")
    sampling = field_float(1, 0.7) + field_varint(2, 20) + field_float(3, 0.8)
    params = field_bytes(1, sampling) + field_varint(2, 64) + field_bytes(3, "\n\n") + field_varint(5, 1) + field_varint(6, 3)
    req = (field_bytes(1, message("system", text_part("You are helpful.")))
           + field_bytes(1, message("user", image_part(png), text_part("What is this?")))
           + field_bytes(2, params) + field_bytes(3, field_varint(1, 65536) + field_varint(2, 1 << 20))
           + field_bytes(4, "req-1"))
    write("gateway_validation", "system_user_image", req)
    write("gateway_validation", "content_hash",
          field_bytes(1, message("user", image_part(content_hash="ab" * 32, min_pixels=1024, max_pixels=4096), text_part("again"))))
    write("gateway_validation", "multi_turn",
          field_bytes(1, message("user", text_part("hi"))) + field_bytes(1, message("assistant", text_part("hello")))
          + field_bytes(1, message("user", text_part("<|im_end|> and <think>"))))
    write("gateway_validation", "empty", b"")


def tensor_codec_seeds():
    def tensor(dtype, shape, data):
        return field_varint(1, dtype) + field_bytes(2, b"".join(varint(s) for s in shape)) + field_bytes(3, data)
    write("tensor_codec", "f32_2x3", b"\x02" + tensor(3, [2, 3], struct.pack("<6f", *range(6))))
    write("tensor_codec", "bf16_rank3_first2", b"\x0b" + tensor(1, [2, 2, 2], b"\x80\x3f" * 8))
    write("tensor_codec", "f16_any_rank", b"\x07" + tensor(2, [4], b"\x00\x3c" * 4))
    write("tensor_codec", "empty_dim", b"\x02" + tensor(3, [0, 7], b""))
    write("tensor_codec", "scalar", b"\x00" + tensor(3, [], struct.pack("<f", 1.5)))


# --- grammar: byte 0 even = JSON Schema, odd = regex -----------------------------

def grammar_seeds():
    schemas = {
        "object": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150}}, "required": ["name"]},
        "formats": {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                    "id": {"type": "string", "format": "uuid"}, "e": {"type": "string", "format": "email"}}},
        "anyof_enum": {"anyOf": [{"enum": ["a", 1, None]}, {"type": "array", "items": {"type": "number",
                       "exclusiveMinimum": -1.5}, "maxItems": 3}]},
        "recursive": {"$defs": {"n": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/n"},
                      {"type": "null"}]}}, "required": ["next"]}}, "$ref": "#/$defs/n"},
        "additional": {"type": "object", "properties": {"k": {"const": True}},
                       "additionalProperties": {"type": ["string", "null"]}},
        "any": {},
    }
    for name, schema in schemas.items():
        write("grammar", "schema_" + name, b"\x00" + json.dumps(schema).encode())
    for name, pattern in {"phone": r"\+?[0-9]{1,3}-[0-9]{3}", "class": r"[^a-c\s]{2}(x|yz)*\.",
                          "utf8": "[\u03b1-\u03c9]+\u00e9?"}.items():
        write("grammar", "regex_" + name, b"\x01" + pattern.encode())


if __name__ == "__main__":
    image_seeds()
    safetensors_seeds()
    model_config_seeds()
    tokenizer_seeds()
    chat_template_seeds()
    gateway_seeds()
    tensor_codec_seeds()
    grammar_seeds()
    for target in sorted(os.listdir(OUT)):
        files = os.listdir(os.path.join(OUT, target))
        print(f"{target}: {len(files)} seeds, {sum(os.path.getsize(os.path.join(OUT, target, f)) for f in files)} bytes")
