#!/usr/bin/python3
"""Mixed traffic against a running gateway for scripts/soak.sh, with a report
every minute and a verdict at the end.

Traffic (WORKERS threads, each picking a kind per request, every call with a deadline):
  text      text-only chat, streamed                          expects OK
  new_image chat with an image never sent before               expects OK
  repeat    chat with one of a few images sent before          expects OK (cache hits)
  cancel    streamed chat cancelled after its first chunk      expects CANCELLED
  bad       invalid requests (no messages, undecodable image,
            temperature out of range)                          expects INVALID_ARGUMENT

Every minute: requests by kind and status, latency percentiles (ms, successful
requests), and each service's resident memory and start time read from its
/metrics. Fails (exit 1) if
  - a request is lost: no final status by its deadline + LOST_GRACE_S,
  - a request ends with a status its kind does not expect,
  - a service restarts (vlm_process_start_time_seconds changes) or /metrics stops answering,
  - after the warm-up, a service's RSS exceeds its value at the end of the
    warm-up by more than max(RSS_GROWTH_FRACTION, RSS_GROWTH_MIB).

Usage: soak_driver.py --gateway HOST:PORT --metrics vision=HOST:PORT --metrics ...
                      --minutes N --stubs DIR [--workers 3] [--warmup-minutes M]
"""
import argparse
import collections
import glob
import importlib
import io
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request

LOST_GRACE_S = 15
RSS_GROWTH_FRACTION = 0.10
RSS_GROWTH_MIB = 32
DEADLINE_S = 60
RSS_SAMPLE_S = 10  # RSS and start times are read this often; reports come every minute
KINDS = ("text", "new_image", "repeat", "cancel", "bad")
WEIGHTS = (3, 2, 3, 1, 1)
EXPECTED = {"text": "OK", "new_image": "OK", "repeat": "OK", "cancel": "CANCELLED",
            "cancel_late": "OK", "bad": "INVALID_ARGUMENT"}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S', time.gmtime())} UTC] {msg}", flush=True)


def load_stubs(proto_root, out):
    os.makedirs(out, exist_ok=True)
    protos = sorted(glob.glob(os.path.join(proto_root, "vlm", "v1", "*.proto")))
    subprocess.run(["protoc", f"--proto_path={proto_root}", f"--python_out={out}",
                    f"--grpc_out={out}", "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin",
                    *protos], check=True)
    for d in ("vlm", os.path.join("vlm", "v1")):
        open(os.path.join(out, d, "__init__.py"), "a").close()
    sys.path.insert(0, out)
    return (importlib.import_module("vlm.v1.gateway_pb2"),
            importlib.import_module("vlm.v1.common_pb2"),
            importlib.import_module("vlm.v1.gateway_pb2_grpc"))


def png(seed):
    """A deterministic PNG, 48..160 pixels a side, different for every seed."""
    from PIL import Image
    rng = random.Random(seed)
    w, h = rng.randrange(48, 161, 16), rng.randrange(48, 161, 16)
    img = Image.frombytes("RGB", (w, h), bytes(rng.getrandbits(8) for _ in range(w * h * 3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def scrape(address):
    """{metric: value} of the unlabelled series of a /metrics page; None if unreachable."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def percentile(values, q):
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class Driver:
    def __init__(self, args, stubs):
        import grpc
        self.grpc = grpc
        self.pb, self.cpb, pbg = stubs
        self.channel = grpc.insecure_channel(args.gateway, options=[
            ("grpc.max_receive_message_length", -1)])
        self.stub = pbg.VisionLanguageStub(self.channel)
        self.lock = threading.Lock()
        self.counts = collections.Counter()       # (kind, code) -> n
        self.latency = collections.defaultdict(list)  # kind -> ms of OK requests
        self.inflight = {}                         # id -> (kind, start)
        self.lost = []
        self.unexpected = []
        self.next_id = 0
        self.stop = threading.Event()
        self.repeat_pool = [png(10_000_000 + i) for i in range(4)]
        self.new_seed = 0

    def request(self, parts, max_tokens, temperature=0.0):
        content = [self.pb.ContentPart(image=self.pb.ImagePart(data=p)) if isinstance(p, bytes)
                   else self.pb.ContentPart(text=p) for p in parts]
        return self.pb.ChatRequest(
            messages=[self.pb.ChatMessage(role="user", content=content)],
            params=self.cpb.GenerationParams(
                max_tokens=max_tokens,
                sampling=self.cpb.SamplingParams(temperature=temperature)))

    def one(self, rng):
        kind = rng.choices(KINDS, WEIGHTS)[0]
        with self.lock:
            rid = self.next_id
            self.next_id += 1
            self.inflight[rid] = (kind, time.monotonic())
            if kind == "new_image":
                self.new_seed += 1
                seed = self.new_seed
        code = "OK"
        start = time.monotonic()
        try:
            if kind == "text":
                for _ in self.stub.ChatStream(self.request(["Tell me something."],
                                                           rng.randint(4, 24)),
                                              timeout=DEADLINE_S):
                    pass
            elif kind == "new_image":
                self.stub.Chat(self.request([png(seed), "What is this?"], 4), timeout=DEADLINE_S)
            elif kind == "repeat":
                self.stub.Chat(self.request([rng.choice(self.repeat_pool), "Again?"], 4),
                               timeout=DEADLINE_S)
            elif kind == "cancel":
                call = self.stub.ChatStream(self.request(["Talk for a long time."], 200),
                                            timeout=DEADLINE_S)
                for _ in call:
                    # False if the stream had already ended: then it ends OK.
                    if not call.cancel():
                        kind = "cancel_late"
                    break
                for _ in call:  # raises CANCELLED
                    pass
            else:  # bad
                bad = rng.randrange(3)
                if bad == 0:
                    req = self.pb.ChatRequest(messages=[])
                elif bad == 1:
                    req = self.request([b"\x89PNG not really an image", "What?"], 4)
                else:
                    req = self.request(["Hi."], 4, temperature=-1.0)
                self.stub.Chat(req, timeout=DEADLINE_S)
        except self.grpc.RpcError as e:
            code = e.code().name
        except Exception as e:  # noqa: BLE001 - anything else is a finding, not a crash
            code = f"EXCEPTION:{type(e).__name__}"
        ms = (time.monotonic() - start) * 1000
        with self.lock:
            self.inflight.pop(rid, None)
            self.counts[(kind, code)] += 1
            if code == "OK":
                self.latency[kind].append(ms)
            if code != EXPECTED[kind]:
                self.unexpected.append((kind, code))

    def worker(self, index):
        rng = random.Random(index)
        while not self.stop.is_set():
            self.one(rng)

    def check_lost(self):
        now = time.monotonic()
        with self.lock:
            for rid, (kind, start) in list(self.inflight.items()):
                if now - start > DEADLINE_S + LOST_GRACE_S:
                    self.lost.append((rid, kind))
                    del self.inflight[rid]

    def table(self):
        with self.lock:
            codes = sorted({c for (_, c) in self.counts})
            lines = ["kind       " + "".join(f"{c:>18}" for c in codes) +
                     "      p50 ms   p90 ms   p99 ms"]
            for kind in KINDS + ("cancel_late",):
                if kind == "cancel_late" and not any(k == kind for (k, _) in self.counts):
                    continue
                lat = self.latency[kind]
                lines.append(f"{kind:<11}" + "".join(f"{self.counts[(kind, c)]:>18}" for c in codes)
                             + f"{percentile(lat, 0.5):>11.0f}{percentile(lat, 0.9):>9.0f}"
                             f"{percentile(lat, 0.99):>9.0f}")
            total = sum(self.counts.values())
            lines.append(f"total {total} requests, {len(self.inflight)} in flight, "
                         f"{len(self.lost)} lost, {len(self.unexpected)} unexpected statuses")
        return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gateway", required=True)
    ap.add_argument("--metrics", action="append", default=[], help="name=host:port")
    ap.add_argument("--minutes", type=float, required=True)
    ap.add_argument("--warmup-minutes", type=float, default=None)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--stubs", required=True)
    ap.add_argument("--proto", required=True)
    args = ap.parse_args()
    warmup = args.warmup_minutes if args.warmup_minutes is not None else min(
        2.0, max(0.5, args.minutes / 5))
    metrics = dict(m.split("=", 1) for m in args.metrics)
    driver = Driver(args, load_stubs(args.proto, args.stubs))

    start_times = {}
    rss = collections.defaultdict(list)  # name -> [(minute, MiB)]
    failures = []

    def sample(minute):
        for name, address in metrics.items():
            m = scrape(address)
            if m is None or "vlm_process_resident_memory_bytes" not in m:
                failures.append(f"{name}: /metrics at {address} did not answer at minute {minute:.1f}")
                continue
            started = m.get("vlm_process_start_time_seconds")
            if name in start_times and started != start_times[name]:
                failures.append(f"{name} restarted (start time {start_times[name]} -> {started})")
            start_times[name] = started
            rss[name].append((minute, m["vlm_process_resident_memory_bytes"] / 2**20))

    sample(0.0)
    log(f"soak: {args.minutes} min, warm-up {warmup} min, {args.workers} workers, "
        f"deadline {DEADLINE_S} s; RSS bound after warm-up: +max({RSS_GROWTH_FRACTION:.0%}, "
        f"{RSS_GROWTH_MIB} MiB)")
    threads = [threading.Thread(target=driver.worker, args=(i,), daemon=True)
               for i in range(args.workers)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    next_report = t0 + 60
    next_sample = t0 + RSS_SAMPLE_S
    while time.monotonic() < end:
        time.sleep(1)
        driver.check_lost()
        now = time.monotonic()
        if now >= next_sample:
            sample((now - t0) / 60)
            next_sample += RSS_SAMPLE_S
        if now >= next_report or now >= end:
            minute = (now - t0) / 60
            log(f"minute {minute:.1f}\n{driver.table()}\nRSS MiB: " + ", ".join(
                f"{n} {v[-1][1]:.0f}" for n, v in rss.items() if v))
            next_report += 60
    driver.stop.set()
    join_until = time.monotonic() + DEADLINE_S + LOST_GRACE_S
    for t in threads:
        t.join(max(0, join_until - time.monotonic()))
    driver.check_lost()
    with driver.lock:
        for rid, (kind, start) in driver.inflight.items():
            driver.lost.append((rid, kind))
    sample(args.minutes)

    print("\n=== soak summary ===")
    print(driver.table())
    print(f"\n{'service':<10}{'start':>9}{'warm-up end':>13}{'end':>9}{'peak':>9}{'bound':>9}  (RSS MiB)")
    for name, values in rss.items():
        warm = [v for (m, v) in values if m <= warmup + 1e-9]
        after = [v for (m, v) in values if m > warmup + 1e-9]
        base = warm[-1]
        bound = base + max(base * RSS_GROWTH_FRACTION, RSS_GROWTH_MIB)
        peak_after = max(after) if after else base
        print(f"{name:<10}{values[0][1]:>9.0f}{base:>13.0f}{values[-1][1]:>9.0f}"
              f"{max(v for _, v in values):>9.0f}{bound:>9.0f}")
        if peak_after > bound:
            failures.append(f"{name}: RSS {peak_after:.0f} MiB after the warm-up exceeds the "
                            f"bound {bound:.0f} MiB")
    if driver.lost:
        failures.append(f"{len(driver.lost)} requests lost (no final status): {driver.lost[:5]}")
    if driver.unexpected:
        failures.append(f"{len(driver.unexpected)} unexpected statuses: "
                        f"{collections.Counter(driver.unexpected).most_common(5)}")
    if sum(driver.counts.values()) == 0:
        failures.append("no request completed")
    if failures:
        print("\nSOAK FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("\nSOAK PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
