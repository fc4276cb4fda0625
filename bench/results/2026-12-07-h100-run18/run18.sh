# on an H200: run15 (tests, chunking, SmolVLA 1-3 cameras); otherwise run17 (tests, the never-measured cases)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then echo "H200: run15"; bash .whl/run15.sh
else echo "not an H200: run17"; TESTS=1 bash .whl/run17.sh; fi
