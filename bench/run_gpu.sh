#!/usr/bin/env bash
# Run the CUDA tests and GPU benchmarks on a GPU machine without ROS, from a checkout:
#   bash bench/run_gpu.sh [OUT_DIR] [TASK ...]
# TASKs: tests, a benchmark name (snapshot step reenter commits lifecycle chunking ...),
# step-exported (bench step --policy exported: the example package's module exported, served vs
# eager) or step-act (bench step --policy act: ACT from a LeRobot checkpoint, graph vs eager, its
# capsule vs the copy limit), fleet (bench fleet: N robots of one fleet of 16 slots against N
# separate runtimes, the default policy, ACT and a recurrent actor) or fleet-default / fleet-act /
# fleet-recurrent / fleet-act-async (one case of it; act-async: ACT's refills planned off the tick),
# profile-fleet (bench/profile_fleet_tick.py: where a 16-robot ACT fleet's tick goes; profile-fleet-act-async
# for ACT with its refills off the tick),
# profile-vla-<case> (bench/profile_vla_chunk.py: a VLA case's refill, graph against eager and with
# its side-by-side branches against without, and its kernels; LeRobot writes SmolVLA's; profile-vla-act:
# ACT's batch-1 refill, what bounds a chunking fleet), vla-smolvla /
# vla-pi0 / vla-pi05 (bench vla: one kind with 1, 2 and 3 cameras against LeRobot's eager policy;
# LeRobot 0.6.1 and its missing dependencies installed as wheels first, docs/benchmarks.md says
# which) or vla-<kind>-<n>cam (one case of it: a π case takes more than 6 minutes, and the two paced
# sides take --async-steps / 30 s each, 100 s at the default; `capsule-ros bench vla --sides` runs
# some of its sides); default: all of them but vla. A fleet, vla or profile-vla task named with
# -tf32 at its end (fleet-act-async-tf32, profile-vla-act-tf32) runs with --float32-matmul high
# (runtime.float32_matmul: TensorFloat-32 on every side). Writes pytest output and one JSON per benchmark
# to OUT_DIR (default: bench/results/<date>). Needs torch with CUDA, numpy, pyyaml, rich,
# safetensors and pytest + hypothesis for the tests, and transformers 5.5.4 (with tokenizers 0.22.2
# and huggingface_hub 1.33.0: requirements/lock.txt) for the VLA tests; no ROS
# (CAPSULE_ROS_WITHOUT_ROS=1 proves it). The example policy package (examples/gru_policy) is used
# from the checkout through PYTHONPATH, like capsule_ros.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/results/$(date -u +%Y-%m-%d)}"
shift || true
TASKS=("$@")
[[ ${#TASKS[@]} -eq 0 ]] && TASKS=(tests snapshot step step-exported step-act reenter commits lifecycle chunking fleet)
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/examples/gru_policy${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 CAPSULE_ROS_WITHOUT_ROS=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
for named in "${TASKS[@]}"; do
  task="${named%-tf32}" extra=()
  [[ "$named" == *-tf32 ]] && extra=(--float32-matmul high)
  if [[ "$task" == tests ]]; then
    python3 -m pytest test/test_side_by_side.py test/test_runtime.py test/test_store.py test/test_lerobot_parity.py \
      test/test_policy_contract.py test/test_exported.py test/test_lerobot_bench.py test/test_chunking.py test/test_modes.py \
      test/test_fleet.py test/test_fleet_chunking.py test/test_vla_parity.py test/test_lerobot_pi.py -m cuda -q \
      -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cuda.txt"
    continue
  fi
  if [[ "$task" == profile-vla-* ]]; then          # e.g. profile-vla-smolvla-1cam: its refill with and without branches
    python3 bench/profile_vla_chunk.py "$OUT" --case "${task#profile-vla-}" "${extra[@]}" \
      > "$OUT/profile_vla_chunk.log" 2>&1
    echo "$named: exit $?"; head -4 "$OUT/profile_vla_chunk.txt"
    continue
  fi
  if [[ "$task" == profile-fleet* ]]; then         # profile-fleet (ACT) or profile-fleet-<case>, e.g. -act-async
    fleet_case="${task#profile-fleet}"; fleet_case="${fleet_case#-}"
    python3 bench/profile_fleet_tick.py "$OUT" --device cuda --case "${fleet_case:-act}" > "$OUT/profile_fleet_tick.log" 2>&1
    echo "profile-fleet: exit $?"; head -2 "$OUT/profile_fleet_tick.txt"
    continue
  fi
  case "$task" in
    step-exported) args=(step --policy exported) ;;   # docs/benchmarks.md, "exported program"
    step-act) args=(step --policy act) ;;             # docs/benchmarks.md, "ACT from a LeRobot checkpoint"
    fleet-*) args=(fleet --cases "${task#fleet-}") ;; # docs/benchmarks.md, "Fleet"
    vla-*cam) args=(vla --cases "${task#vla-}") ;;    # one case, e.g. vla-pi05-2cam (a device call's 10 minutes)
    vla-*) kind="${task#vla-}"                         # docs/benchmarks.md, "VLAs on the GPU": one kind, 1-3 cameras
           args=(vla --cases "$kind-1cam,$kind-2cam,$kind-3cam") ;;
    *) args=("$task") ;;
  esac
  python3 -m capsule_ros.cli.main bench "${args[@]}" "${extra[@]}" --device cuda --json > "$OUT/bench_$named.json" \
    2> "$OUT/bench_$named.log"
  echo "bench $named: exit $?"
  python3 -c "import json,sys; d=json.load(open('$OUT/bench_$named.json')); print(json.dumps(d)[:2500])" \
    || tail -20 "$OUT/bench_$named.log"
done
