#!/usr/bin/python3
"""Checks the container build (deploy/Dockerfile), its runtime package list and
deploy/compose.yaml without a Docker engine (none runs on the dev machines).

  deploy_image_test.py --build-dir DIR [--binary NAME=PATH ...]

- Dockerfile: a build stage on debian:bookworm whose only build steps are the
  repository's scripts/setup.sh and scripts/build.sh (shared, not copied)
  followed by `cmake --install`; a runtime stage on debian:bookworm-slim that
  installs only the derived package list; one target per service with an
  exec-form ENTRYPOINT (no shell at run time), a numeric non-root USER and an
  exec-form HEALTHCHECK on the service's own health name;
- `cmake --install` of the build puts exactly the programs the Dockerfile runs
  into <prefix>/bin;
- deploy/runtime-packages.sh on those programs lists only runtime packages,
  and an independent walk (readelf DT_NEEDED + ldconfig + dpkg -L) finds every
  library they load inside the listed packages;
- compose.yaml: valid for docker-compose (when installed), services hardened
  (read-only root, uid 10001, no capabilities, no-new-privileges), the model
  mounted read-only, health checks through vlm-health-probe, and every
  VLM_<FLAG> variable a real flag of its binary (with --binary).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

ROOT = os.environ.get("VLM_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from k8s_manifests_test import binary_flags  # noqa: E402

DOCKERFILE = os.path.join(ROOT, "deploy", "Dockerfile")
COMPOSE = os.path.join(ROOT, "deploy", "compose.yaml")
TARGETS = {"vision": ("vlm-vision", "vlm.v1.VisionEncoder"),
           "language": ("vlm-language", "vlm.v1.Language"),
           "gateway": ("vlm-gateway", "vlm.v1.VisionLanguage")}
PREFIX = "/opt/vlm"
PROBE = f"{PREFIX}/bin/vlm-health-probe"

failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
    return cond


# --- Dockerfile -------------------------------------------------------------------

def parse_dockerfile(path):
    """[stage dict(name, base, instructions=[(INSTR, args)])], ARG defaults."""
    with open(path) as f:
        text = f.read()
    text = re.sub(r"\\\n", " ", text)  # line continuations
    stages, args = [], {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        instr, rest = instr.upper(), rest.strip()
        if instr == "ARG" and not stages:
            k, _, val = rest.partition("=")
            args[k] = val
            continue
        if instr == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            base = re.sub(r"\$\{(\w+)\}", lambda mm: args.get(mm.group(1), ""), m.group(1))
            stages.append({"name": m.group(2), "base": base, "instructions": []})
            continue
        stages[-1]["instructions"].append((instr, rest))
    return stages


def exec_form(rest):
    """JSON array of an exec-form instruction, or None for shell form."""
    try:
        value = json.loads(rest)
    except ValueError:
        return None
    return value if isinstance(value, list) and all(isinstance(x, str) for x in value) else None


def effective(stages, name, instr):
    """Last `instr` of stage `name`, following FROM <stage> chains."""
    by_name = {s["name"]: s for s in stages}
    stage = by_name.get(name)
    while stage:
        found = [rest for i, rest in stage["instructions"] if i == instr]
        if found:
            return found[-1]
        stage = by_name.get(stage["base"])
    return None


def check_dockerfile():
    stages = parse_dockerfile(DOCKERFILE)
    by_name = {s["name"]: s for s in stages}
    build, runtime = by_name.get("build"), by_name.get("runtime")
    if not check(build and runtime, "Dockerfile has stages `build` and `runtime`"):
        return None
    check(build["base"] == "debian:bookworm", f"build stage FROM debian:bookworm ({build['base']})")
    check(runtime["base"] == "debian:bookworm-slim",
          f"runtime stage FROM debian:bookworm-slim ({runtime['base']})")

    # Build stage: the shared scripts, then install; no package list of its own.
    runs = " && ".join(rest for i, rest in build["instructions"] if i == "RUN")
    steps = [s.strip() for s in re.split(r"&&", re.sub(r"--mount=\S+", "", runs))]
    check(steps and steps[0] == "scripts/setup.sh", f"build runs scripts/setup.sh first: {steps[:1]}")
    build_steps = [s for s in steps if s.startswith("scripts/build.sh")]
    check(len(build_steps) == 1, "build runs scripts/build.sh once")
    check("apt-get" not in runs and "cmake -S" not in runs and "ninja" not in runs,
          "build stage repeats nothing setup.sh/build.sh do (no apt-get, cmake configure, ninja)")
    install = [s for s in steps if s.startswith("cmake --install")]
    check(install and f"--prefix {PREFIX}" in install[0], f"build installs into {PREFIX}")
    check(any("deploy/runtime-packages.sh" in s for s in steps),
          "build derives the runtime package list with deploy/runtime-packages.sh")
    built_targets = build_steps[0].split()[1:] if build_steps else []

    # Runtime stage: installs the derived list and nothing else, adds a user.
    rt_runs = " ".join(rest for i, rest in runtime["instructions"] if i == "RUN")
    check("runtime-packages.txt" in rt_runs, "runtime installs the derived package list")
    installs = re.findall(r"apt-get install([^&]*)", rt_runs)
    check(len(installs) == 1 and not re.search(r"\s[a-z0-9][a-z0-9.+-]+(?=\s|$)",
                                               installs[0].replace("--no-install-recommends", "")
                                               .replace("-y", "")),
          f"runtime apt-get install names no packages by hand: {installs}")
    check("--no-install-recommends" in rt_runs, "runtime installs without recommends")
    check("rm -rf /var/lib/apt/lists" in rt_runs, "runtime drops the apt lists")
    check(re.search(r"useradd .*--uid 10001", rt_runs) is not None, "runtime creates uid 10001")
    copies = [rest for i, rest in runtime["instructions"] if i == "COPY"]
    check(any(c.startswith("--from=build") and f"{PREFIX}/bin" in c for c in copies),
          "runtime copies the installed programs from the build stage")

    for target, (binary, health) in TARGETS.items():
        stage = by_name.get(target)
        if not check(stage is not None, f"Dockerfile target {target}"):
            continue
        check(stage["base"] == "runtime", f"target {target} is built FROM runtime")
        entry = exec_form(effective(stages, target, "ENTRYPOINT") or "")
        check(entry == [f"{PREFIX}/bin/{binary}"],
              f"target {target}: exec-form ENTRYPOINT [{PREFIX}/bin/{binary}] ({entry})")
        check(effective(stages, target, "CMD") is None or
              exec_form(effective(stages, target, "CMD")) is not None,
              f"target {target}: no shell-form CMD")
        user = effective(stages, target, "USER") or ""
        check(re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", user) is not None,
              f"target {target}: numeric non-root USER ({user!r})")
        hc = effective(stages, target, "HEALTHCHECK") or ""
        cmd = exec_form(hc.split("CMD", 1)[1].strip()) if "CMD" in hc else None
        check(cmd == [PROBE, f"--service={health}"],
              f"target {target}: exec-form HEALTHCHECK {PROBE} --service={health} ({cmd})")
        check(binary in built_targets, f"build.sh builds {binary}")
        model = binary != "vlm-gateway"
        envs = " ".join(rest for i, rest in stage["instructions"] if i == "ENV")
        check(("VLM_MODEL_DIR=/models" in envs) == model,
              f"target {target}: VLM_MODEL_DIR=/models {'set' if model else 'not set'}")
    check("vlm-health-probe" in built_targets, "build.sh builds vlm-health-probe")
    exposed = " ".join(rest for i, rest in runtime["instructions"] if i == "EXPOSE").split()
    check(sorted(exposed) == ["50051", "9090"], f"runtime EXPOSE 50051 9090 ({exposed})")
    gateway_stage = next((s for s in stages if s["name"] == "gateway"), {"instructions": []})
    gw_exposed = " ".join(rest for i, rest in gateway_stage["instructions"] if i == "EXPOSE").split()
    check(gw_exposed == ["8080"], f"target gateway EXPOSE 8080, its HTTP listener ({gw_exposed})")
    renv = " ".join(rest for i, rest in runtime["instructions"] if i == "ENV")
    check("VLM_GRPC_ADDRESS=0.0.0.0:50051" in renv and "VLM_METRICS_ADDRESS=0.0.0.0:9090" in renv,
          "runtime listens on 50051 (gRPC) and 9090 (metrics)")

    ignore = os.path.join(ROOT, "deploy", "Dockerfile.dockerignore")
    with open(ignore) as f:
        patterns = [l.strip() for l in f if l.strip() and not l.startswith("#")]
    check("build-*" in patterns and "build" in patterns, "build trees stay out of the context")
    return built_targets


# --- install + runtime packages --------------------------------------------------------

def ldconfig_cache():
    out = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True, check=True)
    cache = {}
    for m in re.finditer(r"^\s+(\S+) \(([^)]*)\) => (\S+)$", out.stdout, re.M):
        if "x86-64" in m.group(2) or "64bit" in m.group(2) or "," not in m.group(2):
            cache.setdefault(m.group(1), m.group(3))
    return cache


def needed(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True)
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out.stdout)


def closure(binaries):
    """Real paths of every library the binaries need (DT_NEEDED, transitively)."""
    cache = ldconfig_cache()
    seen, todo, libs = set(), [], set()
    for b in binaries:
        todo.extend(needed(b))
    while todo:
        soname = todo.pop()
        if soname in seen:
            continue
        seen.add(soname)
        path = cache.get(soname)
        if not check(path is not None, f"{soname} resolvable through ldconfig"):
            continue
        libs.add(os.path.realpath(path))
        todo.extend(needed(path))
    return libs


def package_files(packages):
    out = subprocess.run(["dpkg-query", "-L", *packages], capture_output=True, text=True)
    check(out.returncode == 0, f"dpkg-query -L of the listed packages: {out.stderr.strip()}")
    files = set()
    for f in out.stdout.split():
        files.add(os.path.realpath(f))
        files.add(f)
    return files


def check_runtime_packages(programs):
    script = os.path.join(ROOT, "deploy", "runtime-packages.sh")
    out = subprocess.run([script, *programs], capture_output=True, text=True, timeout=300)
    if not check(out.returncode == 0, f"runtime-packages.sh failed: {out.stderr}"):
        return
    packages = out.stdout.split()
    print(f"runtime packages ({len(packages)}): {' '.join(packages)}")
    check(packages == sorted(set(packages)), "package list sorted and unique")
    for p in packages:
        check(not p.endswith("-dev") and not p.endswith("-dbg")
              and p not in ("gcc", "g++", "cpp", "cmake", "ninja-build", "build-essential",
                            "protobuf-compiler", "protobuf-compiler-grpc"),
              f"{p} is a runtime package")
    files = package_files(packages)
    libs = closure(programs)
    print(f"independent DT_NEEDED closure: {len(libs)} libraries")
    for lib in sorted(libs):
        variants = {lib, lib.removeprefix("/usr"), "/usr" + lib}
        check(variants & files, f"{lib} is provided by a listed package")


def check_install(build_dir, expected):
    with tempfile.TemporaryDirectory(prefix="vlm-install-") as prefix:
        out = subprocess.run(["cmake", "--install", build_dir, "--prefix", prefix],
                             capture_output=True, text=True, timeout=300)
        if not check(out.returncode == 0, f"cmake --install: {out.stdout}{out.stderr}"):
            return None
        installed = sorted(os.listdir(os.path.join(prefix, "bin")))
        print(f"cmake --install -> bin/: {' '.join(installed)}")
        for name in expected:
            check(name in installed, f"cmake --install installs {name}")
        programs = [os.path.join(prefix, "bin", n) for n in installed]
        for p in programs:
            check(os.access(p, os.X_OK), f"{p} executable")
        probe = os.path.join(prefix, "bin", "vlm-health-probe")
        if os.path.exists(probe):
            r = subprocess.run([probe, "--addr=127.0.0.1:1", "--timeout_ms=300"],
                               capture_output=True, text=True, timeout=30)
            check(r.returncode == 2, f"installed probe: unreachable server -> exit 2 ({r.returncode})")
        check_runtime_packages(programs)
        return installed


# --- compose -----------------------------------------------------------------------------

def check_compose(flags):
    with open(COMPOSE) as f:
        compose = yaml.safe_load(f)
    dc = shutil.which("docker-compose")
    if dc:
        r = subprocess.run([dc, "-f", COMPOSE, "config", "-q"], capture_output=True, text=True,
                           env={**os.environ, "MODEL_DIR": "/tmp"}, timeout=60)
        check(r.returncode == 0, f"docker-compose config: {r.stdout}{r.stderr}")
        r = subprocess.run([dc, "-f", COMPOSE, "config", "-q"], capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "MODEL_DIR"},
                           timeout=60)
        check(r.returncode != 0 and "MODEL_DIR" in r.stderr,
              "docker-compose refuses to start without MODEL_DIR")
        print("docker-compose config: valid")
    else:
        print("docker-compose not installed: schema validation skipped")
    services = compose["services"]
    stages = {s["name"] for s in parse_dockerfile(DOCKERFILE)}
    for target, (binary, health) in TARGETS.items():
        s = services.get(target)
        if not check(s is not None, f"compose service {target}"):
            continue
        w = f"compose {target}"
        check(s.get("read_only") is True, f"{w}: read-only root filesystem")
        check(str(s.get("user")) == "10001:10001", f"{w}: user 10001:10001")
        check(s.get("cap_drop") == ["ALL"], f"{w}: cap_drop ALL")
        check("no-new-privileges:true" in (s.get("security_opt") or []), f"{w}: no-new-privileges")
        check(any(t.startswith("/tmp") for t in s.get("tmpfs") or []), f"{w}: tmpfs /tmp")
        b = s.get("build") or {}
        check(b.get("dockerfile") == "deploy/Dockerfile" and b.get("target") in stages
              and b.get("target") == target, f"{w}: built from deploy/Dockerfile target {target}")
        check(s.get("healthcheck", {}).get("test") == ["CMD", PROBE, f"--service={health}"],
              f"{w}: healthcheck is the exec-form probe on {health}")
        env = s.get("environment") or {}
        if target != "gateway":
            check(env.get("VLM_MODEL_DIR") == "/models", f"{w}: VLM_MODEL_DIR=/models")
            check(any(v.endswith(":/models:ro") for v in s.get("volumes") or []),
                  f"{w}: model mounted read-only at /models")
        grace = float(str(s.get("stop_grace_period", "10s")).rstrip("s"))
        check(grace > float(env.get("VLM_DRAIN_TIMEOUT_S", 25)),
              f"{w}: stop_grace_period {grace} > drain {env.get('VLM_DRAIN_TIMEOUT_S')}")
        if binary in flags:
            for var in env:
                check(var.startswith("VLM_") and var[4:].lower() in flags[binary],
                      f"{w}: {var} is not a flag of {binary}")
    gw = services.get("gateway", {}).get("environment", {})
    check(gw.get("VLM_VISION_DNS") == "vision:50051" and gw.get("VLM_LANGUAGE_DNS") == "language:50051",
          f"compose gateway points at vision (DNS) and language: {gw}")
    gw_ports = services.get("gateway", {}).get("ports") or []
    check("127.0.0.1:8080:8080" in gw_ports,
          f"compose gateway publishes its HTTP listener on 127.0.0.1:8080: {gw_ports}")
    deps = services.get("gateway", {}).get("depends_on", {})
    check(all(deps.get(b, {}).get("condition") == "service_healthy" for b in ("vision", "language")),
          "compose gateway waits for healthy backends")
    prom = services.get("prometheus", {})
    check("./prometheus:/etc/prometheus:ro" in prom.get("volumes", []),
          "compose prometheus mounts deploy/prometheus")
    graf = services.get("grafana", {})
    for vol in graf.get("volumes", []):
        src = vol.split(":")[0]
        check(os.path.exists(os.path.join(ROOT, "deploy", src)), f"grafana mount {src} exists")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir")
    ap.add_argument("--binary", action="append", default=[], help="NAME=PATH (flag check)")
    args = ap.parse_args()
    flags = {}
    for b in args.binary:
        name, path = b.split("=", 1)
        flags[name] = binary_flags(path)

    built = check_dockerfile() or []
    print(f"Dockerfile builds: {' '.join(built)}")
    if args.build_dir:
        check_install(args.build_dir, built)
    check_compose(flags)

    if failures:
        print(f"\n{len(failures)} FAILED:")
        for f in failures:
            print("  - " + f)
        return 1
    print("Dockerfile, install, runtime packages and compose check out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
