. .whl/prelude.sh
T0=$(date +%s); left() { echo $(( 540 - ($(date +%s) - T0) )); }
date -u
timeout 100 python3 -m capsule_ros.cli.main bench vla --device cuda --cases smolvla-1cam --sides graph --steps 150 --async-steps 0 --json > "$OUT/bench_vla_smolvla1_highest.json" 2> "$OUT/bench_vla_smolvla1_highest.log"
echo "highest exit $?"; grep "case .* done" "$OUT/bench_vla_smolvla1_highest.log" | cut -c1-600; date -u
timeout 120 python3 bench/profile_fleet_tick.py "$OUT" --device cuda --case act > "$OUT/profile_fleet_tick.log" 2>&1
echo "profile exit $?"; head -12 "$OUT/profile_fleet_tick.txt"; date -u
timeout $(left) python3 -m capsule_ros.cli.main bench fleet --device cuda --cases act,act-async --sides fleet,separate --steps 200 --json > "$OUT/bench_fleet_act_async.json" 2> "$OUT/bench_fleet_act_async.log"
echo "fleet exit $?"; date -u; tail -3 "$OUT/bench_fleet_act_async.log"
(cd "$OUT" && tar czf run29.tgz bench_* profile_fleet_tick* && rm -f bench_* profile_fleet_tick*)
