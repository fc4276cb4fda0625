#!/usr/bin/env bash
# Run the CUDA tests and the GPU benchmarks on a GPU machine without ROS, from a checkout:
#   bash bench/run_gpu.sh [OUT_DIR]
# Writes pytest output and one JSON per benchmark to OUT_DIR (default: bench/results/<date>).
# Needs torch with CUDA, numpy, pyyaml, rich (cuda.bindings optional); no ROS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/results/$(date -u +%Y-%m-%d)}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -m pytest test/test_runtime.py test/test_store.py -m cuda -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cuda.txt"
for bench in snapshot step reenter; do
  python3 -m capsule_ros.cli.main bench "$bench" --device cuda --json > "$OUT/bench_$bench.json" 2> "$OUT/bench_$bench.log"
  echo "bench $bench: exit $?"
  python3 -c "import json,sys; d=json.load(open('$OUT/bench_$bench.json')); print(json.dumps(d)[:1500])" || tail -20 "$OUT/bench_$bench.log"
done
