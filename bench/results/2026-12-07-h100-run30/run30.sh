# every CUDA test at this commit (runtime.float32_matmul's change to configure_torch touches every CUDA runtime)
. .whl/prelude.sh
date -u
timeout 470 bash bench/run_gpu.sh "$OUT" tests > "$OUT/run_gpu.log" 2>&1
echo "exit $?"; date -u; tail -5 "$OUT/pytest_cuda.txt"
