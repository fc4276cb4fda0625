"""Diagnose smolvla-3cam's sync_paced side on the GPU (no LeRobot loop sides)."""
import faulthandler
import sys
import tempfile
import time
from pathlib import Path

import torch

from capsule_ros.benchmarks import vla
from capsule_ros.benchmarks.chunking import observations

faulthandler.dump_traceback_later(25, repeat=True)
device = torch.device("cuda")
case = vla.CASES["smolvla-3cam"]
t0 = time.monotonic()
with tempfile.TemporaryDirectory() as tmp:
    written = vla.write_case(case, Path(tmp) / case.name, False, device, Path(sys.executable), None)
    print(f"written at {time.monotonic() - t0:.0f} s", flush=True)
    joints = int(written.config.ports[written.ports_of["observation.state"]].shape[0])
    obs = observations(100, written.camera, joints=joints, cameras=written.camera_keys)
    for paced in (False, True):
        out = vla.graph_side(written, obs, device, "sync", vla.ASYNC_RATE_HZ, paced=paced)
        out.pop("_actions", None)
        print(f"paced={paced} done at {time.monotonic() - t0:.0f} s:",
              {k: out.get(k) for k in ("ran", "reason", "chunk_p50_ms", "consume_p50_ms", "misses_steady", "refills",
                                       "session_deadline_misses", "max_ms", "mean_ms")}, flush=True)
