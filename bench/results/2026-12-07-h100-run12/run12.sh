. .whl/prelude.sh
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
git log --oneline -1 2>/dev/null || true
timeout 230 python3 -m pytest test/test_runtime.py test/test_store.py test/test_lerobot_parity.py \
      test/test_policy_contract.py test/test_exported.py test/test_lerobot_bench.py test/test_chunking.py test/test_modes.py \
      test/test_fleet.py test/test_fleet_chunking.py test/test_vla_parity.py test/test_lerobot_pi.py -m cuda -q \
      -p no:cacheprovider > "$OUT/pytest_cuda.txt" 2>&1
echo "pytest exit $?"; tail -5 "$OUT/pytest_cuda.txt"; date -u
timeout 90 python3 bench/profile_fleet_tick.py "$OUT" --device cuda --case act > "$OUT/profile_fleet_tick.log" 2>&1
echo "profile exit $?"; head -30 "$OUT/profile_fleet_tick.txt"; date -u
timeout 240 python3 -m capsule_ros.cli.main bench fleet --device cuda --cases act --json > "$OUT/bench_fleet_act.json" 2> "$OUT/bench_fleet_act.log"
echo "fleet exit $?"; date -u; python3 -c "import json; d=json.load(open('$OUT/bench_fleet_act.json')); print(json.dumps(d)[:3500])" || tail -20 "$OUT/bench_fleet_act.log"
