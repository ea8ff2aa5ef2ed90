#!/usr/bin/python3
"""Measures each service's resident memory, to size Kubernetes requests/limits.

  deploy/measure_memory.py --build-dir build --model ~/.cache/vlm/checkpoints/2b \
      [--image-size 448] [--chats 3] [--threads 2]

Starts vlm-vision, vlm-language and vlm-gateway on loopback (the same launcher
as the observability tests), reads vlm_process_resident_memory_bytes and
vlm_process_peak_resident_memory_bytes from each /metrics at SERVING, after one
chat with an image, and after --chats chats with distinct images plus one
repeat, and prints a table (MiB). k8s/README.md records the numbers and the
limits derived from them.
"""
import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "integration"))
import vlm_stack as v  # noqa: E402


def memory(stack):
    out = {}
    for s in v.SERVICES:
        samples = v.parse_exposition(stack.scrape(s))
        out[s] = (samples["vlm_process_resident_memory_bytes"][0][1] / 2**20,
                  samples["vlm_process_peak_resident_memory_bytes"][0][1] / 2**20)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--chats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    b = args.build_dir
    binaries = {"vision": f"{b}/services/vision/vlm-vision",
                "language": f"{b}/services/language/vlm-language",
                "gateway": f"{b}/services/gateway/vlm-gateway"}
    import grpc
    rows = []
    with tempfile.TemporaryDirectory(prefix="vlm-mem-") as work:
        stubs = v.load_stubs(work)
        pb, cpb = stubs["gateway_pb2"], stubs["common_pb2"]
        stack = v.Stack(binaries, args.model, work, threads=args.threads)
        t0 = time.monotonic()
        with stack:
            rows.append((f"SERVING ({time.monotonic() - t0:.1f} s after start)", memory(stack)))
            channel = grpc.insecure_channel(stack.grpc["gateway"])
            chat = stubs["gateway_pb2_grpc"].VisionLanguageStub(channel).Chat
            params = cpb.GenerationParams(max_tokens=args.max_tokens,
                                          sampling=cpb.SamplingParams(temperature=0))
            n = args.image_size
            for i in range(args.chats + 1):
                image = v.png(n, n, i % args.chats)  # the last one repeats image 0
                started = time.monotonic()
                r = chat(pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=[
                    pb.ContentPart(image=pb.ImagePart(data=image)),
                    pb.ContentPart(text="Describe this picture in one sentence.")])],
                    params=params), timeout=1800)
                label = (f"after chat {i + 1} ({n}x{n}, {r.usage.prompt_tokens} prompt + "
                         f"{r.usage.completion_tokens} tokens, {time.monotonic() - started:.1f} s, "
                         f"cache {cpb.CacheLevel.Name(r.images[0].cache)})")
                if i == 0 or i == args.chats:
                    rows.append((label, memory(stack)))
                v.log(label)
            channel.close()
    print(f"\nmodel {args.model}; RSS / peak RSS in MiB\n")
    print(f"| {'point':70s} | " + " | ".join(f"{s:>17s}" for s in v.SERVICES) + " |")
    print(f"|{'-' * 72}|" + "|".join("-" * 19 for _ in v.SERVICES) + "|")
    for label, mem in rows:
        print(f"| {label:70s} | " + " | ".join(f"{mem[s][0]:7.0f} / {mem[s][1]:7.0f}"
                                                for s in v.SERVICES) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
