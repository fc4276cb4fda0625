# π0.5 and π0 with 2 and 3 cameras against LeRobot (lerobot and graph sides), while time is left
. .whl/prelude.sh
T0=$(date +%s); left() { echo $(( 585 - ($(date +%s) - T0) )); }
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
vla() {  # name cases sides min_seconds
  if [ "$(left)" -gt "$4" ]; then
    timeout $(left) python3 -m capsule_ros.cli.main bench vla --device cuda --cases "$2" --sides "$3" --steps 150 --async-steps 0 --json > "$OUT/bench_vla_$1.json" 2> "$OUT/bench_vla_$1.log"
    echo "vla $1 exit $?"; date -u; grep "bench vla" "$OUT/bench_vla_$1.log" | cut -c1-1500
  else echo "vla $1 skipped: $(left) s left"; fi
}
vla pi05_2 pi05-2cam lerobot,graph 170
vla pi0_3 pi0-3cam lerobot,graph 170
vla pi05_3 pi05-3cam lerobot,graph 170
vla pi0_2 pi0-2cam lerobot,graph 170
(cd "$OUT" && tar czf vla.tgz bench_vla_* && rm -f bench_vla_*)
