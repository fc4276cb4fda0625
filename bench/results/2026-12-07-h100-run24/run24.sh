# projections side by side (SmolVLA and π: vision layers, decoder layers): the VLA CUDA tests, then π0.5 with 2
# cameras and SmolVLA with 3 against LeRobot, then SmolVLA's refill with the branches against without
. .whl/prelude.sh
T0=$(date +%s); left() { echo $(( ${BUDGET:-400} - ($(date +%s) - T0) )); }
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; git log --oneline -1 2>/dev/null || true
timeout 150 python3 -m pytest test/test_side_by_side.py test/test_vla_parity.py test/test_lerobot_pi.py -m cuda -q \
      -p no:cacheprovider > "$OUT/pytest_cuda.txt" 2>&1
echo "pytest exit $?"; tail -3 "$OUT/pytest_cuda.txt"; grep -E "FAILED|Error" "$OUT/pytest_cuda.txt" | head -5; date -u
vla() {  # name cases sides min_seconds
  if [ "$(left)" -gt "$4" ]; then
    timeout $(left) python3 -m capsule_ros.cli.main bench vla --device cuda --cases "$2" --sides "$3" --steps 150 --async-steps 0 --json > "$OUT/bench_vla_$1.json" 2> "$OUT/bench_vla_$1.log"
    echo "vla $1 exit $?"; date -u; grep "bench vla" "$OUT/bench_vla_$1.log" | cut -c1-1200
  else echo "vla $1 skipped: $(left) s left"; fi
}
vla pi05_2 pi05-2cam lerobot,graph 200
vla smolvla3 smolvla-3cam lerobot,graph 90
if [ "$(left)" -gt 60 ]; then
  timeout $(left) python3 bench/profile_vla_chunk.py "$OUT" --case smolvla-1cam > "$OUT/profile_vla_chunk.log" 2>&1
  echo "profile exit $?"; head -6 "$OUT/profile_vla_chunk.txt"; date -u
fi
(cd "$OUT" && tar czf vla.tgz bench_vla_* && rm -f bench_vla_*)
