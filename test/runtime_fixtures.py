"""Small policies and drivers for runtime tests (CPU-sized; the same code runs on CUDA)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch

from capsule_ros.capsules.store import CapsuleStore, CapsuleStoreConfig
from capsule_ros.config import load_params_file
from capsule_ros.policies.hybrid import HybridConfig, HybridPolicy
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.builder import build_policy_runtime
from capsule_ros.runtime.engine import PolicyRuntime, RuntimeConfig

INPUTS = [BufferSpec("joints", (4,), torch.float32, BufferKind.INPUT),
          BufferSpec("goal", (2,), torch.float32, BufferKind.INPUT)]
SMALL = HybridConfig(d_model=32, layers="RRA", n_heads=2, n_kv_heads=1, head_dim=16, max_context=64,
                     rec_heads=2, rec_head_dim=8, d_state=8, mlp_ratio=2.0, chunk_horizon=4, vocab_size=50)


def make_policy(cfg: HybridConfig = SMALL, seed: int = 0) -> HybridPolicy:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return HybridPolicy(cfg, INPUTS)


def make_runtime(cfg: HybridConfig = SMALL, seed: int = 0, device: str = "cpu", **runtime_kw) -> PolicyRuntime:
    return build_policy_runtime(make_policy(cfg, seed), RuntimeConfig(device=device, **runtime_kw))


def make_store(runtime: PolicyRuntime, device_mb: float = 4.0, host_mb: float = 4.0) -> CapsuleStore:
    return CapsuleStore(runtime.layout.nbytes, runtime.fingerprint, runtime.device,
                        CapsuleStoreConfig(device_budget_mb=device_mb, host_budget_mb=host_mb, directory=""))


def observations(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 6)).astype(np.float32)


def run(runtime: PolicyRuntime, obs: np.ndarray) -> np.ndarray:
    """Step through ``obs``; the actions as raw bytes-comparable float32 rows."""
    out = []
    for row in obs:
        runtime.staging["joints"][:] = row[:4]
        runtime.staging["goal"][:] = row[4:]
        runtime.load_inputs()
        runtime.step()
        out.append(runtime.read_outputs().action)
    return np.stack(out)


def arena_bytes(runtime: PolicyRuntime) -> dict:
    return {name: runtime.arena.buffer_bytes(name) for name in runtime.layout.names()}


def with_overrides(cfg: HybridConfig = SMALL, **kw) -> HybridConfig:
    return dataclasses.replace(cfg, **kw)


def first_divergence(a: np.ndarray, b: np.ndarray) -> Optional[int]:
    diff = np.nonzero((a.view(np.uint32) != b.view(np.uint32)).any(axis=1))[0]
    return int(diff[0]) if diff.size else None


REPO = Path(__file__).resolve().parents[1]


def default_config(tmp_path: Path, ports: Optional[Dict[str, Dict[str, Any]]] = None, **control):
    """config/policy.yaml (the default policy's shape) with random weights, on the CPU, a
    private capsule directory and no step deadline (a slow step must not turn an action
    into the safe action); ``ports`` / ``control`` override the file's settings."""
    from capsule_ros.serving.config import ServingConfig
    params = load_params_file(REPO / "config" / "policy.yaml")
    params["policy"]["weights"] = ""
    params["runtime"]["device"] = "cpu"
    params["capsules"]["directory"] = str(tmp_path / "capsules")
    params["control"].update({"deadline_ms": 0.0, **control})
    for name, values in (ports or {}).items():
        params["ports"].setdefault(name, {}).update(values)
        if name not in params["ports"]["names"]:
            params["ports"]["names"].append(name)
    return ServingConfig.from_params(params)


def feed(session, obs: np.ndarray, **tick) -> list:
    """One tick per row of the default policy's inputs (joints: 4, goal: 2); the records."""
    out = []
    for row in obs:
        session.loop.write_input("joints", row[:4])
        session.loop.write_input("goal", row[4:])
        out.append(session.loop.tick(**tick))
    return out


# -- the example policy package (examples/gru_policy: ./setup.sh installs it) --------------------

GRU_PARAMS = REPO / "examples" / "gru_policy" / "config" / "gru_chunk.yaml"
GRU_FACTORY = {"action_scale": 2.0}     # capsule_gru_policy.export:module arguments equal to GRU_PARAMS' policy


def gru_params(tmp_path: Path, program: Optional[Path] = None) -> Dict[str, Any]:
    """examples/gru_policy/config/gru_chunk.yaml on the CPU with a private capsule directory
    and no step deadline; with ``program``, the same ports served by policy.kind exported."""
    params = load_params_file(GRU_PARAMS)
    if program is not None:
        params["policy"] = {"kind": "exported", "weights": "", "exported": {"program": str(program)}}
    params["runtime"]["device"] = "cpu"
    params["capsules"]["directory"] = str(tmp_path / "capsules")
    params["control"]["deadline_ms"] = 0.0
    return params


def gru_config(tmp_path: Path, program: Optional[Path] = None):
    from capsule_ros.serving.config import ServingConfig
    return ServingConfig.from_params(gru_params(tmp_path, program))


def eager_gru(obs: np.ndarray, **factory) -> list:
    """(action, chunk) float32 arrays of the example's module run eagerly on ``obs`` (joints,
    goal) from its initial state, in the loop its author would write without capsule_ros:
    observe every step, plan a chunk every ``chunk_horizon`` steps, emit the row due, the
    state threaded from step to step. The reference the served policies must equal bit for bit."""
    from capsule_gru_policy.export import module
    net = module(**{**GRU_FACTORY, **factory}).eval()
    state = [value[None] for value in net.initial_state().values()]
    horizon = net.cadence.horizon
    out, chunk = [], None
    with torch.no_grad():
        for t, row in enumerate(obs):
            state = list(net.observe(torch.from_numpy(row[None, :4]), torch.from_numpy(row[None, 4:]), *state))
            index = t % horizon
            if index == 0:
                chunk = net.plan(state[0])
            rows = np.minimum(index + np.arange(net.chunk_horizon), horizon - 1)
            action, upcoming, *state = net.emit(chunk[:, index], chunk[:, rows], *state)
            out.append((action[0].numpy().copy(), upcoming[0].numpy().copy()))
    return out


# -- a module with the export interface (capsule_ros.policies.export) -------------------------------

class RunningSum(torch.nn.Module):
    """``capsule-ros export --module runtime_fixtures:RunningSum`` (with test/ on PYTHONPATH):
    a running sum of the joints through a linear head, its weights seeded; ``width`` sets
    the size of the written program (the head has width x width weights)."""

    inputs = [BufferSpec("joints", (4,), torch.float32, BufferKind.INPUT)]
    action_dim, chunk_horizon = 2, 1

    def __init__(self, width: int = 64):
        super().__init__()
        self.state = [BufferSpec("total", (width,), torch.float32, BufferKind.RECURRENT)]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.embed = torch.nn.Linear(4, width)
            self.head = torch.nn.Linear(width, 2)
            self.mix = torch.nn.Linear(width, width)

    def initial_state(self):
        return {"total": torch.zeros(self.state[0].shape)}

    def forward(self, joints, total):
        total = self.mix(total + self.embed(joints))
        action = self.head(total)
        return action, action[:, None], total


@contextlib.contextmanager
def logged(logger_name: str, level: int = logging.WARNING) -> Iterator[List[logging.LogRecord]]:
    """The records of ``level`` and above that a library module's logger handles in the block,
    from a handler on that logger itself: caplog and capsys would depend on what else the
    process imported (the launch tooling's pytest plugin makes library loggers stop
    propagating)."""
    records: List[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
