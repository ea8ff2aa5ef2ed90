#!/usr/bin/python3
"""End to end: the three services and a real Prometheus scraping them.

  observability_e2e_test.py --vision BIN --language BIN --gateway BIN --model DIR
                            [--prometheus /usr/bin/prometheus] [--promtool /usr/bin/promtool]

Starts the services on loopback (tiny checkpoint), then Debian's Prometheus on
loopback with temporary storage and a config made from
deploy/prometheus/prometheus.yml (same jobs, labels and rule files; targets
replaced by the services' metrics ports, 1 s scrape and rule intervals). Sends
chats (a repeated image, a stream, an invalid request), then asks Prometheus's
HTTP API for the load-time, memory, cache-hit, time-to-first-token and request
series and for every recording rule, checks that every rule evaluates without
error, and evaluates every dashboard query. Everything is stopped by PID.
Exits 77 (ctest: skipped) when a service binary is missing.
"""
import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse

import yaml

import vlm_stack as v

failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print(f"  FAIL: {msg}")
    return cond


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, binary, config, workdir):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(workdir, "prometheus.log")
        self.log = open(self.log_path, "w")
        argv = [binary, f"--config.file={config}",
                f"--storage.tsdb.path={os.path.join(workdir, 'tsdb')}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h", "--log.level=warn"]
        v.log("start prometheus: " + " ".join(argv))
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while v.http_get(self.url + "/-/ready")[0] != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready:\n{self.tail()}")
            time.sleep(0.2)
        v.log(f"prometheus pid {self.proc.pid} ready on {self.url}")

    def api(self, path, **params):
        status, body = v.http_get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}")
        if status != 200:
            raise RuntimeError(f"GET /api/v1/{path} {params}: {status} {body[:500]}")
        reply = json.loads(body)
        if reply["status"] != "success":
            raise RuntimeError(f"/api/v1/{path} {params}: {reply}")
        return reply["data"]

    def query(self, expr):
        """[(labels, value)] of an instant query."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def wait_for(self, expr, ok, timeout, what):
        """Polls `expr` until ok(result) or the timeout; returns the last result."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if ok(result) or time.monotonic() > deadline:
                check(ok(result), f"{what}: {expr} -> {result}")
                return result
            time.sleep(0.5)

    def stop(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()

    def tail(self, n=30):
        self.log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])


def make_config(stack, work, promtool):
    """deploy/prometheus/prometheus.yml with loopback targets and 1 s intervals."""
    src = os.path.join(v.ROOT, "deploy", "prometheus", "prometheus.yml")
    with open(src) as f:
        config = yaml.safe_load(f)
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [os.path.join(os.path.dirname(src), r) for r in config["rule_files"]]
    jobs = []
    for job in config["scrape_configs"]:
        service = job["job_name"].removeprefix("vlm-")
        if service in v.SERVICES:
            job["static_configs"][0]["targets"] = [stack.metrics[service]]
            check(job["static_configs"][0]["labels"] == {"service": service},
                  f"prometheus.yml job {job['job_name']} labels service={service}")
            jobs.append(job)
    check(len(jobs) == 3, "prometheus.yml scrapes vision, language and gateway")
    config["scrape_configs"] = jobs
    path = os.path.join(work, "prometheus.yml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    out = subprocess.run([promtool, "check", "config", path], capture_output=True, text=True)
    check(out.returncode == 0, f"promtool check config (test copy): {out.stdout}{out.stderr}")
    return path


def finite(x):
    return not math.isnan(x) and not math.isinf(x)


def by_service(result):
    return {labels.get("service"): value for labels, value in result}


def run_checks(prom, stack, n_chats):
    services = set(v.SERVICES)
    # Wait until every service's last scrape includes all the traffic, then
    # for two rule evaluations on top of it.
    at_least = lambda n: (lambda r: bool(r) and r[0][1] >= n)  # noqa: E731
    prom.wait_for('sum(vlm_grpc_server_handled_total{service="gateway",grpc_code="OK"})',
                  at_least(n_chats), 30, "gateway OK chats scraped")
    prom.wait_for('sum(vlm_grpc_server_handled_total{service="language",grpc_code="OK"})',
                  at_least(n_chats), 30, "language Generate calls scraped")
    prom.wait_for("sum(vlm_vision_cache_hits_total)", at_least(n_chats // 4 * 2), 30,
                  "vision cache hits scraped (the repeated images)")
    time.sleep(2.5)
    prom.wait_for("vlm:language_generated_tokens:rate5m", lambda r: r and r[0][1] > 0, 30,
                  "tokens/s recording rule > 0")

    # Load time per phase: both model services, plausible values.
    load = prom.query("vlm_model_load_seconds")
    phases = {(l["service"], l["phase"]): x for l, x in load}
    print(f"  load phases: {json.dumps({f'{s}/{p}': round(x, 4) for (s, p), x in sorted(phases.items())})}")
    for s in ("vision", "language"):
        mine = {p: x for (svc, p), x in phases.items() if svc == s}
        check(mine, f"{s} reports load phases")
        check(all(0 <= x < 120 for x in mine.values()), f"{s} load phases in [0, 120) s: {mine}")
    check(any(x > 0 for x in phases.values()), "some load phase took measurable time")
    load_max = prom.query("vlm:model_load_seconds:max")
    check({l.get("service") for l, _ in load_max} >= {"vision", "language"},
          f"vlm:model_load_seconds:max per service: {load_max}")

    # Memory: resident and peak of every service, peak >= resident, sane sizes.
    rss = by_service(prom.query("vlm_process_resident_memory_bytes"))
    peak = by_service(prom.query("vlm_process_peak_resident_memory_bytes"))
    print(f"  resident MB: { {s: round(x / 2**20, 1) for s, x in rss.items()} } "
          f"peak MB: { {s: round(x / 2**20, 1) for s, x in peak.items()} }")
    check(set(rss) == services and set(peak) == services, "memory series of all three services")
    for s in services & set(rss) & set(peak):
        check(2**20 < rss[s] < 16 * 2**30, f"{s} resident {rss[s]} bytes plausible")
        check(peak[s] >= rss[s] * 0.999, f"{s} peak {peak[s]} >= resident {rss[s]}")

    # Cache: the repeated image hit; the hit ratio rule is strictly between 0 and 1.
    hits = prom.query("sum(vlm_vision_cache_hits_total)")
    misses = prom.query("sum(vlm_vision_cache_misses_total)")
    print(f"  cache hits {hits} misses {misses}")
    check(hits and hits[0][1] >= n_chats // 4 * 2, f"vision cache hits counted: {hits}")
    check(misses and misses[0][1] >= 2, f"vision cache misses counted: {misses}")
    ratio = prom.wait_for("vlm:vision_cache_hit_ratio:rate5m",
                          lambda r: r and 0 < r[0][1] < 1, 20, "cache hit ratio in (0, 1)")
    print(f"  vlm:vision_cache_hit_ratio:rate5m = {ratio}")

    # Time to first token: counted per generation, quantiles finite and ordered.
    ttft_count = prom.query("sum(vlm_language_time_to_first_token_seconds_count)")
    check(ttft_count and ttft_count[0][1] >= n_chats, f"TTFT observations >= {n_chats}: {ttft_count}")
    p50 = prom.query("vlm:language_time_to_first_token_seconds:p50_5m")
    p95 = prom.query("vlm:language_time_to_first_token_seconds:p95_5m")
    print(f"  TTFT p50 {p50} p95 {p95}")
    if check(p50 and p95, "TTFT quantile rules have values"):
        check(finite(p50[0][1]) and 0 < p50[0][1] <= p95[0][1] < 120,
              f"0 < TTFT p50 {p50[0][1]} <= p95 {p95[0][1]} < 120 s")
    gw_ttft = prom.query("sum(vlm_gateway_time_to_first_token_seconds_count)")
    check(gw_ttft and gw_ttft[0][1] >= 1, f"gateway TTFT observed: {gw_ttft}")

    # Requests: per service and code; the invalid request is not a server error.
    handled = prom.query("sum by (service, grpc_method, grpc_code) (vlm_grpc_server_handled_total)")
    print("  handled: " + ", ".join(f"{l['service']}/{l['grpc_method']}/{l['grpc_code']}={x:g}"
                                    for l, x in sorted(handled, key=lambda t: sorted(t[0].items()))))
    codes = {(l["service"], l["grpc_code"]): x for l, x in
             prom.query("sum by (service, grpc_code) (vlm_grpc_server_handled_total)")}
    check(codes.get(("gateway", "INVALID_ARGUMENT"), 0) >= 1, "gateway counted the invalid request")
    check(codes.get(("vision", "OK"), 0) >= 1 and codes.get(("language", "OK"), 0) >= 1,
          "backends counted their RPCs")
    errors = by_service(prom.wait_for("vlm:grpc_server_error_ratio:rate5m",
                                      lambda r: "gateway" in by_service(r), 20,
                                      "error ratio per service"))
    print(f"  vlm:grpc_server_error_ratio:rate5m = {errors}")
    check(errors.get("gateway") == 0, f"gateway error ratio 0 (INVALID_ARGUMENT is the caller's): {errors}")
    check(prom.query("vlm:grpc_server_handled:rate5m"), "request rate rule has series")
    check(by_service(prom.query("vlm_gateway_ready")).get("gateway") == 1, "vlm_gateway_ready == 1")

    # Every rule evaluated, none failing, no alert firing on a healthy system.
    groups = prom.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    recording, alerting = v.rules()
    check(len(rules) == len(recording) + len(alerting),
          f"Prometheus loaded {len(rules)} rules, files have {len(recording) + len(alerting)}")
    for r in rules:
        check(r["health"] == "ok" and not r.get("lastError"),
              f"rule {r['name']} health {r['health']} {r.get('lastError', '')}")
    for r in rules:
        if r["type"] == "recording":
            check(prom.query(r["name"]), f"recording rule {r['name']} has a series")
    firing = [a for a in prom.api("alerts")["alerts"] if a["state"] == "firing"]
    check(not firing, f"no alert fires on a healthy system: {firing}")


def check_dashboard_queries(prom):
    _, targets = v.dashboard_targets(os.path.join(v.ROOT, "deploy", "grafana", "vlm-dashboard.json"))
    empty = []
    for title, expr in targets:
        q = expr.replace("$namespace", ".*").replace("$__rate_interval", "1m")
        try:
            result = prom.query(q)
        except RuntimeError as e:
            check(False, f"dashboard panel {title!r}: query fails: {e}")
            continue
        if not result:
            empty.append((title, expr))
    for title, expr in empty:
        check(False, f"dashboard panel {title!r}: {expr} returns nothing")
    print(f"  dashboard: {len(targets)} queries evaluated, {len(targets) - len(empty)} with data")


def main():
    ap = argparse.ArgumentParser()
    for s in v.SERVICES:
        ap.add_argument(f"--{s}", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prometheus", default=shutil.which("prometheus") or "/usr/bin/prometheus")
    ap.add_argument("--promtool", default=shutil.which("promtool") or "/usr/bin/promtool")
    args = ap.parse_args()
    binaries = {s: getattr(args, s) for s in v.SERVICES}
    missing = [p for p in binaries.values() if not os.access(p, os.X_OK)]
    if missing:
        print(f"SKIPPED: service binaries not built yet: {missing}")
        return v.SKIP
    for tool in (args.prometheus, args.promtool):
        if not os.access(tool, os.X_OK):
            print(f"{tool} missing: install Debian's `prometheus` (scripts/setup.sh does)")
            return 1

    started = time.monotonic()
    rounds = 2
    with tempfile.TemporaryDirectory(prefix="vlm-e2e-") as work:
        stubs = v.load_stubs(work)
        prom = None
        try:
            with v.Stack(binaries, args.model, work) as stack:
                prom = Prometheus(args.prometheus, make_config(stack, work, args.promtool), work)
                # Targets are scraped once discovery publishes them (about 5 s
                # after start); traffic before that would be one flat sample.
                prom.wait_for('up{job=~"vlm-.*"}',
                              lambda r: len(r) == 3 and all(x == 1 for _, x in r), 30,
                              "all three targets scraped and up")
                v.log("first scrapes done")
                # Two rounds a couple of scrapes apart: counters created by the
                # first round increase within the rate windows of the rules.
                v.exercise(stack, stubs)
                time.sleep(2.5)
                v.exercise(stack, stubs)
                v.log("traffic sent")
                run_checks(prom, stack, n_chats=4 * rounds)
                check_dashboard_queries(prom)
        except Exception:
            if prom:
                print("--- prometheus log ---\n" + prom.tail())
            raise
        finally:
            if prom:
                prom.stop()
    print(f"done in {time.monotonic() - started:.1f} s")
    if failures:
        print(f"\n{len(failures)} FAILED:")
        for f in failures:
            print("  - " + f)
        return 1
    print("Prometheus scraped the services; series, recording rules and dashboard queries check out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
