python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="$PWD:$PWD/examples/gru_policy:/tmp/site" CAPSULE_ROS_WITHOUT_ROS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
git log -1 --format='%H %s' >> "$OUT/gpu.txt" 2>/dev/null || true
date -u >> "$OUT/gpu.txt"
