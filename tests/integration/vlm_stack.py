"""The three services on loopback, for the observability tests (Python side).

  with Stack(bins, model_dir, workdir) as stack:
      stack.chat(png_bytes, "What is this?")
      text = stack.scrape("vision")

Each service listens on 127.0.0.1 with ports picked by the kernel (port 0) and
prints "vlm: listening grpc=HOST:PORT metrics=HOST:PORT"; the gateway is
started last, pointed at the backends. Everything is stopped by PID
(SIGTERM, then SIGKILL after a bound). Also: gRPC stubs generated from proto/
with Debian's protoc + grpc_python_plugin, the Prometheus text-format parser,
and the PromQL metric-name extractor shared by the dashboard and e2e tests.
"""
import glob
import importlib
import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import yaml

ROOT = os.environ.get("VLM_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SKIP = 77  # ctest SKIP_RETURN_CODE

SERVICES = ("vision", "language", "gateway")
HEALTH_NAMES = {"vision": "vlm.v1.VisionEncoder", "language": "vlm.v1.Language",
                "gateway": "vlm.v1.VisionLanguage"}
# Series the rules use that the vlm services do not export: Prometheus itself,
# kube-state-metrics, cAdvisor.
EXTERNAL_METRICS = {"up", "kube_pod_container_status_ready", "container_spec_memory_limit_bytes"}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- gRPC stubs ---------------------------------------------------------------

def load_stubs(workdir):
    """Generates and imports vlm.v1 Python stubs; returns the module namespace."""
    out = os.path.join(workdir, "pystubs")
    os.makedirs(out, exist_ok=True)
    protos = sorted(glob.glob(os.path.join(ROOT, "proto", "vlm", "v1", "*.proto")))
    subprocess.run(["protoc", f"--proto_path={os.path.join(ROOT, 'proto')}",
                    f"--python_out={out}", f"--grpc_out={out}",
                    "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin", *protos], check=True)
    for d in ("vlm", os.path.join("vlm", "v1")):
        open(os.path.join(out, d, "__init__.py"), "a").close()
    sys.path.insert(0, out)
    return {name: importlib.import_module(f"vlm.v1.{name}")
            for name in ("common_pb2", "gateway_pb2", "gateway_pb2_grpc")}


def png(width, height, seed):
    """A deterministic RGB PNG (PIL)."""
    from PIL import Image
    img = Image.new("RGB", (width, height))
    img.putdata([((x * 7 + seed * 31) % 256, (y * 5 + seed * 17) % 256, (x * y + seed) % 256)
                 for y in range(height) for x in range(width)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


# --- processes --------------------------------------------------------------------

class Process:
    def __init__(self, name, argv, workdir, env=None):
        self.name = name
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log_file,
                                     env={**os.environ, **(env or {})}, text=True)
        self.pid = self.proc.pid

    def wait_listening(self, timeout):
        """Reads stdout until the 'vlm: listening' line; returns (grpc, metrics) addresses."""
        deadline = time.monotonic() + timeout
        buf = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                buf += line
                m = re.search(r"vlm: listening grpc=(\S+) metrics=(\S+)", line)
                if m:
                    return m.group(1), m.group(2)
        raise RuntimeError(f"{self.name}: no 'vlm: listening' line in {timeout} s:\n{buf}\n{self.tail()}")

    def stop(self, timeout=30):
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log_file.close()
        return self.proc.returncode

    def tail(self, n=40):
        self.log_file.flush()
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


def http_get(url, timeout=5):
    """(status, body) of a GET; status 0 when the server is unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


class Stack:
    def __init__(self, binaries, model_dir, workdir, threads=1):
        self.binaries = binaries
        self.threads = threads
        self.model_dir = model_dir
        self.workdir = workdir
        self.procs = {}
        self.grpc = {}
        self.metrics = {}

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def _start(self, name, extra):
        argv = [self.binaries[name], "--grpc_address=127.0.0.1:0",
                "--metrics_address=127.0.0.1:0", *extra]
        log(f"start {name}: {' '.join(argv)}")
        p = Process(name, argv, self.workdir, env={"OMP_NUM_THREADS": str(self.threads),
                                                   "OMP_WAIT_POLICY": "passive"})
        self.procs[name] = p
        self.grpc[name], self.metrics[name] = p.wait_listening(60)
        log(f"{name} pid {p.pid} grpc={self.grpc[name]} metrics={self.metrics[name]}")

    def start(self):
        backend = [f"--model_dir={self.model_dir}", f"--intra_op_threads={self.threads}"]
        self._start("vision", backend)
        self._start("language", backend)
        self._start("gateway", [f"--vision_targets={self.grpc['vision']}",
                                f"--language_target={self.grpc['language']}",
                                "--http_address=127.0.0.1:0"])
        self.wait_ready(600)

    def wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        for name in ("vision", "language", "gateway"):
            while True:
                status, body = http_get(f"http://{self.metrics[name]}/readyz")
                if status == 200:
                    log(f"{name} ready")
                    break
                if self.procs[name].proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} not ready ({status} {body.strip()}):\n"
                                       f"{self.procs[name].tail()}")
                time.sleep(0.2)

    def stop(self):
        codes = {}
        for name in ("gateway", "language", "vision"):
            if name in self.procs:
                codes[name] = self.procs[name].stop()
        return codes

    def scrape(self, name):
        status, body = http_get(f"http://{self.metrics[name]}/metrics")
        if status != 200:
            raise RuntimeError(f"GET {self.metrics[name]}/metrics: {status}")
        return body


# --- Prometheus text format and PromQL ------------------------------------------------------

SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_exposition(text):
    """{sample name: [(labels, value)]} from the text format 0.0.4."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE_RE.match(line)
        if not m:
            raise ValueError(f"bad exposition line: {line!r}")
        labels = dict(LABEL_RE.findall(m.group(2) or ""))
        samples.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return samples


PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                   "or", "unless", "offset", "inf", "nan", "atan2"}


def promql_metric_names(expr):
    """Metric (and recording rule) names an expression selects.

    Removes strings, label matchers, ranges/subqueries and grouping clauses;
    what is left and is not a function call, keyword or number is a name."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\$\{?[a-zA-Z_]+\}?", " ", e)  # Grafana variables
    e = re.sub(r"(?<![a-zA-Z0-9_:])\d+(\.\d+)?(e[+-]?\d+|ms|[smhdwy])?(?![a-zA-Z0-9_:])", " ", e)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", e):
        word = m.group(0)
        if word.lower() in PROMQL_KEYWORDS:
            continue
        if re.match(r"\s*\(", e[m.end():]):  # function or aggregation
            continue
        names.add(word)
    return names


def dashboard_targets(path):
    """[(panel title, expr)] of every target of every panel, rows included."""
    with open(path) as f:
        dash = json.load(f)
    out = []

    def walk(panels):
        for p in panels:
            if p.get("type") == "row":
                walk(p.get("panels", []))
                continue
            for t in p.get("targets", []):
                out.append((p.get("title"), t.get("expr", "")))
            if not p.get("targets"):
                out.append((p.get("title"), ""))
    walk(dash["panels"])
    return dash, out


def rules(paths=None):
    """(recording rules {name: expr}, alerting rules {name: expr}) of deploy/prometheus/rules."""
    paths = paths or sorted(glob.glob(os.path.join(ROOT, "deploy", "prometheus", "rules", "*.yml")))
    recording, alerting = {}, {}
    for path in paths:
        with open(path) as f:
            for group in yaml.safe_load(f)["groups"]:
                for r in group["rules"]:
                    if "record" in r:
                        recording[r["record"]] = r["expr"]
                    else:
                        alerting[r["alert"]] = r["expr"]
    return recording, alerting


def base_metric_names(names, recording):
    """Expands recording rule names into the raw metric names they read."""
    out, seen = set(), set()
    stack = list(names)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in recording:
            stack.extend(promql_metric_names(recording[n]))
        else:
            out.add(n)
    return out


# --- traffic ----------------------------------------------------------------------

def exercise(stack, stubs, rounds=1):
    """A few chats through the gateway: image A twice (the second a cache hit),
    a text-only chat, a streamed chat with image B, and one invalid request.
    Returns the unary responses."""
    import grpc
    pb, cpb = stubs["gateway_pb2"], stubs["common_pb2"]
    channel = grpc.insecure_channel(stack.grpc["gateway"])
    stub = stubs["gateway_pb2_grpc"].VisionLanguageStub(channel)
    params = cpb.GenerationParams(max_tokens=4, sampling=cpb.SamplingParams(temperature=0))
    image_a, image_b = png(64, 48, 1), png(48, 64, 2)

    def request(parts):
        content = [pb.ContentPart(image=pb.ImagePart(data=p)) if isinstance(p, bytes)
                   else pb.ContentPart(text=p) for p in parts]
        return pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=content)],
                              params=params)

    out = []
    for _ in range(rounds):
        out.append(stub.Chat(request([image_a, "What is in this picture?"]), timeout=120))
        out.append(stub.Chat(request([image_a, "Describe it again."]), timeout=120))
        out.append(stub.Chat(request(["Say hello."]), timeout=120))
        chunks = list(stub.ChatStream(request([image_b, "And this one?"]), timeout=120))
        if not chunks or chunks[-1].finish_reason == 0:
            raise AssertionError(f"ChatStream ended without a finish reason: {chunks[-1:]}")
        try:
            stub.Chat(pb.ChatRequest(messages=[]), timeout=30)
            raise AssertionError("an empty ChatRequest was accepted")
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
    channel.close()
    second = out[1].images[0]
    if second.cache == stubs["common_pb2"].CACHE_LEVEL_MISS:
        raise AssertionError(f"the repeated image was not a cache hit: {second}")
    return out
