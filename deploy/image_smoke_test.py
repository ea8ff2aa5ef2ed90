#!/usr/bin/python3
"""Smoke test of the container images that scripts/build_images.sh builds.

  VLM_IMAGE_TESTS=1 deploy/image_smoke_test.py --model DIR [--version V] [--max-mb N]

Runs only with VLM_IMAGE_TESTS=1 (ctest label `images`; exits 77, skipped,
otherwise): it needs root, podman and the images localhost/vlm-{vision,
language,gateway}:<version> already built. For each image:

- its size is printed and must stay under --max-mb (the bound is stated there);
- its config says USER 10001:10001 and the exec-form ENTRYPOINT of its service;
- `podman run --network host --read-only` starts it with no --user and no
  entrypoint override (the image's own), the model mounted read-only at
  /models, /tmp a tmpfs, no capabilities; ports are picked by the kernel on
  127.0.0.1. The entrypoint process must run as uid 10001 (read from the host's
  /proc), and neither the root file system nor the model may be writable;
- the image's HEALTHCHECK command (vlm-health-probe, run in the container with
  --addr of the service) must report SERVING.
Then chats go through the gateway container (gRPC: a repeated image must be a
cache hit of the vision container; HTTP: one OpenAI chat completion), and each
container must exit 0 on SIGTERM. Everything is removed by name at the end.
"""
import argparse
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import vlm_stack as v  # noqa: E402

TARGETS = ("vision", "language", "gateway")
SKIP = 77


def version_of_source():
    with open(os.path.join(ROOT, "common", "CMakeLists.txt")) as f:
        m = re.search(r'^set\(VLM_VERSION "([^"]+)"\)', f.read(), re.M)
    return m.group(1)


def podman(*args, check=True):
    r = subprocess.run(["podman", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise SystemExit(f"podman {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def podman_run_options(image):
    """The podman options under which a container starts on this machine, or exits.

    Podman's defaults (crun, systemd cgroups, RLIMIT_NOFILE 1048576) need cgroup v2 or
    a v1 host without a unified hierarchy, and CAP_SYS_RESOURCE. Inside a container
    with hybrid cgroups and no CAP_SYS_RESOURCE (this kind of machine) runc with
    cgroupfs and limits no higher than the caller's own work; the first variant that
    starts `<entrypoint> --version` is used."""
    import resource
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 65536)
    variants = [
        ("podman defaults", [], []),
        ("runc, cgroupfs, the caller's rlimits",
         ["--runtime", "runc", "--cgroup-manager", "cgroupfs"],
         ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=8192:8192"]),
    ]
    errors = []
    for what, glob_opts, run_opts in variants:
        if "runc" in glob_opts and shutil.which("runc") is None:
            errors.append(f"{what}: runc is missing (apt-get install -y runc)")
            continue
        r = subprocess.run(["podman", *glob_opts, "run", "--rm", "--no-healthcheck", *run_opts,
                            "--network", "host", image, "--version"],
                           capture_output=True, text=True, timeout=120)
        if r.returncode == 0:
            v.log(f"podman runs containers here with {what}: {r.stdout.strip()}")
            return glob_opts, run_opts
        errors.append(f"{what}: {r.stderr.strip().splitlines()[-1:]}")
    raise SystemExit("image_smoke_test: podman cannot start a container on this machine:\n  " +
                     "\n  ".join(errors))


class Container:
    """`podman run` in the foreground: stdout is the service's, SIGTERM is proxied."""

    def __init__(self, name, image, model, env, args, workdir, options):
        self.name = name
        glob_opts, run_opts = options
        self.glob_opts = glob_opts
        argv = ["podman", *glob_opts, "run", "--rm", "--name", name, "--network", "host",
                "--no-healthcheck", *run_opts, "--read-only",
                "--tmpfs", "/tmp:rw,size=64m,mode=1777", "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges", "--sig-proxy=true"]
        if model:
            argv += ["--volume", f"{model}:/models:ro"]
        for k, val in env.items():
            argv += ["--env", f"{k}={val}"]
        self.proc = v.Process(name, argv + [image, *args], workdir)
        self.out = ""

    def wait_line(self, pattern, timeout):
        """Reads the container's stdout (the raw pipe: lines may arrive together)
        until a line matches `pattern`."""
        p = self.proc.proc
        fd = p.stdout.fileno()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.out)
            if m:
                return m
            if p.poll() is not None:
                raise SystemExit(f"{self.name} exited with {p.returncode}:\n{self.proc.tail()}")
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                self.out += os.read(fd, 65536).decode(errors="replace")
        raise SystemExit(f"{self.name}: no line /{pattern}/ in {timeout} s:\n"
                         f"{self.out}{self.proc.tail()}")

    def exec(self, *cmd):
        return podman(*self.glob_opts, "exec", self.name, *cmd, check=False)

    def pid(self):
        return int(podman(*self.glob_opts, "inspect", "--format", "{{.State.Pid}}",
                          self.name).stdout.strip())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--version", default=None)
    ap.add_argument("--max-mb", type=int, default=1500,
                    help="bound on each image's size (MB of uncompressed layers)")
    args = ap.parse_args()
    if os.environ.get("VLM_IMAGE_TESTS") != "1":
        print("images smoke test runs with VLM_IMAGE_TESTS=1 after scripts/build_images.sh "
              "(VLM_IMAGE_TESTS=1 ctest -L images)")
        return SKIP
    if os.geteuid() != 0:
        print("image_smoke_test: needs root (podman run with host networking and the "
              "images in root's container storage)")
        return 1
    if shutil.which("podman") is None:
        print("image_smoke_test: podman is missing: apt-get install -y podman runc "
              "(or scripts/build_images.sh, which installs them)")
        return 1
    version = args.version or version_of_source()
    model = os.path.abspath(args.model)
    images = {t: f"localhost/vlm-{t}:{version}" for t in TARGETS}
    started = time.monotonic()

    # Sizes and configuration of the images as built.
    print(f"{'image':40} {'MB':>6}  bound")
    for t, image in images.items():
        if podman("image", "exists", image, check=False).returncode != 0:
            print(f"image_smoke_test: {image} is not in the container storage; build it with "
                  f"scripts/build_images.sh")
            return 1
        info = json.loads(podman("image", "inspect", image).stdout)[0]
        size_mb = info["Size"] / 1e6
        print(f"{image:40} {size_mb:6.0f}  <= {args.max_mb}")
        if size_mb > args.max_mb:
            raise SystemExit(f"{image}: {size_mb:.0f} MB is over the bound of {args.max_mb} MB")
        cfg = info["Config"]
        if cfg.get("User") != "10001:10001":
            raise SystemExit(f"{image}: USER {cfg.get('User')!r}, want 10001:10001")
        if cfg.get("Entrypoint") != [f"/opt/vlm/bin/vlm-{t}"]:
            raise SystemExit(f"{image}: ENTRYPOINT {cfg.get('Entrypoint')}")

    options = podman_run_options(images["gateway"])
    suffix = f"{os.getpid()}"
    containers = []
    with tempfile.TemporaryDirectory(prefix="vlm-image-smoke-") as work:
        try:
            grpc, metrics, http = {}, {}, None
            for t in TARGETS:
                env = {"VLM_GRPC_ADDRESS": "127.0.0.1:0", "VLM_METRICS_ADDRESS": "127.0.0.1:0",
                       "OMP_NUM_THREADS": "1"}
                extra = []
                if t == "gateway":
                    env["VLM_HTTP_ADDRESS"] = "127.0.0.1:0"
                    extra = [f"--vision_targets={grpc['vision']}",
                             f"--language_target={grpc['language']}"]
                t0 = time.monotonic()
                c = Container(f"vlm-smoke-{t}-{suffix}", images[t],
                              model if t != "gateway" else None, env, extra, work, options)
                containers.append(c)
                m = c.wait_line(r"vlm: listening grpc=(\S+) metrics=(\S+)", 180)
                grpc[t], metrics[t] = m.group(1), m.group(2)
                if t == "gateway":
                    http = c.wait_line(r"vlm: http=(\S+)", 60).group(1)
                with open(f"/proc/{c.pid()}/status") as f:
                    uids = re.search(r"^Uid:\s+(\d+)\s+(\d+)", f.read(), re.M).groups()
                if uids != ("10001", "10001"):
                    raise SystemExit(f"{t}: entrypoint runs as uid {uids}, want 10001")
                for path in ("/opt/vlm/x", "/models/x" if t != "gateway" else "/etc/x"):
                    if c.exec("touch", path).returncode == 0:
                        raise SystemExit(f"{t}: {path} is writable in the container")
                v.log(f"{t}: listening in {time.monotonic() - t0:.1f} s, grpc={grpc[t]}, "
                      f"uid 10001, read-only root and model")

            for t, c in zip(TARGETS, containers):
                info = json.loads(podman("image", "inspect", images[t]).stdout)[0]
                hc = (info.get("Healthcheck") or {}).get("Test") or []
                if hc[:1] != ["CMD"] or not hc[1:2] or "vlm-health-probe" not in hc[1]:
                    raise SystemExit(f"{images[t]}: HEALTHCHECK {hc}, want CMD vlm-health-probe")
                deadline = time.monotonic() + 300
                while True:
                    r = c.exec(*hc[1:], f"--addr={grpc[t]}")
                    if r.returncode == 0 and "SERVING" in r.stdout:
                        v.log(f"HEALTHCHECK {t}: {r.stdout.strip()}")
                        break
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{t} never SERVING: {r.stdout}{r.stderr}\n{c.proc.tail()}")
                    time.sleep(0.5)

            stack = v.Stack({}, model, work)
            stack.grpc, stack.metrics = grpc, metrics
            stubs = v.load_stubs(work)
            responses = v.exercise(stack, stubs)
            v.log(f"gRPC chats through the gateway container: {responses[0].text!r}, repeated "
                  f"image {stubs['common_pb2'].CacheLevel.Name(responses[1].images[0].cache)}")
            body = json.dumps({"model": "qwen3-vl", "max_tokens": 4, "temperature": 0,
                               "messages": [{"role": "user", "content": "Say hello."}]})
            req = urllib.request.Request(f"http://{http}/v1/chat/completions", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                completion = json.load(r)
            text = completion["choices"][0]["message"]["content"]
            if completion["choices"][0]["finish_reason"] not in ("stop", "length"):
                raise SystemExit(f"HTTP chat: unexpected completion {completion}")
            v.log(f"HTTP chat completion through the gateway container: {text!r}")
        finally:
            codes = {}
            for c in reversed(containers):
                codes[c.name] = c.proc.stop(timeout=90)
                podman(*c.glob_opts, "rm", "--force", "--ignore", c.name, check=False)
            v.log(f"exit codes after SIGTERM: {json.dumps(codes)}")
        if any(code != 0 for code in codes.values()):
            raise SystemExit(f"a container did not exit 0 on SIGTERM: {codes}")
    print(f"images OK: 3 images started as uid 10001 with a read-only root and model, SERVING, "
          f"chats served, in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
