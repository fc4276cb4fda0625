# the cases never measured: SmolVLA 3 cameras against LeRobot; π0.5 and π0 with 2 and 3 cameras (capsule_ros's sides)
. .whl/prelude.sh
T0=$(date +%s); left() { echo $(( 585 - ($(date +%s) - T0) )); }
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
if [ -n "$TESTS" ]; then
timeout 200 python3 -m pytest test/test_runtime.py test/test_store.py test/test_lerobot_parity.py \
      test/test_policy_contract.py test/test_exported.py test/test_lerobot_bench.py test/test_chunking.py test/test_modes.py \
      test/test_fleet.py test/test_fleet_chunking.py test/test_vla_parity.py test/test_lerobot_pi.py -m cuda -q \
      -p no:cacheprovider > "$OUT/pytest_cuda.txt" 2>&1
echo "pytest exit $?"; tail -3 "$OUT/pytest_cuda.txt"; date -u
fi
vla() {  # name cases sides async_steps min_seconds
  if [ "$(left)" -gt "$5" ]; then
    timeout $(left) python3 -m capsule_ros.cli.main bench vla --device cuda --cases "$2" --sides "$3" --steps 150 --async-steps "$4" --json > "$OUT/bench_vla_$1.json" 2> "$OUT/bench_vla_$1.log"
    echo "vla $1 exit $?"; date -u; grep "bench vla" "$OUT/bench_vla_$1.log" | cut -c1-1800
  else echo "vla $1 skipped: $(left) s left"; fi
}
vla smolvla3 smolvla-3cam lerobot,graph,sync_paced,async 300 100
vla pi05_23 pi05-2cam,pi05-3cam graph,sync_paced,async 300 120
vla pi0_23 pi0-2cam,pi0-3cam graph,sync_paced,async 300 120
(cd "$OUT" && tar czf vla.tgz bench_vla_* && rm -f bench_vla_*)
