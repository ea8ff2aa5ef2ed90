#!/usr/bin/env bash
# Starts the whole system on one machine, on loopback, and keeps it running
# until Ctrl-C (or SIGTERM), which stops all three services cleanly.
#
#   scripts/serve.sh                         # the generated `tiny` checkpoint
#   MODEL_DIR=/models/Qwen3-VL-2B-Instruct scripts/serve.sh
#
# Environment (all optional):
#   MODEL_DIR              a Qwen3-VL checkpoint directory (default: `tiny`, made by
#                          scripts/make_checkpoint.sh under $VLM_CACHE_DIR/checkpoints)
#   SERVE_HOST             listen address of all three (default 127.0.0.1)
#   GATEWAY_PORT           gRPC port of the gateway, the public API (default 50051)
#   HTTP_PORT              the gateway's OpenAI-compatible HTTP API and web page (default 8080)
#   VISION_PORT            gRPC port of the vision encoder (default 50052)
#   LANGUAGE_PORT          gRPC port of the language service (default 50053)
#   GATEWAY_METRICS_PORT   /metrics /healthz /readyz of the gateway (default 9090)
#   VISION_METRICS_PORT    ... of the vision encoder (default 9091)
#   LANGUAGE_METRICS_PORT  ... of the language service (default 9092)
#   VISION_FLAGS, LANGUAGE_FLAGS, GATEWAY_FLAGS   extra flags for each service
#   SERVE_READY_TIMEOUT_S  how long to wait for the gateway to be SERVING (default 600)
#   VLM_BUILD_DIR          build directory (default build/); VLM_<FLAG> variables set
#                          service flags as everywhere (see README).
# Logs: $VLM_BUILD_DIR/serve/{vision,language,gateway}.log.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${VLM_BUILD_DIR:-$ROOT/build}"
HOST="${SERVE_HOST:-127.0.0.1}"
GATEWAY_PORT="${GATEWAY_PORT:-50051}"
HTTP_PORT="${HTTP_PORT:-8080}"
VISION_PORT="${VISION_PORT:-50052}"
LANGUAGE_PORT="${LANGUAGE_PORT:-50053}"
GATEWAY_METRICS_PORT="${GATEWAY_METRICS_PORT:-9090}"
VISION_METRICS_PORT="${VISION_METRICS_PORT:-9091}"
LANGUAGE_METRICS_PORT="${LANGUAGE_METRICS_PORT:-9092}"
READY_TIMEOUT_S="${SERVE_READY_TIMEOUT_S:-600}"

say() { echo "serve: $*" >&2; }
# LibTorch's OpenMP threads sleep between parallel regions instead of spinning on the
# cores the services' own pools need (common/omp_wait_policy.h; the images set it too).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"

"$ROOT/scripts/setup.sh"
say "building (only what is out of date)"
VLM_BUILD_DIR="$BUILD_DIR" "$ROOT/scripts/build.sh" vlm-vision vlm-language vlm-gateway vlm-client \
  vlm-make-checkpoint >&2
VISION_BIN="$BUILD_DIR/services/vision/vlm-vision"
LANGUAGE_BIN="$BUILD_DIR/services/language/vlm-language"
GATEWAY_BIN="$BUILD_DIR/services/gateway/vlm-gateway"
CLIENT_BIN="$BUILD_DIR/services/gateway/vlm-client"

TRY_FLAGS=""
if [[ -z "${MODEL_DIR:-}" ]]; then
  MODEL_DIR="$(VLM_BUILD_DIR="$BUILD_DIR" "$ROOT/scripts/make_checkpoint.sh" tiny | tail -n 1)"
  # Random weights never say EOS: bound the answer (it is gibberish by design).
  TRY_FLAGS="--max-tokens 48 "
fi
if [[ ! -f "$MODEL_DIR/config.json" ]]; then
  say "MODEL_DIR=$MODEL_DIR is not a checkpoint directory (no config.json)"
  exit 1
fi
say "model $MODEL_DIR"

LOG_DIR="$BUILD_DIR/serve"
mkdir -p "$LOG_DIR"

# Each service runs in its own session (setsid), so that the terminal's Ctrl-C
# reaches only this script, which then stops them once and in order: a second
# signal would cut a service's drain short.
declare -A PIDS=()
start() {  # name binary flags...
  local name="$1" bin="$2"
  shift 2
  setsid "$bin" "$@" >"$LOG_DIR/$name.log" 2>&1 </dev/null &
  PIDS[$name]=$!
  say "started $name (pid ${PIDS[$name]}), log $LOG_DIR/$name.log"
}

stop() {  # names...: SIGTERM, wait for the drain, SIGKILL after 40 s
  local name pid
  for name in "$@"; do
    pid="${PIDS[$name]:-}"
    [[ -n "$pid" ]] && kill -TERM "$pid" 2>/dev/null || true
  done
  for name in "$@"; do
    pid="${PIDS[$name]:-}"
    [[ -z "$pid" ]] && continue
    for _ in $(seq 400); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      say "$name did not stop in 40 s; killing it"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    local rc=0
    wait "$pid" 2>/dev/null || rc=$?
    say "$name stopped (exit $rc)"
    unset "PIDS[$name]"
  done
}

STOPPING=0
shutdown() {
  [[ $STOPPING == 1 ]] && return
  STOPPING=1
  say "stopping: gateway first (drains requests in flight), then vision and language"
  stop gateway
  stop vision language
}
on_signal() {
  shutdown
  exit 0
}
trap on_signal INT TERM
trap shutdown EXIT

start vision "$VISION_BIN" --model_dir="$MODEL_DIR" \
  --grpc_address="$HOST:$VISION_PORT" --metrics_address="$HOST:$VISION_METRICS_PORT" \
  ${VISION_FLAGS:-}
# A Generate request carries the ViT features of all its images (about 25 MB
# per 1024x768 image on the 2B model): allow more than the 128 MiB default.
start language "$LANGUAGE_BIN" --model_dir="$MODEL_DIR" \
  --grpc_address="$HOST:$LANGUAGE_PORT" --metrics_address="$HOST:$LANGUAGE_METRICS_PORT" \
  --max_message_mb=1024 ${LANGUAGE_FLAGS:-}
start gateway "$GATEWAY_BIN" \
  --grpc_address="$HOST:$GATEWAY_PORT" --metrics_address="$HOST:$GATEWAY_METRICS_PORT" \
  --language_target="$HOST:$LANGUAGE_PORT" --vision_targets="$HOST:$VISION_PORT" \
  --http_address="$HOST:$HTTP_PORT" --model_dir="$MODEL_DIR" \
  ${GATEWAY_FLAGS:-}

# A picture to try: a small drawn scene (Pillow comes with setup.sh).
EXAMPLE="$LOG_DIR/example.png"
/usr/bin/python3 - "$EXAMPLE" <<'PY' 2>/dev/null || EXAMPLE=""
import sys
from PIL import Image, ImageDraw
im = Image.new("RGB", (256, 192), (135, 190, 235))
d = ImageDraw.Draw(im)
d.rectangle([0, 140, 256, 192], fill=(70, 150, 60))
d.ellipse([190, 20, 235, 65], fill=(250, 210, 40))
d.rectangle([60, 90, 140, 150], fill=(180, 60, 50))
d.polygon([(50, 92), (100, 50), (150, 92)], fill=(110, 40, 30))
d.rectangle([90, 115, 110, 150], fill=(80, 50, 30))
im.save(sys.argv[1])
PY

say "waiting for the gateway to be SERVING (at most ${READY_TIMEOUT_S} s)"
start_time=$SECONDS
while :; do
  for name in vision language gateway; do
    if ! kill -0 "${PIDS[$name]}" 2>/dev/null; then
      say "$name exited during startup; the end of its log:"
      tail -n 20 "$LOG_DIR/$name.log" >&2
      exit 1
    fi
  done
  if "$CLIENT_BIN" health --target "$HOST:$GATEWAY_PORT" >/dev/null 2>&1; then break; fi
  if (( SECONDS - start_time > READY_TIMEOUT_S )); then
    say "not SERVING after ${READY_TIMEOUT_S} s; see the logs in $LOG_DIR"
    exit 1
  fi
  sleep 0.2
done

say "ready in $(( SECONDS - start_time )) s:"
say "  gateway  $HOST:$GATEWAY_PORT  (metrics http://$HOST:$GATEWAY_METRICS_PORT/metrics)"
say "  HTTP     http://$HOST:$HTTP_PORT/v1  (OpenAI-compatible API; model \"$(basename "$MODEL_DIR")\")"
say "Try it in a browser: http://$HOST:$HTTP_PORT/"
say "  vision   $HOST:$VISION_PORT  (metrics http://$HOST:$VISION_METRICS_PORT/metrics)"
say "  language $HOST:$LANGUAGE_PORT  (metrics http://$HOST:$LANGUAGE_METRICS_PORT/metrics)"
say "try:"
if [[ -n "$EXAMPLE" ]]; then
  echo "  $CLIENT_BIN --target $HOST:$GATEWAY_PORT ${TRY_FLAGS}--image $EXAMPLE \"What is in this picture?\""
else
  echo "  $CLIENT_BIN --target $HOST:$GATEWAY_PORT ${TRY_FLAGS}\"Hello! Who are you?\""
fi
if [[ -n "$TRY_FLAGS" ]]; then
  say "(the default tiny checkpoint has random weights: expect gibberish)"
fi
say "Ctrl-C stops all three"

# Serve until a signal, or until a service dies on its own.
while :; do
  wait -n "${PIDS[@]}" 2>/dev/null || true
  for name in vision language gateway; do
    if ! kill -0 "${PIDS[$name]}" 2>/dev/null; then
      say "$name exited unexpectedly; the end of its log:"
      tail -n 20 "$LOG_DIR/$name.log" >&2
      exit 1
    fi
  done
done
