#!/usr/bin/python3
"""Renders a kustomization directory like `kubectl kustomize DIR`.

kustomize is not packaged in Debian bookworm, so this implements the subset of
it that k8s/ uses, and refuses anything else (an unsupported field is an error,
never silently ignored):

  resources   files (multi-document YAML) and directories with a kustomization
  namespace   set on every namespaced resource
  replicas    spec.replicas of Deployments/StatefulSets/ReplicaSets by name
  images      newName / newTag / digest of matching container images
  patches     strategic-merge patches from files (target = the patch's own
              apiVersion group, kind and name): maps merge, null deletes a key,
              lists with a merge key (containers, env, volumes, ...) merge by
              it, other lists are replaced, `$patch: delete` deletes a whole
              resource or a list element

tests/unit/k8s_manifests_test.py compares its output with real kustomize when
`kubectl` (which embeds kustomize) is installed.

Usage: k8s/render.py k8s/overlays/dev > dev.yaml
"""
import copy
import os
import sys

import yaml

CLUSTER_SCOPED = {
    "APIService", "CSIDriver", "CSINode", "ClusterRole", "ClusterRoleBinding",
    "CustomResourceDefinition", "IngressClass", "MutatingWebhookConfiguration", "Namespace",
    "PersistentVolume", "PriorityClass", "RuntimeClass", "StorageClass",
    "ValidatingWebhookConfiguration", "VolumeAttachment",
}
# kustomize's legacy output order.
KIND_ORDER_FIRST = [
    "Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition", "ServiceAccount",
    "PodSecurityPolicy", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding", "ConfigMap",
    "Secret", "Endpoints", "Service", "LimitRange", "PriorityClass", "PersistentVolume",
    "PersistentVolumeClaim", "Deployment", "StatefulSet", "CronJob", "PodDisruptionBudget",
]
KIND_ORDER_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]
REPLICATED_KINDS = {"Deployment", "ReplicaSet", "ReplicationController", "StatefulSet"}
# Strategic-merge keys of the core/apps list fields this repo patches.
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "volumes": "name", "env": "name", "volumeMounts": "mountPath", "imagePullSecrets": "name",
    "topologySpreadConstraints": "topologyKey",
}
SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "namespace", "replicas", "images", "patches"}


class RenderError(Exception):
    pass


def _group(api_version):
    return api_version.split("/")[0] if "/" in api_version else ""


def _resource_id(obj):
    meta = obj.get("metadata") or {}
    return (_group(obj.get("apiVersion", "")), obj.get("kind"), meta.get("namespace"),
            meta.get("name"))


def _load_yaml_documents(path):
    with open(path, encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    for d in docs:
        if not isinstance(d, dict) or "kind" not in d or "apiVersion" not in d:
            raise RenderError(f"{path}: every document needs apiVersion and kind")
    return docs


def _find_kustomization(directory):
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    raise RenderError(f"{directory}: no kustomization.yaml")


# --- strategic merge --------------------------------------------------------

def _merge_list(field, base, patch, where):
    key = MERGE_KEYS.get(field)
    if field == "ports" and all(isinstance(p, dict) and "containerPort" in p for p in patch):
        key = "containerPort"
    if key is None:
        for item in patch:
            if isinstance(item, dict) and "$patch" in item:
                raise RenderError(f"{where}: $patch inside list {field!r} without a merge key")
        return copy.deepcopy(patch)
    # Like kustomize: the patch's elements first, in patch order (merged into
    # the original element of the same key), then the untouched originals.
    base = base or []
    merged, patched_keys = [], set()
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise RenderError(f"{where}: items of {field!r} need the merge key {key!r}")
        patched_keys.add(item[key])
        original = next((b for b in base if b.get(key) == item[key]), None)
        directive = item.get("$patch")
        if directive == "delete":
            continue
        if directive is not None:
            raise RenderError(f"{where}: unsupported $patch: {directive}")
        if original is None:
            merged.append(_strip_directives(item))
        else:
            merged.append(_merge_map(original, item, f"{where}.{field}[{item[key]}]"))
    return merged + [copy.deepcopy(b) for b in base if b.get(key) not in patched_keys]


def _strip_directives(value):
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items()
                if not k.startswith("$") and v is not None}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return value


def _merge_map(base, patch, where):
    result = copy.deepcopy(base) if isinstance(base, dict) else {}
    for k, v in patch.items():
        if k.startswith("$"):
            raise RenderError(f"{where}: unsupported directive {k}")
        if v is None:
            result.pop(k, None)
        elif isinstance(v, dict):
            result[k] = _merge_map(result.get(k), v, f"{where}.{k}")
        elif isinstance(v, list):
            result[k] = _merge_list(k, result.get(k), v, f"{where}.{k}")
        else:
            result[k] = v
    return result


def _apply_patch(resources, patch, where):
    directive = patch.get("$patch")
    body = {k: v for k, v in patch.items() if k != "$patch"}
    meta = body.get("metadata") or {}
    matches = [i for i, r in enumerate(resources)
               if r["kind"] == body["kind"] and _group(r["apiVersion"]) == _group(body["apiVersion"])
               and r["metadata"]["name"] == meta.get("name")
               and ("namespace" not in meta or r["metadata"].get("namespace") == meta["namespace"])]
    if len(matches) != 1:
        raise RenderError(f"{where}: patch for {body['kind']}/{meta.get('name')} matches "
                          f"{len(matches)} resources")
    i = matches[0]
    if directive == "delete":
        del resources[i]
    elif directive is None:
        resources[i] = _merge_map(resources[i], body, f"{body['kind']}/{meta.get('name')}")
    else:
        raise RenderError(f"{where}: unsupported $patch: {directive}")


# --- transformers -------------------------------------------------------------

def _split_image(image):
    """'reg:5000/a/b:tag@sha256:x' -> ('reg:5000/a/b', ':tag', '@sha256:x')."""
    digest = ""
    if "@" in image:
        image, digest = image.split("@", 1)
        digest = "@" + digest
    tag = ""
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        image, tag = image[:colon], image[colon:]
    return image, tag, digest


def _containers(obj):
    """Every container list in obj (pod templates of any workload kind)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("containers", "initContainers") and isinstance(v, list):
                yield v
            else:
                yield from _containers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _containers(v)


def _apply_images(resources, images, where):
    for spec in images:
        unknown = set(spec) - {"name", "newName", "newTag", "digest"}
        if unknown:
            raise RenderError(f"{where}: unsupported image fields {sorted(unknown)}")
        for r in resources:
            for containers in _containers(r):
                for c in containers:
                    name, tag, digest = _split_image(c.get("image", ""))
                    if name != spec["name"]:
                        continue
                    if "newName" in spec:
                        name = spec["newName"]
                    if "newTag" in spec:
                        tag, digest = ":" + str(spec["newTag"]), ""
                    if "digest" in spec:
                        tag, digest = "", "@" + spec["digest"]
                    c["image"] = name + tag + digest


def _apply_replicas(resources, replicas, where):
    for spec in replicas:
        hits = [r for r in resources
                if r["kind"] in REPLICATED_KINDS and r["metadata"]["name"] == spec["name"]]
        if not hits:
            raise RenderError(f"{where}: replicas for {spec['name']!r} match no workload")
        for r in hits:
            r.setdefault("spec", {})["replicas"] = int(spec["count"])


# --- kustomization ----------------------------------------------------------

def render(directory):
    """The resources of the kustomization in `directory`, transformed."""
    kpath = _find_kustomization(directory)
    with open(kpath, encoding="utf-8") as f:
        k = yaml.safe_load(f) or {}
    unknown = set(k) - SUPPORTED_FIELDS
    if unknown:
        raise RenderError(f"{kpath}: fields not supported by this renderer: {sorted(unknown)}")

    resources = []
    for entry in k.get("resources", []):
        path = os.path.normpath(os.path.join(directory, entry))
        docs = render(path) if os.path.isdir(path) else _load_yaml_documents(path)
        for d in docs:
            if any(_resource_id(d) == _resource_id(r) for r in resources):
                raise RenderError(f"{kpath}: {d['kind']}/{d['metadata']['name']} defined twice")
            resources.append(d)

    for entry in k.get("patches", []):
        if set(entry) != {"path"}:
            raise RenderError(f"{kpath}: only file patches ({{path: ...}}) are supported")
        ppath = os.path.join(directory, entry["path"])
        for patch in _load_yaml_documents(ppath):
            _apply_patch(resources, patch, ppath)

    if "namespace" in k:
        for r in resources:
            if r["kind"] not in CLUSTER_SCOPED:
                r["metadata"]["namespace"] = k["namespace"]

    _apply_replicas(resources, k.get("replicas", []), kpath)
    _apply_images(resources, k.get("images", []), kpath)
    return resources


def sort_key(obj):
    kind = obj["kind"]
    if kind in KIND_ORDER_FIRST:
        rank = KIND_ORDER_FIRST.index(kind)
    elif kind in KIND_ORDER_LAST:
        rank = len(KIND_ORDER_FIRST) + 1 + KIND_ORDER_LAST.index(kind)
    else:
        rank = len(KIND_ORDER_FIRST)
    meta = obj["metadata"]
    return (rank, kind, meta.get("namespace") or "", meta["name"])


class _Dumper(yaml.SafeDumper):
    """Quotes strings a YAML 1.1 reader (Go's yaml.v2, used by kubectl) would
    take for booleans, which PyYAML writes bare: y, n, Y, N."""


def _represent_str(dumper, value):
    style = '"' if value in ("y", "Y", "n", "N") else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def main(argv):
    if len(argv) != 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    try:
        resources = sorted(render(argv[1]), key=sort_key)
    except (RenderError, OSError, yaml.YAMLError) as e:
        print(f"render.py: {e}", file=sys.stderr)
        return 1
    yaml.dump_all(resources, sys.stdout, Dumper=_Dumper, sort_keys=True, default_flow_style=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
