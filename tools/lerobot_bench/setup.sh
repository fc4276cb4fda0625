#!/usr/bin/env bash
# LeRobot's own environment for `capsule-ros bench chunking` (its baseline loop) and for
# tools/lerobot_fixtures/make_references.py: Python 3.12 (LeRobot 0.6 needs >= 3.12), the
# pinned set of requirements.txt, in tools/lerobot_bench/.venv. Never the product's .venv.
# Idempotent; several GB (LeRobot pulls a CUDA build of torch, which runs on the CPU here).
# CAPSULE_ROS_LEROBOT_PYTHON3=<python 3.12> picks the interpreter.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv"
# The first candidate that runs and is Python 3.12 (a pyenv shim can exist without a selected 3.12).
PYTHON=""
for candidate in "${CAPSULE_ROS_LEROBOT_PYTHON3:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python; do
  if [[ -n "$candidate" ]] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    PYTHON="$candidate"
    break
  fi
done
[[ -n "$PYTHON" ]] || { echo "tools/lerobot_bench: no Python 3.12 found (set CAPSULE_ROS_LEROBOT_PYTHON3)" >&2; exit 1; }
STAMP="$VENV/.requirements.sha256"
WANT="$(sha256sum "$HERE/requirements.txt" | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  echo "tools/lerobot_bench: up to date ($VENV)"
  exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$HERE/requirements.txt"
"$VENV/bin/python" -c "import lerobot, diffusers; print('lerobot', lerobot.__version__)"
echo "$WANT" > "$STAMP"
