. .whl/prelude.sh
date -u
timeout 120 python3 -m capsule_ros.cli.main bench lifecycle --device cuda --cases default,pi0,pi05,smolvla --json > "$OUT/bench_lifecycle.json" 2> "$OUT/bench_lifecycle.log"
echo "lifecycle exit $?"; date -u
python3 -c "
import json; d=json.load(open('$OUT/bench_lifecycle.json'))
for c in d['cases']: print({k: c.get(k) for k in ('case','ran','reason','first_program','first_ms_median','steady_p50_ms','first_vs_p50_median','first_vs_p50_worst','allocated_before_bytes','allocated_after_cleanup_bytes','met')})
" || tail -15 "$OUT/bench_lifecycle.log"
timeout 400 python3 -m capsule_ros.cli.main bench chunking --device cuda --cases act100,diffusion --steps 1500 --json > "$OUT/bench_chunking.json" 2> "$OUT/bench_chunking.log"
echo "chunking exit $?"; date -u; python3 -c "import json; d=json.load(open('$OUT/bench_chunking.json')); print(json.dumps(d)[:4000])" || tail -20 "$OUT/bench_chunking.log"
