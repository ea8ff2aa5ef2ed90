#!/usr/bin/env bash
# Builds the three container images of deploy/Dockerfile without a Docker engine
# or a registry: buildah (daemonless, chroot isolation) on a Debian bookworm base
# that debootstrap makes from Debian's archive. Needs root.
#
#   scripts/build_images.sh [--save DIR] [--fresh-base] [--no-ccache]
#
#   --save DIR     also write DIR/vlm-<target>-<version>.oci.tar (OCI archives, skopeo)
#                  for `skopeo copy oci-archive:... docker://REGISTRY/...` or
#                  `kind load image-archive` (k8s/README.md)
#   --fresh-base   debootstrap the base again instead of reusing the cached one
#   --no-ccache    a cold build: no host ccache, and the first target without buildah's
#                  layer cache (packages installed and the project compiled again)
#
# Steps: (1) `debootstrap --variant=minbase bookworm` into a tarball cached in
# $VLM_IMAGE_CACHE (reused when present), imported as localhost/vlm-base:bookworm
# (stand-in for debian:bookworm, with the same apt sources) and
# localhost/vlm-base:bookworm-slim (the same plus the slim image's dpkg
# excludes of docs, man pages and locales); (2) `buildah bud` of
# deploy/Dockerfile's targets vision, language, gateway on them (one Dockerfile:
# the stages, the build and the runtime package derivation are those a Docker
# engine runs), with --layers so the build stage runs once for all three;
# (3) tags localhost/vlm-<target>:<version> (VLM_VERSION of common/CMakeLists.txt).
# The build stage compiles the project inside the image; the host's ccache
# ($CCACHE_DIR, shared with the developers' builds) is bind-mounted into it.
#
#   VLM_IMAGE_CACHE   cache of the base root file system (default ~/.cache/vlm/images)
#   MIRROR            Debian mirror (default http://deb.debian.org/debian)
#   VLM_SKIP_APT=1    do not install missing tools; name them and stop
#   BUILDAH_ISOLATION default chroot (works without user namespaces or a runtime)
set -euo pipefail
trap 'echo "build_images: failed (line $LINENO): $BASH_COMMAND" >&2' ERR
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${VLM_IMAGE_CACHE:-${HOME:-/root}/.cache/vlm/images}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
SECURITY_MIRROR="${SECURITY_MIRROR:-${MIRROR%/debian}/debian-security}"
export BUILDAH_ISOLATION="${BUILDAH_ISOLATION:-chroot}"
CCACHE_HOST_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
# The build stage's ccache directory (deploy/Dockerfile sets CCACHE_DIR to it):
# the host cache is mounted there.
BUILDER_CCACHE_DIR=/var/cache/vlm-build/ccache
TARGETS=(vision language gateway)
BASE=localhost/vlm-base:bookworm
SLIM=localhost/vlm-base:bookworm-slim

save_dir="" fresh_base=0 use_ccache=1
while (($#)); do
  case "$1" in
    --save) save_dir="${2:?--save needs a directory}"; shift 2 ;;
    --fresh-base) fresh_base=1; shift ;;
    --no-ccache) use_ccache=0; shift ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;
    *) echo "build_images: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

say() { echo "build_images: $*" >&2; }
die() { say "$*"; exit 1; }

# --- what the build needs, named when missing ----------------------------------
if [[ "$(id -u)" != 0 ]]; then
  die "needs root: debootstrap, chroot isolation and buildah's storage mount file systems.
  Run: sudo $0 $*"
fi
# podman and runc run the images (deploy/image_smoke_test.py): on hosts with hybrid
# cgroups (containers in containers) podman's default crun cannot start them, runc can.
declare -A TOOL_PACKAGE=([debootstrap]=debootstrap [buildah]=buildah [skopeo]=skopeo
                         [podman]=podman [runc]=runc)
missing=()
for tool in "${!TOOL_PACKAGE[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("${TOOL_PACKAGE[$tool]}")
done
if ((${#missing[@]})); then
  if [[ "${VLM_SKIP_APT:-0}" == 1 ]]; then
    die "missing tools: ${missing[*]}. Install them with:
  apt-get install -y --no-install-recommends ${missing[*]}"
  fi
  say "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
    || die "could not install ${missing[*]} (apt-get install -y ${missing[*]})"
fi
# chroot isolation still unshares the mount, UTS and IPC namespaces for each RUN.
if ! unshare --mount --uts --ipc true 2>/dev/null; then
  die "cannot create mount/UTS/IPC namespaces (missing CAP_SYS_ADMIN, e.g. an unprivileged
  container): buildah cannot run the Dockerfile's RUN steps here"
fi
mkdir -p "$CACHE"
if ! info_err="$(buildah info 2>&1 >/dev/null)"; then
  die "buildah cannot open its storage: $info_err"
fi
driver="$(buildah info --format '{{index .store "GraphDriverName"}}')"

VERSION="$(sed -n 's/^set(VLM_VERSION "\(.*\)")$/\1/p' "$ROOT/common/CMakeLists.txt")"
[[ -n "$VERSION" ]] || die "no set(VLM_VERSION \"...\") in common/CMakeLists.txt"
started=$(date +%s)

# --- (1) base root file system, cached ------------------------------------------
tarball="$CACHE/bookworm-minbase.tar"
if ((fresh_base)) || [[ ! -s "$tarball" ]]; then
  t0=$(date +%s)
  rootfs="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
  trap 'rm -rf "$rootfs"' EXIT
  say "debootstrap --variant=minbase bookworm (from $MIRROR)"
  nice -n 10 debootstrap --variant=minbase bookworm "$rootfs" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
    || die "debootstrap failed (is $MIRROR reachable?); see $CACHE/debootstrap.log"
  # The apt sources of the official debian:bookworm image: the release, its
  # updates and security, so the images get the same package versions.
  rm -f "$rootfs/etc/apt/sources.list"
  cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY_MIRROR
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  # No init system in a build: package scripts must not start daemons.
  printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
  chmod 755 "$rootfs/usr/sbin/policy-rc.d"
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/tmp/*
  : >"$rootfs/etc/resolv.conf"
  tar --numeric-owner --xattrs -C "$rootfs" -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
  rm -rf "$rootfs"
  trap - EXIT
  say "base root file system: $(du -m "$tarball" | cut -f1) MB in $(($(date +%s) - t0)) s ($tarball)"
else
  say "base root file system: reusing $tarball"
fi
base_id="$(stat -c '%Y-%s' "$tarball")"

# Imports the tarball as $BASE and derives $SLIM, unless both carry its id.
image_label() { buildah inspect --type image --format "{{index .ImageAnnotations \"$2\"}}" "$1" 2>/dev/null || true; }
if [[ "$(image_label "$BASE" org.vlm.base-id)" != "$base_id" ||
      "$(image_label "$SLIM" org.vlm.base-id)" != "$base_id" ]]; then
  c="$(buildah from --quiet scratch)"
  buildah add --quiet "$c" "$tarball" / >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd '["bash"]' --annotation "org.vlm.base-id=$base_id" "$c"
  buildah commit --quiet --rm "$c" "$BASE" >/dev/null
  # The slim variant: what debian:bookworm-slim leaves out of every package.
  c="$(buildah from --quiet --pull=never "$BASE")"
  buildah run "$c" -- sh -c 'cat >/etc/dpkg/dpkg.cfg.d/docker-slim <<EOF
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
EOF
find /usr/share/doc -mindepth 1 -not -name copyright -not -type d -delete
find /usr/share/doc -mindepth 1 -type d -empty -delete
rm -rf /usr/share/man/* /usr/share/info/* /usr/share/lintian/*
find /usr/share/locale -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} +'
  buildah config --annotation "org.vlm.base-id=$base_id" "$c"
  buildah commit --quiet --rm "$c" "$SLIM" >/dev/null
  say "imported $BASE and $SLIM"
fi

# --- (2) the three targets of deploy/Dockerfile ---------------------------------
volumes=()
if ((use_ccache)); then
  mkdir -p "$CCACHE_HOST_DIR"
  volumes=(--volume "$CCACHE_HOST_DIR:$BUILDER_CCACHE_DIR")
fi
# The build context: a snapshot of the checkout (tracked and untracked files that
# git does not ignore, as a clean clone plus local edits would have), so that
# edits during the build cannot reach one target and not another, and the three
# targets share the build stage's cached layers. Outside a git checkout: the tree.
context="$(mktemp -d "$CACHE/context.XXXXXX")"
trap 'rm -rf "$context"' EXIT
commit="$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
if [[ "$commit" != unknown ]]; then
  git -C "$ROOT" ls-files -z --cached --others --exclude-standard |
    tar -C "$ROOT" --null --ignore-failed-read -cf - --files-from=- | tar -C "$context" -xf -
else
  cp -a "$ROOT/." "$context/"
fi
declare -A seconds=()
no_cache=()
((use_ccache)) || no_cache=(--no-cache)
for target in "${TARGETS[@]}"; do
  t0=$(date +%s)
  tag="localhost/vlm-$target:$VERSION"
  say "buildah bud --target $target -> $tag (storage driver $driver, isolation $BUILDAH_ISOLATION)"
  nice -n 10 buildah bud --layers --pull=never --format docker \
    --file "$ROOT/deploy/Dockerfile" --ignorefile "$ROOT/deploy/Dockerfile.dockerignore" \
    --build-arg BUILD_IMAGE="$BASE" --build-arg RUNTIME_IMAGE="$SLIM" \
    "${volumes[@]}" "${no_cache[@]}" --target "$target" --tag "$tag" "$context" 2>&1 |
    while IFS= read -r line; do printf '%(%H:%M:%S)T %s\n' -1 "$line"; done >"$CACHE/bud-$target.log" \
    || { tail -n 40 "$CACHE/bud-$target.log" >&2; die "buildah bud --target $target failed; see $CACHE/bud-$target.log"; }
  # Labels after the build: buildah 1.28 reuses a cached final image whatever its
  # --label values, so a rebuild at another commit would keep the old ones.
  c="$(buildah from --quiet --pull=never "$tag")"
  buildah config --label "org.opencontainers.image.version=$VERSION" \
    --label "org.opencontainers.image.revision=$commit" "$c"
  buildah commit --quiet --rm --format docker "$c" "$tag" >/dev/null  # docker: keeps HEALTHCHECK
  seconds[$target]=$(($(date +%s) - t0))
  no_cache=()  # the other targets reuse the stages just built
done

# --- (3) archives and the closing note ------------------------------------------
if [[ -n "$save_dir" ]]; then
  mkdir -p "$save_dir"
  for target in "${TARGETS[@]}"; do
    tag="localhost/vlm-$target:$VERSION"
    out="$save_dir/vlm-$target-$VERSION.oci.tar"
    rm -f "$out"
    skopeo copy --quiet "containers-storage:$tag" "oci-archive:$out:$tag" \
      || die "skopeo copy of $tag to $out failed"
  done
fi

# Steps of the builds that took 5 s or more (from the time-stamped logs).
step_times() {
  awk 'function secs(t) { split(t, a, ":"); return a[1] * 3600 + a[2] * 60 + a[3] }
       / STEP [0-9]+\/[0-9]+: | COMMIT / { if (name != "" && secs($1) - t0 >= 5) printf "    %4d s  %s\n", secs($1) - t0, name
                                     t0 = secs($1); name = substr($0, 10, 90) }
       END { }' "$1"
}
for target in "${TARGETS[@]}"; do
  slow="$(step_times "$CACHE/bud-$target.log")"
  [[ -z "$slow" ]] || printf 'bud --target %s, steps of 5 s or more:\n%s\n' "$target" "$slow"
done
echo "images (version $VERSION, storage driver $driver, $(($(date +%s) - started)) s in all):"
for target in "${TARGETS[@]}"; do
  tag="localhost/vlm-$target:$VERSION"
  size="$(buildah images --noheading --format '{{.Size}}' "$tag")"
  line="  $tag  bud ${seconds[$target]} s  $size"
  [[ -n "$save_dir" ]] && line+="  $(du -m "$save_dir/vlm-$target-$VERSION.oci.tar" | cut -f1) MB archive"
  echo "$line"
done
