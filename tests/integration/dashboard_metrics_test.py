#!/usr/bin/python3
"""Every metric the Grafana dashboard and the Prometheus rules read is one the
services really export.

  dashboard_metrics_test.py --vision BIN --language BIN --gateway BIN --model DIR

Starts vlm-vision, vlm-language and vlm-gateway on loopback with the tiny
checkpoint, sends a few chats (a repeated image, a stream, an invalid request)
so that lazily created series exist, scrapes the three /metrics endpoints and
checks deploy/grafana/vlm-dashboard.json and deploy/prometheus/rules/*.yml
against what was scraped. Exits 77 (ctest: skipped) when a binary is missing.
"""
import argparse
import os
import sys
import tempfile

import vlm_stack as v

DASHBOARD = os.path.join(v.ROOT, "deploy", "grafana", "vlm-dashboard.json")
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
    return cond


def check_dashboard_structure(dash, targets):
    ids = set()

    def panels(ps):
        for p in ps:
            yield p
            yield from panels(p.get("panels", []))
    for p in panels(dash["panels"]):
        check(p["id"] not in ids, f"panel id {p['id']} unique")
        ids.add(p["id"])
        g = p["gridPos"]
        check(0 <= g["x"] and g["x"] + g["w"] <= 24, f"panel {p['title']!r} inside the 24-column grid")
        if p["type"] == "row":
            continue
        check(p.get("datasource", {}).get("uid") == "${datasource}",
              f"panel {p['title']!r} uses the $datasource variable")
        check(p.get("targets"), f"panel {p['title']!r} has queries")
        refs = [t.get("refId") for t in p.get("targets", [])]
        check(len(set(refs)) == len(refs) and all(refs), f"panel {p['title']!r} refIds unique")
        for t in p.get("targets", []):
            check('namespace=~"$namespace"' in t["expr"],
                  f"panel {p['title']!r}: {t['expr']!r} filters by $namespace")
    boxes = [(p["title"], p["gridPos"]) for p in panels(dash["panels"])]
    for i, (ta, a) in enumerate(boxes):
        for tb, b in boxes[i + 1:]:
            overlap = (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
                       and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])
            check(not overlap, f"panels {ta!r} and {tb!r} overlap")
    names = {"datasource", "namespace"}
    check(names <= {t["name"] for t in dash["templating"]["list"]}, "templating variables")

    # The panels the deployment issue asks for, recognised by what they read.
    def panel_reading(*metrics, grouping=None):
        for title, expr in targets:
            if all(m in expr for m in metrics) and (grouping is None or grouping in expr):
                return title
        return None
    wanted = {
        "load time per phase": panel_reading("vlm_model_load_seconds", grouping="phase"),
        "resident memory per service": panel_reading("vlm_process_resident_memory_bytes",
                                                     grouping="service"),
        "peak memory per service": panel_reading("vlm_process_peak_resident_memory_bytes",
                                                 grouping="service"),
        "cache hit ratio": panel_reading("vlm:vision_cache_hit_ratio:rate5m"),
        "cache bytes": panel_reading("vlm_vision_cache_bytes"),
        "time to first token": panel_reading("time_to_first_token"),
        "tokens/s": panel_reading("vlm:language_generated_tokens:rate5m"),
        "queue depth": panel_reading("vlm_language_queue_depth"),
        "errors by code": panel_reading("vlm_grpc_server_handled_total", grouping="grpc_code"),
    }
    for what, title in wanted.items():
        check(title is not None, f"a panel shows {what}")
        print(f"  {what:28s} -> {title!r}")


def main():
    ap = argparse.ArgumentParser()
    for s in v.SERVICES:
        ap.add_argument(f"--{s}", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    binaries = {s: getattr(args, s) for s in v.SERVICES}
    missing = [p for p in binaries.values() if not os.access(p, os.X_OK)]
    if missing:
        print(f"SKIPPED: service binaries not built yet: {missing}")
        return v.SKIP

    dash, targets = v.dashboard_targets(DASHBOARD)
    recording, alerting = v.rules()
    print(f"dashboard: {len(targets)} queries; rules: {len(recording)} recording, "
          f"{len(alerting)} alerting")
    check_dashboard_structure(dash, targets)

    with tempfile.TemporaryDirectory(prefix="vlm-dash-") as work:
        stubs = v.load_stubs(work)
        with v.Stack(binaries, args.model, work) as stack:
            v.exercise(stack, stubs)
            exported = {}
            for s in v.SERVICES:
                for name in v.parse_exposition(stack.scrape(s)):
                    exported.setdefault(name, set()).add(s)
            codes = stack.stop()
        check(all(c == 0 for c in codes.values()), f"services exit 0 after SIGTERM: {codes}")
    print(f"exported: {len(exported)} sample names from {', '.join(v.SERVICES)}")

    # Dashboard: each name is a recording rule (whose inputs are exported) or exported.
    for title, expr in targets:
        names = v.promql_metric_names(expr)
        check(names, f"panel {title!r}: {expr!r} selects no metric")
        for n in names:
            if n in recording:
                continue
            check(n in exported, f"panel {title!r} reads {n}, which no service exports")
    # Rules: every vlm metric they read is exported.
    for rule, expr in list(recording.items()) + list(alerting.items()):
        for n in v.base_metric_names(v.promql_metric_names(expr), recording):
            if n in v.EXTERNAL_METRICS:
                continue
            check(n in exported, f"rule {rule} reads {n}, which no service exports")
    # Process metrics come from every service.
    for n in ("vlm_process_resident_memory_bytes", "vlm_process_peak_resident_memory_bytes",
              "vlm_build_info"):
        check(exported.get(n) == set(v.SERVICES), f"{n} exported by all three services")

    # Informational: what operators could still add to the dashboard.
    def family(n):
        for sfx in ("_bucket", "_sum", "_count"):
            if n.endswith(sfx):
                return n[:-len(sfx)]
        return n
    shown = {family(n) for n in v.base_metric_names(
        set().union(*(v.promql_metric_names(e) for _, e in targets)), recording)}
    unshown = sorted({family(n) for n in exported if n.startswith("vlm_")} - shown)
    print(f"exported but not on the dashboard ({len(unshown)}): {', '.join(unshown)}")

    if failures:
        print(f"\n{len(failures)} FAILED:")
        for f in failures:
            print("  - " + f)
        return 1
    print("dashboard and rules read only exported metrics")
    return 0


if __name__ == "__main__":
    sys.exit(main())
