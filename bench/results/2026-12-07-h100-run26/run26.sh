# the rest of the cases against LeRobot, projections side by side: π0.5 with 3 cameras, π0 with 2, SmolVLA with 1 and 2
. .whl/prelude.sh
T0=$(date +%s); left() { echo $(( ${BUDGET:-300} - ($(date +%s) - T0) )); }
date -u
vla() {  # name cases sides min_seconds
  if [ "$(left)" -gt "$4" ]; then
    timeout $(left) python3 -m capsule_ros.cli.main bench vla --device cuda --cases "$2" --sides "$3" --steps 150 --async-steps 0 --json > "$OUT/bench_vla_$1.json" 2> "$OUT/bench_vla_$1.log"
    echo "vla $1 exit $?"; date -u; grep "case .* done" "$OUT/bench_vla_$1.log" | cut -c1-700
  else echo "vla $1 skipped: $(left) s left"; fi
}
vla pi05_3 pi05-3cam lerobot,graph 70
vla pi0_2 pi0-2cam lerobot,graph 70
vla smolvla2 smolvla-2cam lerobot,graph 60
vla smolvla1 smolvla-1cam lerobot,graph 60
(cd "$OUT" && tar czf vla.tgz bench_vla_* && rm -f bench_vla_*)
