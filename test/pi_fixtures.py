"""The π0 / π0.5 fixtures (test/fixtures/lerobot/pi0, pi05, pi0_bf16, made by
tools/lerobot_fixtures/make_pi_fixtures.py with LeRobot 0.6.1) as the tests use them: the
unpacked checkpoint, the shared PaliGemma-format tokenizer, the recorded inputs (cameras,
joint states, the task of every step) and LeRobot's actions, a policy built through the
kind's own ``build``, and a runtime driven as the node drives it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from lerobot_fixtures import FIXTURES, REPO, extract_checkpoint, load_npz
from vla_fixtures import IMAGE, JOINTS, TASK_PORT, TEXT, chunked_runtime, port_of, text_and_sensor_ports

from capsule_ros.policies.lerobot.pi.kind import Pi0Settings, Pi05Settings, build
from capsule_ros.policies.registry import BuildContext
from capsule_ros.policies.vla.rtc import RTCSettings
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.engine import PolicyRuntime

NAMES = ["pi0", "pi05", "pi0_bf16"]
TOKENIZER = FIXTURES / "paligemma_tokenizer"


@dataclass
class PiFixture:
    name: str
    checkpoint: Path
    tokenizer: Path
    inputs: Dict[str, np.ndarray]
    outputs: Dict[str, np.ndarray]
    references: Dict[str, np.ndarray]   # async.npz
    meta: Dict[str, Any]

    @classmethod
    def load(cls, name: str, root: Path) -> PiFixture:
        return cls(name, extract_checkpoint(FIXTURES / name / "pretrained_model.tar.xz", root / name), TOKENIZER,
                   load_npz(FIXTURES / name / "inputs.npz"), load_npz(FIXTURES / name / "outputs.npz"),
                   load_npz(FIXTURES / name / "async.npz"), json.loads((FIXTURES / name / "meta.json").read_text()))

    @property
    def kind(self) -> str:
        return "lerobot_pi05" if self.meta["policy"] == "pi05" else "lerobot_pi0"

    @property
    def features(self) -> Dict[str, np.ndarray]:
        return {k: v for k, v in self.inputs.items() if k not in ("seeds", "task")}

    @property
    def token_length(self) -> int:
        return 200 if self.meta["policy"] == "pi05" else 48

    @property
    def episodes(self) -> int:
        return int(self.inputs["task"].shape[0])

    @property
    def steps(self) -> int:
        return int(self.inputs["task"].shape[1])

    def seed(self, episode: int) -> int:
        return int(self.inputs["seeds"][episode])

    def task(self, episode: int, step: int) -> str:
        return str(self.inputs["task"][episode, step])

    # -- building --------------------------------------------------------------------------------
    def port_specs(self, task_port: bool = True) -> List[BufferSpec]:
        specs = [BufferSpec(port_of(k), v.shape[2:], torch.uint8 if v.dtype == np.uint8 else torch.float32,
                            BufferKind.INPUT) for k, v in self.features.items()]
        if task_port:
            specs.append(BufferSpec(TASK_PORT, (2, self.token_length), torch.int64, BufferKind.INPUT))
        return specs

    def feature_entries(self, task_port: bool = True) -> List[str]:
        return [f"{k}:{port_of(k)}" for k in self.features] + ([f"task:{TASK_PORT}"] if task_port else [])

    def settings(self, **overrides: Any):
        values: Dict[str, Any] = dict(pretrained_model=str(self.checkpoint), vlm_files=str(self.tokenizer),
                                      features=tuple(self.feature_entries()))
        values.update(overrides)
        return (Pi05Settings if self.kind == "lerobot_pi05" else Pi0Settings)(**values)

    def context(self, settings=None, *, rtc: Optional[RTCSettings] = None, task: str = "",
                task_port: bool = True) -> BuildContext:
        types = {spec.name: SimpleNamespace(type=IMAGE if spec.dtype == torch.uint8 else JOINTS)
                 for spec in self.port_specs(task_port)}
        if task_port:
            types[TASK_PORT] = SimpleNamespace(type=TEXT)
        if settings is None:
            settings = self.settings(features=tuple(self.feature_entries(task_port)))
        return BuildContext(settings=settings, inputs=tuple(self.port_specs(task_port)), ports=types, weights=None,
                            seed=0, device=torch.device("cpu"), task=task, rtc=rtc)

    def policy(self, rtc: Optional[RTCSettings] = None, **kw: Any):
        return build(self.context(rtc=rtc, **kw))

    def runtime(self, mode: str = "sync", delay: int = 0, rtc: Optional[RTCSettings] = None, worker: str = "auto",
                **kw: Any) -> PolicyRuntime:
        return chunked_runtime(self.policy(rtc), mode, delay, worker, **kw)

    def rtc_settings(self) -> RTCSettings:
        """The guided RTC settings the fixture's references were recorded with."""
        r = self.meta["rtc"]
        return RTCSettings("guided", r["max_guidance_weight"], r["prefix_attention_schedule"].split(".")[-1],
                           r["execution_horizon"])

    # -- driving ---------------------------------------------------------------------------------
    def stage(self, runtime: PolicyRuntime, episode: int, step: int) -> None:
        """Stage one step's inputs as the node does (the task as text)."""
        for key, value in self.features.items():
            runtime.staging[port_of(key)][...] = value[episode, step]
        runtime.stage_text(TASK_PORT, self.task(episode, step))

    def act(self, runtime: PolicyRuntime, episode: int, step: int) -> np.ndarray:
        self.stage(runtime, episode, step)
        runtime.load_inputs()
        runtime.step()
        return runtime.read_step_outputs().action.copy()

    def rollout(self, runtime: PolicyRuntime, episodes: Optional[int] = None) -> np.ndarray:
        """Every action of the recorded episodes (``runtime.reset`` with the episode's seed between them)."""
        episodes = self.episodes if episodes is None else episodes
        actions = np.zeros((episodes, self.steps, self.outputs["action"].shape[-1]), np.float32)
        for e in range(episodes):
            runtime.reset(episode=e + 1, seed=self.seed(e))
            for t in range(self.steps):
                actions[e, t] = self.act(runtime, e, t)
        return actions

    # -- the node ----------------------------------------------------------------------------------
    def serving_params(self, episode: int = 0, **control: Any) -> Dict[str, Any]:
        """The full parameter mapping (config/policy.yaml with this fixture's ports, the task
        through a String port, and its policy; trigger mode on the joint port; seeded like
        ``episode``'s recording) that ServingConfig.from_params takes."""
        from capsule_ros.config import load_params_file
        params = load_params_file(REPO / "config" / "policy.yaml")
        params["ports"] = text_and_sensor_ports(self.features, self.token_length)
        params["policy"] = {"kind": self.kind, "weights": "", "task": self.task(0, 0),
                            self.kind: {"pretrained_model": str(self.checkpoint), "vlm_files": str(self.tokenizer),
                                        "features": self.feature_entries()}}
        params["control"].update({"mode": "trigger", "trigger_port": "joints", "deadline_ms": 0.0,
                                  "status_rate_hz": 50.0, **control})
        params["runtime"].update(device="cpu", seed=self.seed(episode))
        params["capsules"]["directory"] = ""
        return params
