#!/usr/bin/env bash
# Prints, one per line and sorted, the Debian packages that provide the shared
# libraries the given ELF binaries load (their whole ldd closure). The
# Dockerfile's runtime stage installs exactly these into debian:bookworm-slim.
#
#   deploy/runtime-packages.sh build/services/vision/vlm-vision ...
#
# A library reached through a symlink (libblas.so.3 -> the alternatives system
# -> OpenBLAS) counts as the package of the file it resolves to, so the BLAS
# LibTorch uses here is the one installed there. Fails if a library is missing
# or belongs to no package (it could not be installed then).
set -euo pipefail
if (( $# == 0 )); then
  echo "usage: $0 BINARY..." >&2
  exit 2
fi

ldd_out="$(for bin in "$@"; do
  [[ -f "$bin" ]] || { echo "runtime-packages: no such file: $bin" >&2; exit 1; }
  ldd "$bin"
done)"
if grep -q 'not found' <<<"$ldd_out"; then
  echo "runtime-packages: unresolved libraries:" >&2
  grep 'not found' <<<"$ldd_out" >&2
  exit 1
fi
# "libfoo.so.1 => /lib/x86_64-linux-gnu/libfoo.so.1 (0x...)" and the loader line.
mapfile -t libs < <(awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' \
                      <<<"$ldd_out" | sort -u)

# Candidate names of each library as dpkg may have recorded it: the resolved
# file first, then the path ldd printed, each with and without /usr (usrmerge).
candidates() {
  local c
  for c in "$(readlink -f "$1")" "$1"; do
    printf '%s\n' "$c" "${c#/usr}" "/usr$c"
  done | awk '!seen[$0]++'
}
mapfile -t all < <(for lib in "${libs[@]}"; do candidates "$lib"; done | sort -u)

# One dpkg query for everything: "pkg1:amd64, pkg2: /path" per owned path.
declare -A owners=()
while IFS= read -r line; do
  [[ "$line" == *": /"* ]] || continue  # skips "diversion by ..." lines
  owners["${line##*: }"]="${line%: /*}"
done < <(dpkg-query -S "${all[@]}" 2>/dev/null || true)

status=0
packages=()
for lib in "${libs[@]}"; do
  found=""
  while IFS= read -r c; do
    if [[ -n "${owners[$c]:-}" ]]; then found="${owners[$c]}"; break; fi
  done < <(candidates "$lib")
  if [[ -z "$found" ]]; then
    echo "runtime-packages: $lib ($(readlink -f "$lib")) belongs to no Debian package" >&2
    status=1
    continue
  fi
  mapfile -t -O "${#packages[@]}" packages < <(tr ',' '\n' <<<"$found" | sed 's/^ *//; s/:.*$//')
done
printf '%s\n' "${packages[@]}" | sort -u
exit "$status"
