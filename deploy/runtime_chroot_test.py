#!/usr/bin/python3
"""Proves the Dockerfile's runtime stage without a Docker engine (needs root).

  deploy/runtime_chroot_test.py --build-dir build [--model DIR] [--root /srv/chroot/vlm-runtime]

1. A fresh `debootstrap --variant=minbase bookworm` root stands in for
   debian:bookworm-slim (reused when it exists; --fresh rebuilds it).
2. `COPY --from=build`: the build stage's last two steps run here for real
   (`cmake --install <build> --prefix /opt/vlm --strip` into a staging dir and
   deploy/runtime-packages.sh on the result), and their output is copied in.
3. Every RUN of the `runtime` stage runs, as written in deploy/Dockerfile, in
   the root (apt-get of the derived package list, the user 10001).
4. The root is then bind-mounted read-only (tmpfs /tmp, the model read-only at
   /models, /proc, /dev) and each target's ENTRYPOINT runs as USER 10001 with
   the stage's ENV; the HEALTHCHECK command of each target (vlm-health-probe,
   inside the root) must report SERVING, and one chat goes through the gateway.
Everything is stopped by PID and unmounted.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "unit"))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from deploy_image_test import effective, exec_form, parse_dockerfile  # noqa: E402
import vlm_stack as v  # noqa: E402


def run(argv, **kw):
    v.log("$ " + " ".join(argv))
    return subprocess.run(argv, check=True, **kw)


def stage_env(stages, name):
    """ENV of a stage and its parents, parent first."""
    by_name = {s["name"]: s for s in stages}
    chain, s = [], by_name.get(name)
    while s:
        chain.append(s)
        s = by_name.get(s["base"])
    env = {}
    for s in reversed(chain):
        for instr, rest in s["instructions"]:
            if instr == "ENV":
                for item in rest.split():
                    k, _, val = item.partition("=")
                    env[k] = val
    return env


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--model")
    ap.add_argument("--root", default="/srv/chroot/vlm-runtime")
    ap.add_argument("--fresh", action="store_true")
    args = ap.parse_args()
    build = os.path.abspath(args.build_dir)
    model = os.path.abspath(args.model or os.path.join(build, "tiny_checkpoint"))
    if os.geteuid() != 0:
        print("needs root (debootstrap, chroot, mounts)")
        return 2
    stages = parse_dockerfile(os.path.join(ROOT, "deploy", "Dockerfile"))
    runtime = next(s for s in stages if s["name"] == "runtime")
    root = args.root

    # 1. debian:bookworm-slim stand-in.
    if args.fresh and os.path.exists(root):
        shutil.rmtree(root)
    if not os.path.exists(os.path.join(root, "usr/bin/apt-get")):
        run(["debootstrap", "--variant=minbase", "bookworm", root, "http://deb.debian.org/debian"])
    shutil.copy("/etc/resolv.conf", os.path.join(root, "etc/resolv.conf"))
    with open(os.path.join(root, "usr/sbin/policy-rc.d"), "w") as f:
        f.write("#!/bin/sh\nexit 101\n")
    os.chmod(os.path.join(root, "usr/sbin/policy-rc.d"), 0o755)

    with tempfile.TemporaryDirectory(prefix="vlm-image-") as work:
        # 2. The build stage's install + package derivation, for real.
        staged = os.path.join(work, "opt", "vlm")
        run(["cmake", "--install", build, "--prefix", staged, "--strip"], stdout=subprocess.DEVNULL)
        bins = sorted(os.listdir(os.path.join(staged, "bin")))
        with open(os.path.join(staged, "runtime-packages.txt"), "w") as out:
            run([os.path.join(ROOT, "deploy", "runtime-packages.sh"),
                 *[os.path.join(staged, "bin", b) for b in bins]], stdout=out)
        for instr, rest in runtime["instructions"]:
            if instr == "COPY":
                src, dst = rest.split()[-2:]
                if not rest.startswith("--from=build") or not src.startswith("/opt/vlm"):
                    raise SystemExit(f"unexpected COPY in runtime: {rest}")
                rel = os.path.relpath(src, "/opt/vlm")
                target = os.path.join(root, dst.lstrip("/"))
                source = os.path.join(staged, rel)
                if os.path.isdir(source):
                    shutil.copytree(source, target, dirs_exist_ok=True)
                else:
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    shutil.copy2(source, target)
            elif instr == "RUN":
                # 3. The runtime stage's RUN, verbatim, inside the root (a
                # reused root first forgets the user the RUN creates).
                subprocess.run(["chroot", root, "/bin/sh", "-c",
                                "userdel vlm; groupdel vlm"], capture_output=True)
                env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive",
                       "HOME": "/root", "LANG": "C.UTF-8"}
                cmd = rest
                started = time.monotonic()
                run(["chroot", root, "/bin/sh", "-c", cmd], env=env)
                v.log(f"RUN done in {time.monotonic() - started:.0f} s")
        pkgs = open(os.path.join(staged, "runtime-packages.txt")).read().split()
        du = subprocess.run(["du", "-sm", "--exclude=proc", root], capture_output=True, text=True)
        v.log(f"runtime root: {du.stdout.split()[0]} MB, {len(pkgs)} derived packages")

        # 4. Read-only root, tmpfs /tmp, model read-only, run as USER.
        ro = os.path.join(work, "rootfs")
        os.makedirs(ro)
        os.makedirs(os.path.join(root, "models"), exist_ok=True)
        mounts = []

        def mount(*a):
            run(["mount", *a])
            if "remount" not in a[1]:
                mounts.append(a[-1])
        procs = []
        try:
            mount("--bind", root, ro)
            mount("-o", "remount,bind,ro", ro)
            mount("-t", "tmpfs", "-o", "size=64m,mode=1777", "tmpfs", os.path.join(ro, "tmp"))
            mount("--bind", model, os.path.join(ro, "models"))
            mount("-o", "remount,bind,ro", os.path.join(ro, "models"))
            mount("-t", "proc", "proc", os.path.join(ro, "proc"))
            mount("--bind", "/dev", os.path.join(ro, "dev"))
            write_test = subprocess.run(["chroot", "--userspec=10001:10001", ro, "/bin/sh", "-c",
                                         "touch /opt/x || touch /models/x"], capture_output=True)
            if write_test.returncode == 0:
                raise SystemExit("root filesystem or model is writable")

            grpc, metrics = {}, {}
            for target in ("vision", "language", "gateway"):
                user = effective(stages, target, "USER")
                entry = exec_form(effective(stages, target, "ENTRYPOINT"))
                env = stage_env(stages, target)
                env["VLM_GRPC_ADDRESS"] = "127.0.0.1:0"      # host network: pick free ports
                env["VLM_METRICS_ADDRESS"] = "127.0.0.1:0"
                extra = []
                if target == "gateway":
                    extra = [f"--vision_targets={grpc['vision']}",
                             f"--language_target={grpc['language']}"]
                argv = ["chroot", f"--userspec={user}", ro, "/usr/bin/env", "-i",
                        *[f"{k}={val}" for k, val in env.items()], *entry, *extra]
                p = v.Process(target, argv, work)
                procs.append(p)
                grpc[target], metrics[target] = p.wait_listening(120)
                v.log(f"{target} (uid {user}) pid {p.pid} grpc={grpc[target]}")
            for target in ("vision", "language", "gateway"):
                hc = effective(stages, target, "HEALTHCHECK")
                probe = exec_form(hc.split("CMD", 1)[1].strip())
                deadline = time.monotonic() + 300
                while True:
                    r = subprocess.run(["chroot", "--userspec=10001:10001", ro, *probe,
                                        f"--addr={grpc[target]}"], capture_output=True, text=True)
                    if r.returncode == 0:
                        v.log(f"HEALTHCHECK {target}: {r.stdout.strip()}")
                        break
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{target} never SERVING: {r.stdout}{r.stderr}\n"
                                         f"{procs[-1].tail()}")
                    time.sleep(0.5)
            stack = v.Stack({}, model, work)
            stack.grpc, stack.metrics = grpc, metrics
            stubs = v.load_stubs(work)
            responses = v.exercise(stack, stubs)
            v.log(f"chat through the chroot'ed gateway: {responses[0].text!r} "
                  f"(images: {[stubs['common_pb2'].CacheLevel.Name(r.images[0].cache) for r in responses[:2]]})")
        finally:
            codes = {p.name: p.stop() for p in reversed(procs)}
            v.log(f"exit codes after SIGTERM: {json.dumps(codes)}")
            for m in reversed(mounts):
                subprocess.run(["umount", "-l", m])
    print("runtime stage OK: bookworm minbase + derived packages runs all three services "
          "as uid 10001 on a read-only root")
    return 0


if __name__ == "__main__":
    sys.exit(main())
