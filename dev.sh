#!/usr/bin/env bash
# Sets up a pinned virtual environment (idempotent: seconds when nothing changed), then
#   ./dev.sh run   -> the main job: a short local training run with injected failures
#   ./dev.sh test  -> the whole test suite
#   ./dev.sh unit  -> the unit tier alone (no Ray, two processes): under a minute
#   ./dev.sh setup -> only the environment
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=.venv
STAMP=$VENV/.cpr-setup

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FBGEMM="fbgemm-gpu==1.8.0"   # CUDA kernels
else
  FBGEMM="fbgemm-gpu-cpu==1.8.0"
fi
want="$("$PY" --version 2>&1) $FBGEMM $(cat requirements.lock pyproject.toml | sha256sum | cut -c1-16)"

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  echo "setting up $VENV ($want)" >&2
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" "$FBGEMM" -r requirements.lock
  # torchrec's wheel requires the CUDA fbgemm-gpu; its other requirements are in the lock.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps "torchrec==1.8.0"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
  echo "$want" > "$STAMP"
fi

export GLOO_SOCKET_IFNAME=lo RAY_AUTH_MODE=token PYTHONUNBUFFERED=1
case "${1:-run}" in
  setup) ;;
  run) shift || true; exec "$VENV/bin/cpr" train --config configs/local.yaml "$@" ;;
  test) shift || true; exec "$VENV/bin/python" -m pytest -q "$@" ;;
  unit) shift || true; exec "$VENV/bin/python" -m pytest -q -n 2 tests/unit "$@" ;;
  *) echo "usage: $0 [run|test|unit|setup] [args...]" >&2; exit 2 ;;
esac
