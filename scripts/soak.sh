#!/usr/bin/env bash
# Soak test: runs serve.sh's system (tiny checkpoint unless MODEL_DIR is set) on
# loopback ports picked at random, drives mixed traffic through the gateway for
# MINUTES (text, new and repeated images, cancellations, bad requests;
# scripts/soak_driver.py), prints requests by status, latency percentiles and
# each service's RSS every minute, then a summary, and stops the system.
#
#   scripts/soak.sh [MINUTES]        # default 10; 0.5 .. 240
#
# Fails (exit 1) if a request gets no final status, a request ends with a status
# its kind does not expect, a service restarts, or a service's RSS grows after
# the warm-up (min(2, MINUTES/5) minutes, at least 0.5) by more than
# max(10 %, 32 MiB). The vision memory cache is bounded to 8 MiB here so that it
# fills during the warm-up: later growth is then not the cache doing its job.
#
# Environment: SOAK_WORKERS (concurrent clients, default 3), MODEL_DIR,
# VLM_BUILD_DIR; SOAK_VISION_FLAGS / SOAK_LANGUAGE_FLAGS / SOAK_GATEWAY_FLAGS are
# added to the services' flags. Logs: $VLM_BUILD_DIR/soak/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${VLM_BUILD_DIR:-$ROOT/build}"
MINUTES="${1:-10}"
if ! /usr/bin/python3 -c "import sys; m=float(sys.argv[1]); sys.exit(0 if 0.5 <= m <= 240 else 1)" \
    "$MINUTES" 2>/dev/null; then
  echo "usage: scripts/soak.sh [MINUTES]   (0.5 .. 240; got '$MINUTES')" >&2
  exit 2
fi
WORK="$BUILD_DIR/soak"
mkdir -p "$WORK"
say() { echo "soak: $*" >&2; }

# Seven free loopback ports.
read -r GP VP LP GMP VMP LMP HP < <(/usr/bin/python3 - <<'PY'
import socket
socks = [socket.socket() for _ in range(7)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])
for s in socks:
    s.close()
PY
)

SERVE_PID=""
cleanup() {
  if [[ -n "$SERVE_PID" ]] && kill -0 "$SERVE_PID" 2>/dev/null; then
    say "stopping the system"
    kill -TERM "$SERVE_PID" 2>/dev/null || true
    for _ in $(seq 600); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SERVE_PID" 2>/dev/null || true
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say "starting serve.sh on 127.0.0.1 (gateway $GP, vision $VP, language $LP); log $WORK/serve.log"
SERVE_HOST=127.0.0.1 GATEWAY_PORT=$GP VISION_PORT=$VP LANGUAGE_PORT=$LP \
  GATEWAY_METRICS_PORT=$GMP VISION_METRICS_PORT=$VMP LANGUAGE_METRICS_PORT=$LMP HTTP_PORT=$HP \
  VISION_FLAGS="--cache_max_bytes=8388608 ${SOAK_VISION_FLAGS:-}" \
  LANGUAGE_FLAGS="${SOAK_LANGUAGE_FLAGS:-}" GATEWAY_FLAGS="${SOAK_GATEWAY_FLAGS:-}" \
  VLM_BUILD_DIR="$BUILD_DIR" "$ROOT/scripts/serve.sh" >"$WORK/serve.log" 2>&1 &
SERVE_PID=$!
for _ in $(seq 1200); do
  grep -q "serve: ready in" "$WORK/serve.log" 2>/dev/null && break
  if ! kill -0 "$SERVE_PID" 2>/dev/null; then
    say "serve.sh exited before the system was ready:"
    tail -n 30 "$WORK/serve.log" >&2
    exit 1
  fi
  sleep 0.5
done
if ! grep -q "serve: ready in" "$WORK/serve.log"; then
  say "the system was not ready within 10 minutes"; tail -n 30 "$WORK/serve.log" >&2; exit 1
fi

rc=0
/usr/bin/python3 "$ROOT/scripts/soak_driver.py" --gateway "127.0.0.1:$GP" \
  --metrics "gateway=127.0.0.1:$GMP" --metrics "vision=127.0.0.1:$VMP" \
  --metrics "language=127.0.0.1:$LMP" --minutes "$MINUTES" \
  --workers "${SOAK_WORKERS:-3}" --stubs "$WORK/pystubs" --proto "$ROOT/proto" \
  | tee "$WORK/report.txt" || rc=$?
if ! kill -0 "$SERVE_PID" 2>/dev/null; then
  say "serve.sh is gone: a service exited during the soak"; tail -n 30 "$WORK/serve.log" >&2
  rc=1
fi
exit $rc
