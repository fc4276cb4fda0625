# TF32 (runtime.float32_matmul: high): its CUDA tests, then SmolVLA against LeRobot with TF32 on both sides
. .whl/prelude.sh
T0=$(date +%s); left() { echo $(( ${BUDGET:-540} - ($(date +%s) - T0) )); }
date -u
timeout 200 python3 -m pytest -q -p no:cacheprovider test/test_runtime.py test/test_vla_parity.py -m cuda -k "tf32 or cuda_graph or high" > "$OUT/pytest_cuda.txt" 2>&1
echo "pytest exit $?"; tail -4 "$OUT/pytest_cuda.txt"; date -u
vla() {  # name cases sides min_seconds
  if [ "$(left)" -gt "$4" ]; then
    timeout $(left) python3 -m capsule_ros.cli.main bench vla --device cuda --cases "$2" --sides "$3" --steps 150 --async-steps 0 --float32-matmul high --json > "$OUT/bench_vla_$1.json" 2> "$OUT/bench_vla_$1.log"
    echo "vla $1 exit $?"; date -u; grep "case .* done" "$OUT/bench_vla_$1.log" | cut -c1-900
  else echo "vla $1 skipped: $(left) s left"; fi
}
vla smolvla1 smolvla-1cam lerobot,lerobot_deterministic,graph 60
vla smolvla3 smolvla-3cam lerobot,graph 60
vla smolvla2 smolvla-2cam lerobot,graph 60
if [ "$(left)" -gt 90 ]; then
  mkdir -p "$OUT/tf32"
  timeout $(( $(left) - 10 )) python3 bench/profile_vla_chunk.py "$OUT/tf32" --case smolvla-1cam --float32-matmul high > "$OUT/tf32.log" 2>&1
  echo "profile exit $?"; sed -n 1,20p "$OUT/tf32/profile_vla_chunk.txt" | cut -c1-150
fi
(cd "$OUT" && tar czf vla.tgz bench_vla_* tf32* pytest_cuda.txt 2>/dev/null && rm -rf bench_vla_* tf32 tf32.log)
