#!/usr/bin/env bash
# Proves scripts/test.sh works from nothing: clones the committed HEAD into a
# fresh `debootstrap --variant=minbase bookworm` root and runs it there, as a
# new user on a bare machine would. Needs root and Debian's debootstrap.
#   CHROOT_DIR   where the root lives (default /srv/chroot/vlm-bookworm)
#   KEEP=1       reuse an existing root instead of bootstrapping a new one
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHROOT_DIR="${CHROOT_DIR:-/srv/chroot/vlm-bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"

command -v debootstrap >/dev/null || apt-get install -y -qq --no-install-recommends debootstrap
if [[ "${KEEP:-0}" != 1 || ! -x "$CHROOT_DIR/bin/bash" ]]; then
  rm -rf "$CHROOT_DIR"
  debootstrap --variant=minbase bookworm "$CHROOT_DIR" "$MIRROR"
fi
# A chroot shares the host's network: give it the host's name resolution
# (debootstrap writes no /etc/hosts, so even "localhost" would not resolve).
cp /etc/resolv.conf "$CHROOT_DIR/etc/resolv.conf"
cp /etc/hosts "$CHROOT_DIR/etc/hosts"
# The workplace reaches registries through a TLS-intercepting egress proxy whose
# CA every machine here trusts (/usr/local/share/ca-certificates, and
# NODE_EXTRA_CA_CERTS in the environment). Give the chroot the same trust; the
# ca-certificates package that setup.sh installs folds these into its bundle.
mkdir -p "$CHROOT_DIR/usr/local/share/ca-certificates"
cp /usr/local/share/ca-certificates/*.crt "$CHROOT_DIR/usr/local/share/ca-certificates/" 2>/dev/null || true
# No init system in a chroot: package scripts must not start daemons.
printf '#!/bin/sh\nexit 101\n' > "$CHROOT_DIR/usr/sbin/policy-rc.d"
chmod +x "$CHROOT_DIR/usr/sbin/policy-rc.d"

cleanup() {
  for m in dev/pts dev proc sys; do umount -l "$CHROOT_DIR/$m" 2>/dev/null || true; done
}
trap cleanup EXIT
mount -t proc proc "$CHROOT_DIR/proc"
mount -t sysfs sys "$CHROOT_DIR/sys"
mount --bind /dev "$CHROOT_DIR/dev"
mount --bind /dev/pts "$CHROOT_DIR/dev/pts"

rm -rf "$CHROOT_DIR/root/vlm"
git clone -q "$ROOT" "$CHROOT_DIR/root/vlm"
chroot "$CHROOT_DIR" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  TERM=dumb LANG=C.UTF-8 ${NODE_EXTRA_CA_CERTS:+NODE_EXTRA_CA_CERTS=$NODE_EXTRA_CA_CERTS} /bin/bash -c 'cd /root/vlm && bash scripts/test.sh'
