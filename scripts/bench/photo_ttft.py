#!/usr/bin/python3
"""Time to first token for a phone photo (4000x3000 JPEG) on the 2B shapes.

    /usr/bin/python3 scripts/bench/photo_ttft.py [--model_dir DIR] [--build_dir build]
        [--runs 1] [--threads 0] [--keep]

Starts vlm-vision, vlm-language and vlm-gateway on loopback (default flags, as
serve.sh starts them, plus vision --max_pixels_limit=1048576 so that detail
"high" means 1 MP, and no gateway deadline), then sends 4000x3000 JPEGs
through the OpenAI HTTP API with max_tokens 1, each picture new to the vision
cache (cold):

    default   no options: the service's default budget (0.5 MP)
    low       detail "low" (512x512 budget)
    1 MP      detail "high" (up to the vision limit, 1048576 here)

and prints, per request, the client-side time to the (only) token and its
split: JPEG decode, resize + patchify, ViT (vision service histograms, read
before and after), the vision phase as the gateway saw it, projector and
prefill (x_vlm.timings_ms). The first request also pays any first-use cost of
the language model (its weights are mapped lazily); it is printed as its own
row ("default, first request") before the rows proper.

The checkpoint defaults to ~/.cache/vlm/checkpoints/2b, made with
`vlm-make-checkpoint --preset 2b` when missing (4.3 GB, random weights, the
real shapes). Needs python3-pil (scripts/setup.sh installs it).
"""
import argparse
import base64
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def photo(seed, width=4000, height=3000):
    """A 4000x3000 JPEG (quality 90) that differs for every seed: gradients,
    waves and noise, about what a phone's 12 MP picture costs to decode."""
    from PIL import Image, ImageChops
    g = Image.radial_gradient("L").resize((width, height))
    lin = Image.linear_gradient("L").resize((width, height)).rotate(seed * 37 % 360)
    noise = Image.effect_noise((width, height), 8 + seed % 4)
    img = Image.merge("RGB", (g, ImageChops.add(lin, noise, 2.0), noise))
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=90)
    return out.getvalue()


def metrics(url):
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        m = re.match(r"^(vlm_vision_(?:decode|preprocess|encode)_seconds_(?:sum|count))"
                     r"(?:\{[^}]*\})? (\S+)", line)
        if m:
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
    return values


class Stack:
    def __init__(self, build, model, threads, work):
        self.procs = []
        self.work = work
        common = ["--grpc_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0"]
        backend = [f"--model_dir={model}"] + ([f"--intra_op_threads={threads}"] if threads else [])
        self.vision = self.start("vision", f"{build}/services/vision/vlm-vision",
                                 common + backend + ["--max_pixels_limit=1048576"])
        self.language = self.start("language", f"{build}/services/language/vlm-language",
                                   common + backend + ["--max_message_mb=1024"])
        self.gateway = self.start("gateway", f"{build}/services/gateway/vlm-gateway",
                                  common + ["--http_address=127.0.0.1:0", f"--model_dir={model}",
                                            "--default_deadline_s=0",  # a loaded machine is slow
                                            f"--vision_targets={self.vision['grpc']}",
                                            f"--language_target={self.language['grpc']}"])
        http = self.wait_line(self.gateway, r"vlm: http=(\S+)", 30)
        self.http = f"http://{http.group(1)}"
        deadline = time.time() + 1800
        while True:
            try:
                if urllib.request.urlopen(self.http + "/health", timeout=5).status == 200:
                    break
            except Exception:
                pass
            if time.time() > deadline:
                raise RuntimeError("not SERVING within 30 min; logs in " + work)
            time.sleep(0.5)

    def start(self, name, binary, args):
        out = open(os.path.join(self.work, name + ".out"), "w")
        err = open(os.path.join(self.work, name + ".log"), "w")
        p = subprocess.Popen([binary] + args, stdout=out, stderr=err)
        proc = {"name": name, "proc": p, "out": out.name}
        self.procs.append(proc)
        m = self.wait_line(proc, r"vlm: listening grpc=(\S+) metrics=(\S+)", 1800)
        proc["grpc"], proc["metrics"] = m.group(1), "http://" + m.group(2)
        return proc

    @staticmethod
    def wait_line(proc, regex, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            with open(proc["out"]) as f:
                m = re.search(regex, f.read())
            if m:
                return m
            if proc["proc"].poll() is not None:
                raise RuntimeError(f"{proc['name']} exited {proc['proc'].returncode}")
            time.sleep(0.1)
        raise RuntimeError(f"{proc['name']}: no {regex} within {timeout} s")

    def stop(self):
        for proc in reversed(self.procs):
            p = proc["proc"]
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


def ask(stack, jpeg, detail):
    image_url = {"url": "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()}
    if detail:
        image_url["detail"] = detail
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": image_url},
        {"type": "text", "text": "What is in this picture?"}]}],
        "max_tokens": 1, "temperature": 0}
    before = metrics(stack.vision["metrics"])
    request = urllib.request.Request(stack.http + "/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    t0 = time.time()
    try:
        reply = json.loads(urllib.request.urlopen(request, timeout=3600).read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read().decode(errors='replace')}") from None
    ttft = time.time() - t0
    after = metrics(stack.vision["metrics"])
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    x = reply["x_vlm"]
    image = x["images"][0]
    t = x["timings_ms"]
    return {
        "ttft_s": ttft,
        "grid": "x".join(str(v) for v in image["grid"][1:]),
        "tokens": image["tokens"],
        "prompt_tokens": reply["usage"]["prompt_tokens"],
        "max_pixels": image["max_pixels"],
        "decode_ms": 1e3 * delta.get("vlm_vision_decode_seconds_sum", 0),
        "resize_ms": 1e3 * delta.get("vlm_vision_preprocess_seconds_sum", 0),
        "vit_ms": 1e3 * delta.get("vlm_vision_encode_seconds_sum", 0),
        "vision_ms": t["vision"],
        "projector_ms": t["projector"],
        "prefill_ms": t["prefill"],
        "first_token_ms": t["first_token"],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_dir", default=os.path.join(
        os.environ.get("VLM_CACHE_DIR", os.path.expanduser("~/.cache/vlm")), "checkpoints", "2b"))
    ap.add_argument("--build_dir", default=os.path.join(ROOT, "build"))
    ap.add_argument("--runs", type=int, default=1,
                    help="cold requests per row (each a new picture)")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: the services' default)")
    ap.add_argument("--keep", action="store_true", help="keep the logs' folder")
    args = ap.parse_args()
    build = os.path.abspath(args.build_dir)
    if not os.path.exists(os.path.join(args.model_dir, "config.json")):
        print(f"making the 2b-shape checkpoint in {args.model_dir} (4.3 GB) ...", flush=True)
        subprocess.run([f"{build}/scripts/vlm-make-checkpoint", "--preset", "2b",
                        "--out", args.model_dir], check=True)
    work = tempfile.mkdtemp(prefix="vlm-photo-ttft-")
    first = photo(0)
    pictures = iter([first] + [photo(seed) for seed in range(1, 1 + 3 * args.runs)])
    t0 = time.time()
    stack = Stack(build, args.model_dir, args.threads, work)
    print(f"stack SERVING after {time.time() - t0:.1f} s (logs: {work})")
    print(f"model {args.model_dir}; 4000x3000 JPEG ({len(first) >> 10} KiB), max_tokens 1, "
          "each picture new to the cache; ms unless noted\n")
    rows = [("default, first request", None)]
    for _ in range(args.runs):
        rows += [("default (0.5 MP)", None), ("detail low", "low"), ("1 MP (detail high)", "high")]
    print("| request | max_pixels | grid | image tokens | prompt tokens | TTFT s | decode JPEG | "
          "resize | ViT | vision (gateway) | projector | prefill | first token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        for name, detail in rows:
            r = ask(stack, next(pictures), detail)
            print(f"| {name} | {r['max_pixels']} | {r['grid']} | {r['tokens']} | {r['prompt_tokens']} | "
                  f"{r['ttft_s']:.2f} | {r['decode_ms']:.0f} | {r['resize_ms']:.0f} | {r['vit_ms']:.0f} | "
                  f"{r['vision_ms']:.0f} | {r['projector_ms']:.0f} | {r['prefill_ms']:.0f} | "
                  f"{r['first_token_ms']:.0f} |", flush=True)
    finally:
        stack.stop()
        if not args.keep:
            subprocess.run(["rm", "-rf", work])
    return 0


if __name__ == "__main__":
    sys.exit(main())
