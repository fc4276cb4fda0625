# every CUDA test (2d9ec9e's side-stream priority; the fleet's batched output check), then an act-async fleet
. .whl/prelude.sh
date -u
timeout 300 bash bench/run_gpu.sh "$OUT" tests > "$OUT/run_gpu.log" 2>&1
echo "tests exit $?"; date -u; tail -5 "$OUT/pytest_cuda.txt"
timeout 150 python3 -m capsule_ros.cli.main bench fleet --device cuda --cases act-async --sides fleet,separate --steps 200 --json > "$OUT/bench_fleet_act_async.json" 2> "$OUT/bench_fleet.log"
echo "fleet exit $?"; date -u; python3 -c "import json; d=json.load(open('$OUT/bench_fleet_act_async.json'))['cases']['act-async']; print(json.dumps(d['ratios'])); print({s: {n: (v['robot_steps_per_s'], v['period_ms']) for n, v in d['sides'][s]['by_n'].items()} for s in d['sides']})"
timeout 120 bash bench/run_gpu.sh "$OUT" profile-fleet-act-async >> "$OUT/run_gpu.log" 2>&1
echo "profile exit $?"; date -u; head -12 "$OUT/profile_fleet_tick.txt"
