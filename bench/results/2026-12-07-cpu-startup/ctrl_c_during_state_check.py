"""Ctrl-C to ``ros2 launch capsule_ros policy.launch.py`` while a CPU Diffusion node's state
check runs beside serving: SIGINT to the launch's whole process group right after the node
logs ``serving``; the seconds until the launch exits, whether it had to escalate (its SIGTERM
after 5 s), and the exit code (docs/benchmarks.md, "Ctrl-C while the state check runs").

    . scripts/env.sh && python bench/results/2026-12-07-cpu-startup/ctrl_c_during_state_check.py [ROUNDS]
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from capsule_ros.benchmarks.startup import _case

SERVING_TIMEOUT_S = 300.0


def one_round(params_file: Path, log: Path) -> dict:
    with log.open("w") as out:
        proc = subprocess.Popen(["ros2", "launch", "capsule_ros", "policy.launch.py", f"params_file:={params_file}"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + SERVING_TIMEOUT_S
    while "serving" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the node did not serve: {log.read_text()[-2000:]}")
        time.sleep(0.02)
    checking = "state check passed" not in log.read_text()
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)              # Ctrl-C in the launch's terminal: its whole group
    code = proc.wait(60)
    text = log.read_text()
    return {"exit_s": round(time.monotonic() - sent, 3), "exit_code": code, "check_running_at_sigint": checking,
            "escalated": "escalating to 'SIGTERM'" in text,
            "check_stopped": "state check stopped before its verdict" in text}


def main(rounds: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ctrl_c_"))
    case = _case("diffusion", tmp, quick=False)
    params_file = tmp / "params.yaml"
    params_file.write_text(yaml.safe_dump({"/**": {"ros__parameters": case.params}}))
    for i in range(rounds):
        print(one_round(params_file, tmp / f"launch-{i}.log"), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
