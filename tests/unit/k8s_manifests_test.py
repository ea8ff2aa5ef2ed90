#!/usr/bin/python3
"""Renders every k8s overlay and checks the invariants the deployment relies on.

  k8s_manifests_test.py [--kubectl PATH] [--binary NAME=PATH ...]

- the renderer (k8s/render.py) agrees with real kustomize (`kubectl kustomize`)
  when kubectl is installed (not packaged in Debian bookworm: then skipped,
  and said so);
- probes: startup and readiness are gRPC probes on the container's gRPC port
  and the service's own health name; liveness never asks the service's
  readiness (it must not fail while the model is busy); startup allows loading;
- every container has cpu/memory requests and limits (requests <= limits);
- selectors, labels, Service target ports, PDBs, the HPA and the PodMonitor
  all point at real pods and ports;
- the vision Service is headless and the gateway is configured with it;
- NetworkPolicies: only gateway pods reach the backends' gRPC port;
- security: non-root, read-only root filesystem, no privilege escalation,
  all capabilities dropped, RuntimeDefault seccomp, model volume read-only;
- drain: terminationGracePeriodSeconds > preStop sleep + --drain_timeout_s;
- with --binary vlm-vision=PATH etc.: every VLM_<FLAG> variable set in the
  manifests is a flag the binary really has (abseil ignores unknown ones);
- TLS (prod-tls): every container serves TLS from a cert-manager Certificate's
  Secret mounted read-only, backends require client certificates, the gateway
  presents its certificate to them under a name both backend certificates
  carry; startup/readiness probes are GET /readyz on the metrics port (native
  gRPC probes cannot speak TLS).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

import yaml

ROOT = os.environ.get("VLM_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "k8s"))
import render  # noqa: E402

OVERLAYS = ["dev", "prod", "prod-tls"]
COMPONENTS = {
    # component: (Deployment, health service name, binary)
    "vision": ("vlm-vision", "vlm.v1.VisionEncoder", "vlm-vision"),
    "language": ("vlm-language", "vlm.v1.Language", "vlm-language"),
    "gateway": ("vlm-gateway", "vlm.v1.VisionLanguage", "vlm-gateway"),
}
BACKENDS = ("vision", "language")

failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
    return cond


def quantity(q):
    """Kubernetes quantity -> float (cores or bytes)."""
    q = str(q)
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
             "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    for u in sorted(units, key=len, reverse=True):
        if q.endswith(u):
            return float(q[:-len(u)]) * units[u]
    return float(q)


def selects(selector, labels):
    """Label selector (matchLabels/matchExpressions) against a label map."""
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        op, key, values = e["operator"], e["key"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def env_of(container):
    return {e["name"]: e.get("value") for e in container.get("env") or []}


def port_of(address):
    return int(address.rsplit(":", 1)[1])


def container_port(container, name_or_number):
    for p in container.get("ports") or []:
        if name_or_number in (p.get("name"), p["containerPort"]):
            return p["containerPort"]
    return None


def check_overlay(name, docs):
    where = f"[{name}]"
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    deployments = {d["metadata"]["name"]: d for d in by_kind.get("Deployment", [])}
    services = {d["metadata"]["name"]: d for d in by_kind.get("Service", [])}

    # Namespace: one, restricted, holding every namespaced object.
    namespaces = by_kind.get("Namespace", [])
    if check(len(namespaces) == 1, f"{where} exactly one Namespace"):
        ns = namespaces[0]["metadata"]
        check(ns["labels"].get("pod-security.kubernetes.io/enforce") == "restricted",
              f"{where} namespace enforces the restricted Pod Security Standard")
        for d in docs:
            if d["kind"] not in render.CLUSTER_SCOPED:
                check(d["metadata"].get("namespace") == ns["name"],
                      f"{where} {d['kind']}/{d['metadata']['name']} in namespace {ns['name']}")

    pods = {}  # component -> (deployment, pod spec, labels, container)
    for component, (dep_name, health, _) in COMPONENTS.items():
        w = f"{where} {dep_name}"
        if not check(dep_name in deployments, f"{w}: Deployment present"):
            continue
        dep = deployments[dep_name]
        tmpl = dep["spec"]["template"]
        labels = tmpl["metadata"]["labels"]
        spec = tmpl["spec"]
        check(selects(dep["spec"]["selector"], labels), f"{w}: selector matches its pod template")
        check(labels.get("app.kubernetes.io/component") == component
              and labels.get("app.kubernetes.io/part-of") == "vlm",
              f"{w}: pod labels name component {component} and part-of vlm")
        containers = spec["containers"]
        check(len(containers) == 1, f"{w}: one container")
        c = containers[0]
        pods[component] = (dep, spec, labels, c)
        env = env_of(c)
        grpc_port = container_port(c, "grpc")
        metrics_port = container_port(c, "metrics")
        check(grpc_port is not None and metrics_port is not None,
              f"{w}: container ports named grpc and metrics")
        check(grpc_port is not None and port_of(env.get("VLM_GRPC_ADDRESS", ":0")) == grpc_port,
              f"{w}: VLM_GRPC_ADDRESS listens on the grpc containerPort")
        check(metrics_port is not None
              and port_of(env.get("VLM_METRICS_ADDRESS", ":0")) == metrics_port,
              f"{w}: VLM_METRICS_ADDRESS listens on the metrics containerPort")

        # Probes.
        for probe_name in ("startupProbe", "readinessProbe"):
            probe = c.get(probe_name) or {}
            g = probe.get("grpc")
            if "VLM_TLS_CERT" in env:
                h = probe.get("httpGet") or {}
                check(g is None and h.get("path") == "/readyz"
                      and container_port(c, h.get("port")) == metrics_port,
                      f"{w}: with TLS, {probe_name} is GET /readyz on the metrics port")
                continue
            check(g is not None and g.get("port") == grpc_port and g.get("service") == health,
                  f"{w}: {probe_name} is a gRPC probe on port {grpc_port} service {health}")
        startup = c.get("startupProbe") or {}
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        check(budget >= 300, f"{w}: startupProbe allows >= 300 s for loading (has {budget} s)")
        live = c.get("livenessProbe") or {}
        if "httpGet" in live:
            check(live["httpGet"].get("path") == "/healthz"
                  and container_port(c, live["httpGet"].get("port")) == metrics_port,
                  f"{w}: livenessProbe is GET /healthz on the metrics port")
        elif "grpc" in live:
            check(live["grpc"].get("service", "") not in (health,),
                  f"{w}: livenessProbe must not be the service's readiness")
        else:
            check(False, f"{w}: livenessProbe present (httpGet /healthz)")
        check(live.get("periodSeconds", 10) * live.get("failureThreshold", 3) >= 30,
              f"{w}: livenessProbe tolerates >= 30 s of slow answers")

        # Resources.
        res = c.get("resources") or {}
        for kind in ("cpu", "memory"):
            req = (res.get("requests") or {}).get(kind)
            lim = (res.get("limits") or {}).get(kind)
            if check(req is not None and lim is not None, f"{w}: {kind} request and limit set"):
                check(quantity(req) <= quantity(lim), f"{w}: {kind} request <= limit")

        # Security.
        psc = spec.get("securityContext") or {}
        csc = c.get("securityContext") or {}
        check(psc.get("runAsNonRoot") is True and psc.get("runAsUser", 0) != 0,
              f"{w}: pod runs as a non-root uid")
        check((psc.get("seccompProfile") or {}).get("type") == "RuntimeDefault",
              f"{w}: RuntimeDefault seccomp profile")
        check(csc.get("allowPrivilegeEscalation") is False, f"{w}: allowPrivilegeEscalation false")
        check(csc.get("readOnlyRootFilesystem") is True, f"{w}: readOnlyRootFilesystem")
        check("ALL" in ((csc.get("capabilities") or {}).get("drop") or []),
              f"{w}: capabilities drop ALL")
        check(not csc.get("privileged"), f"{w}: not privileged")
        check(spec.get("automountServiceAccountToken") is False,
              f"{w}: no service account token (the services call no Kubernetes API)")
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        for v in volumes.values():
            check("hostPath" not in v, f"{w}: no hostPath volume in the pod ({v['name']})")
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts") or []}
        check("/tmp" in mounts and "emptyDir" in volumes.get(mounts["/tmp"]["name"], {}),
              f"{w}: writable /tmp is an emptyDir")

        # Model: read-only claim at VLM_MODEL_DIR (the gateway loads no model).
        if component in BACKENDS:
            model_dir = env.get("VLM_MODEL_DIR")
            m = mounts.get(model_dir)
            if check(m is not None, f"{w}: VLM_MODEL_DIR {model_dir} is a mount"):
                check(m.get("readOnly") is True, f"{w}: model mount readOnly")
                pvc = volumes.get(m["name"], {}).get("persistentVolumeClaim")
                check(pvc is not None and pvc.get("readOnly") is True,
                      f"{w}: model volume is a read-only PersistentVolumeClaim")

        # Drain: grace > preStop sleep + drain timeout.
        drain = float(env.get("VLM_DRAIN_TIMEOUT_S", "25"))
        pre_stop = ((c.get("lifecycle") or {}).get("preStop") or {}).get("sleep", {})
        sleep = pre_stop.get("seconds", 0)
        grace = spec.get("terminationGracePeriodSeconds", 30)
        check(grace >= sleep + drain + 5,
              f"{w}: terminationGracePeriodSeconds {grace} >= preStop {sleep} + drain {drain} + 5")

        # PodDisruptionBudget.
        pdbs = [p for p in by_kind.get("PodDisruptionBudget", [])
                if selects(p["spec"]["selector"], labels)]
        check(len(pdbs) == 1, f"{w}: exactly one PodDisruptionBudget selects it")

    # Every Service selects exactly one Deployment's pods, and its target port exists.
    for svc_name, svc in services.items():
        w = f"{where} Service {svc_name}"
        matched = [comp for comp, (_, _, labels, _) in pods.items()
                   if selects({"matchLabels": svc["spec"]["selector"]}, labels)]
        if check(len(matched) == 1, f"{w}: selects the pods of exactly one Deployment"):
            c = pods[matched[0]][3]
            for p in svc["spec"]["ports"]:
                check(container_port(c, p.get("targetPort", p["port"])) is not None,
                      f"{w}: targetPort {p.get('targetPort')} exists in the pod")
    for s in ("vlm-vision", "vlm-language"):
        check(services.get(s, {}).get("spec", {}).get("clusterIP") == "None",
              f"{where} {s} Service is headless")
    gateway_svc = services.get("vlm-gateway", {}).get("spec", {})
    check(gateway_svc.get("type", "ClusterIP") == "ClusterIP"
          and gateway_svc.get("clusterIP") != "None", f"{where} vlm-gateway Service is ClusterIP")

    # The gateway discovers the vision and language replicas through the
    # headless Services' DNS names (--vision_dns, --language_dns).
    if "gateway" in pods:
        genv = env_of(pods["gateway"][3])
        for var, s in (("VLM_VISION_DNS", "vlm-vision"), ("VLM_LANGUAGE_DNS", "vlm-language")):
            port = services.get(s, {}).get("spec", {}).get("ports", [{}])[0].get("port")
            check(re.fullmatch(rf"{s}(\.[a-z0-9.-]+)?:{port}", genv.get(var) or "") is not None,
                  f"{where} gateway {var}={genv.get(var)} names Service {s}:{port}")

    # The gateway's HTTP listener (OpenAI API, web page): a container port named
    # http at VLM_HTTP_ADDRESS, a port of the gateway Service, open to ingress.
    if "gateway" in pods:
        c = pods["gateway"][3]
        http_port = container_port(c, "http")
        check(http_port is not None
              and port_of(env_of(c).get("VLM_HTTP_ADDRESS", "0.0.0.0:8080")) == http_port,
              f"{where} gateway: container port http is VLM_HTTP_ADDRESS's port")
        svc_ports = services.get("vlm-gateway", {}).get("spec", {}).get("ports") or []
        check(http_port is not None and any(
            container_port(c, p.get("targetPort", p["port"])) == http_port for p in svc_ports),
              f"{where} Service vlm-gateway exposes the HTTP port")
        check(http_port is not None and any(
            p["metadata"]["name"] == "vlm-gateway"
            and any(container_port(c, pp.get("port")) == http_port
                    for rule in p["spec"].get("ingress") or [] for pp in rule.get("ports") or [])
            for p in by_kind.get("NetworkPolicy", [])),
              f"{where} NetworkPolicy vlm-gateway admits ingress to the HTTP port")

    # HPA: targets the vision Deployment (prod); dev has none and one replica each.
    hpas = by_kind.get("HorizontalPodAutoscaler", [])
    for h in hpas:
        ref = h["spec"]["scaleTargetRef"]
        check(ref["kind"] == "Deployment" and ref["name"] in deployments,
              f"{where} HPA {h['metadata']['name']} targets an existing Deployment")
        check(1 <= h["spec"]["minReplicas"] <= h["spec"]["maxReplicas"],
              f"{where} HPA min <= max")
    if name == "dev":
        check(not hpas, f"{where} no autoscaler")
        for dep in deployments.values():
            check(dep["spec"].get("replicas") == 1,
                  f"{where} {dep['metadata']['name']} has one replica")
    else:
        check(sorted(h["spec"]["scaleTargetRef"]["name"] for h in hpas)
              == ["vlm-language", "vlm-vision"], f"{where} HPAs for vlm-vision and vlm-language")
        for d in ("vlm-vision", "vlm-language"):
            check("replicas" not in deployments.get(d, {}).get("spec", {}),
                  f"{where} {d} replicas left to the HPA")

    check_network_policies(where, by_kind.get("NetworkPolicy", []), pods)
    if name.endswith("-tls"):
        check_tls(where, by_kind, pods)

    # PodMonitor: selects every vlm pod, on a port they have, and labels `service`.
    monitors = by_kind.get("PodMonitor", [])
    if check(len(monitors) == 1, f"{where} one PodMonitor"):
        pm = monitors[0]["spec"]
        for comp, (_, _, labels, c) in pods.items():
            check(selects(pm["selector"], labels), f"{where} PodMonitor selects {comp}")
            for ep in pm["podMetricsEndpoints"]:
                check(container_port(c, ep["port"]) is not None,
                      f"{where} PodMonitor port {ep['port']} exists in {comp}")
        relabel = [r for ep in pm["podMetricsEndpoints"] for r in ep.get("relabelings", [])
                   if r.get("targetLabel") == "service"]
        check(relabel and relabel[0]["sourceLabels"] ==
              ["__meta_kubernetes_pod_label_app_kubernetes_io_component"],
              f"{where} PodMonitor sets the service label from the component label")

    # Model claim: read-only access mode; in dev bound to a hostPath PersistentVolume.
    claims = {d["metadata"]["name"]: d for d in by_kind.get("PersistentVolumeClaim", [])}
    claim = claims.get("vlm-model")
    if check(claim is not None, f"{where} PersistentVolumeClaim vlm-model"):
        check(claim["spec"]["accessModes"] == ["ReadOnlyMany"], f"{where} model claim ReadOnlyMany")
        if name == "dev":
            pv = {d["metadata"]["name"]: d for d in by_kind.get("PersistentVolume", [])}
            vol = pv.get(claim["spec"].get("volumeName"))
            check(vol is not None and "hostPath" in vol["spec"]
                  and vol["spec"].get("storageClassName") == claim["spec"].get("storageClassName"),
                  f"{where} model claim bound to a hostPath PersistentVolume of its class")

    # Images: dev uses what scripts/build_images.sh tags (localhost/vlm-<service>:<version>,
    # loaded with `kind load image-archive`); prod a registry, tagged with the same version.
    with open(os.path.join(ROOT, "common", "CMakeLists.txt")) as f:
        version = re.search(r'^set\(VLM_VERSION "([^"]+)"\)', f.read(), re.M).group(1)
    for comp, (_, _, _, c) in pods.items():
        image = c["image"]
        if name == "dev":
            want = f"localhost/vlm-{comp}:{version}"
            check(image == want, f"{where} {comp} image {image} is {want}")
        else:
            check("/" in image and image.rsplit("/", 1)[1].endswith(f":{version}"),
                  f"{where} {comp} image {image} is a registry image tagged {version}")
    return pods


def check_network_policies(where, policies, pods):
    """Backends: isolated for ingress, gRPC reachable from gateway pods only."""
    if not all(c in pods for c in COMPONENTS):
        return
    gateway_labels = pods["gateway"][2]
    for comp in BACKENDS:
        _, _, labels, c = pods[comp]
        grpc_port = container_port(c, "grpc")
        selecting = [p for p in policies if selects(p["spec"]["podSelector"], labels)
                     and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
        check(selecting, f"{where} {comp}: some NetworkPolicy isolates its ingress")
        allowed_from_gateway = False
        for p in selecting:
            pname = p["metadata"]["name"]
            for rule in p["spec"].get("ingress") or []:
                ports = rule.get("ports")
                opens_grpc = ports is None or any(
                    container_port(c, pp.get("port")) == grpc_port for pp in ports)
                if not opens_grpc:
                    continue
                peers = rule.get("from")
                check(peers, f"{where} {comp}: policy {pname} opens gRPC to everyone")
                for peer in peers or []:
                    only_gateway = ("podSelector" in peer and "ipBlock" not in peer
                                    and "namespaceSelector" not in peer
                                    and selects(peer["podSelector"], gateway_labels)
                                    and not any(selects(peer["podSelector"], pods[o][2])
                                                for o in BACKENDS))
                    check(only_gateway,
                          f"{where} {comp}: policy {pname} lets a non-gateway peer reach gRPC: {peer}")
                    allowed_from_gateway = allowed_from_gateway or only_gateway
        check(allowed_from_gateway, f"{where} {comp}: the gateway may reach its gRPC port")
    # The gateway policy names the gateway.
    check(any(p["metadata"]["name"] == "vlm-gateway"
              and selects(p["spec"]["podSelector"], gateway_labels) for p in policies),
          f"{where} a NetworkPolicy named for and selecting the gateway")


def binary_flags(path):
    """Flag names the binary accepts, from --helpfull."""
    out = subprocess.run([path, "--helpfull"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    text = out.stdout + out.stderr
    flags = set(re.findall(r"^\s+--([a-z0-9_]+)", text, re.M))
    if not flags:
        raise RuntimeError(f"{path} --helpfull listed no flags:\n{text[:2000]}")
    return flags


def check_tls(where, by_kind, pods):
    certs = {d["spec"]["secretName"]: d for d in by_kind.get("Certificate", [])}
    issuers = {d["metadata"]["name"] for d in by_kind.get("Issuer", [])}
    for cert in certs.values():
        ref = cert["spec"]["issuerRef"]
        check(ref.get("kind") != "Issuer" or ref["name"] in issuers,
              f"{where} Certificate {cert['metadata']['name']}: Issuer {ref['name']} present")
    for comp, (_, spec, _, c) in pods.items():
        w = f"{where} {comp}"
        env = env_of(c)
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        mounts = c.get("volumeMounts") or []

        def secret_of(path):
            for m in mounts:
                if path and path.startswith(m["mountPath"].rstrip("/") + "/"):
                    return m.get("readOnly") is True, (volumes.get(m["name"], {}).get("secret")
                                                       or {}).get("secretName")
            return False, None

        wanted = ["VLM_TLS_CERT", "VLM_TLS_KEY"]
        wanted += ["VLM_TLS_CLIENT_CA"] if comp in BACKENDS else [
            "VLM_BACKEND_TLS_CA", "VLM_BACKEND_TLS_CERT", "VLM_BACKEND_TLS_KEY"]
        for var in wanted:
            read_only, secret = secret_of(env.get(var))
            check(read_only and secret in certs,
                  f"{w}: {var}={env.get(var)} is in a read-only mount of a Certificate's Secret")
        _, secret = secret_of(env.get("VLM_TLS_CERT"))
        if secret in certs:
            usages = certs[secret]["spec"].get("usages") or []
            check("server auth" in usages, f"{w}: its Certificate has usage server auth")
            if comp == "gateway":
                check("client auth" in usages, f"{w}: its Certificate has usage client auth")
    if "gateway" in pods:
        name = env_of(pods["gateway"][3]).get("VLM_BACKEND_TLS_SERVER_NAME")
        check(bool(name), f"{where} gateway sets VLM_BACKEND_TLS_SERVER_NAME (vision is reached by IP)")
        for comp in BACKENDS:
            if comp not in pods:
                continue
            secret = None
            for m in pods[comp][3].get("volumeMounts") or []:
                v = {v["name"]: v for v in pods[comp][1].get("volumes") or []}.get(m["name"], {})
                secret = (v.get("secret") or {}).get("secretName") or secret
            dns = (certs.get(secret) or {}).get("spec", {}).get("dnsNames") or []
            check(name in dns, f"{where} {comp} Certificate names {name} (gateway's server name)")


def check_env_flags(where, pods, binaries):
    for comp, (_, _, _, c) in pods.items():
        binary = COMPONENTS[comp][2]
        if binary not in binaries:
            continue
        flags = binaries[binary]
        for var in env_of(c):
            if var.startswith("VLM_"):
                check(var[4:].lower() in flags,
                      f"{where} {comp}: {var} is not a flag of {binary} (--{var[4:].lower()})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kubectl", default=shutil.which("kubectl"))
    ap.add_argument("--binary", action="append", default=[], help="NAME=PATH")
    args = ap.parse_args()
    binaries = {}
    for b in args.binary:
        name, path = b.split("=", 1)
        binaries[name] = binary_flags(path)
        print(f"{name}: {len(binaries[name])} flags")

    for overlay in OVERLAYS:
        directory = os.path.join(ROOT, "k8s", "overlays", overlay)
        docs = render.render(directory)
        print(f"[{overlay}] {len(docs)} resources: "
              + ", ".join(sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)))
        pods = check_overlay(overlay, docs)
        check_env_flags(f"[{overlay}]", pods, binaries)

        if args.kubectl:
            out = subprocess.run([args.kubectl, "kustomize", directory], capture_output=True,
                                 text=True, timeout=120)
            if check(out.returncode == 0, f"[{overlay}] kubectl kustomize: {out.stderr.strip()}"):
                real = list(yaml.safe_load_all(out.stdout))
                key = lambda d: (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"])
                mine = {key(d): d for d in docs}
                theirs = {key(d): d for d in real if d}
                check(set(mine) == set(theirs),
                      f"[{overlay}] same resources as kustomize: {set(mine) ^ set(theirs)}")
                for k in set(mine) & set(theirs):
                    check(mine[k] == theirs[k], f"[{overlay}] {k} differs from kustomize's output")
                print(f"[{overlay}] identical to `kubectl kustomize` ({len(real)} resources)")
        else:
            print(f"[{overlay}] kubectl not installed: cross-check with real kustomize skipped")

    if failures:
        print(f"\n{len(failures)} FAILED:")
        for f in failures:
            print("  - " + f)
        return 1
    print("all invariants hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
