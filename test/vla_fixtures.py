"""The VLA fixtures as the tests use them: ``RecordedVLA``, what every VLA kind's fixture
shares (the recorded inputs and LeRobot's actions, the kind's policy built through its
own ``build``, a runtime driven as the node drives it, the node's parameters), and
``VLAFixture``, SmolVLA's (test/fixtures/lerobot/smolvla_*, made by
tools/lerobot_fixtures/make_vla_fixtures.py with LeRobot 0.6.1: the unpacked checkpoint
and its staged VLM files). π0 / π0.5's are in pi_fixtures.py."""
from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import numpy as np
import torch
from lerobot_fixtures import FIXTURES, REPO, joint_names, load_npz, reference_path

from capsule_ros.chunking.mode import mode_for
from capsule_ros.chunking.schedule import ChunkingSettings
from capsule_ros.policies.registry import BuildContext, policy_kind
from capsule_ros.policies.vla.rtc import RTCSettings
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.builder import build_policy_runtime, place_policy
from capsule_ros.runtime.engine import PolicyRuntime, RuntimeConfig

NAMES = ["smolvla_two_cams", "smolvla_bf16_one_cam"]
TASK_PORT = "task"
NOT_FEATURES = ("seeds", "tasks", "task")
IMAGE, JOINTS, TEXT = "sensor_msgs/msg/Image", "sensor_msgs/msg/JointState", "std_msgs/msg/String"


def extract(archive: Path, target: Path) -> Path:
    """Unpack ``pretrained_model/*`` and ``vlm/*``, regular files only; returns ``target``."""
    with tarfile.open(archive, "r:xz") as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if not member.isfile() or len(parts) != 2 or parts[0] not in ("pretrained_model", "vlm") \
                    or parts[1] in ("..", "."):
                raise ValueError(f"{archive}: unexpected member {member.name!r}")
            out = target / parts[0] / parts[1]
            out.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None
            out.write_bytes(source.read())
    return target


def chunked_runtime(policy, mode: str = "sync", delay: int = 0, worker: str = "auto", **config: Any) -> PolicyRuntime:
    """``policy``'s runtime in the chunking mode ``mode`` (``sync`` / ``async`` with ``delay``
    steps; ``worker``: the refill worker), ``config``: RuntimeConfig fields."""
    runtime_config = RuntimeConfig(**config)
    placed = place_policy(policy, runtime_config)
    settings = ChunkingSettings(mode, delay if mode == "async" else None, 0, worker=worker)
    setup = mode_for(placed.policy, settings, device=placed.device, use_graphs=runtime_config.cuda_graphs)
    return build_policy_runtime(placed.policy, runtime_config, mode=setup)


def bits(a: np.ndarray) -> np.ndarray:
    """float32 values as their bit patterns (what "bit for bit" compares)."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_same_actions(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """``got`` and ``want`` ([episodes, steps, action]) equal bit for bit; else where they first differ."""
    if not np.array_equal(bits(got), bits(want)):
        bad = np.argwhere(bits(got) != bits(want))[0]
        raise AssertionError(f"{what}: first differing action at episode {bad[0]} step {bad[1]}, max abs diff "
                             f"{float(np.abs(got - want).max()):.3g}")


def port_of(key: str) -> str:
    """observation.images.front -> front, observation.state -> joints."""
    return "joints" if key == "observation.state" else key.rsplit(".", 1)[-1]


def text_and_sensor_ports(features: Dict[str, np.ndarray], token_length: int) -> Dict[str, Any]:
    """ports.* parameters feeding a VLA fixture's recorded ``features`` ([episodes, steps, ...]
    each) from real message types, and the task from a String port (reliable, deep queues)."""
    ports: Dict[str, Any] = {}
    for key, value in features.items():
        shape = [int(d) for d in value.shape[2:]]
        common = {"topic": f"robot/{port_of(key)}", "shape": shape, "qos": "reliable", "depth": 100}
        if value.dtype == np.uint8:
            ports[port_of(key)] = {**common, "type": IMAGE, "fields": ["data"], "dtype": "uint8",
                                   "encodings": ["rgb8"]}
        else:
            ports[port_of(key)] = {**common, "type": JOINTS, "fields": ["position"],
                                   "names": joint_names(shape[0]), "dtype": "float32"}
    ports[TASK_PORT] = {"topic": "robot/task", "type": TEXT, "fields": ["data"], "shape": [2, token_length],
                        "dtype": "int64", "qos": "reliable", "depth": 100}
    return {"names": list(ports), **ports}


@dataclass
class RecordedVLA:
    """A VLA fixture as the tests drive it, whatever its kind: the recorded inputs (camera
    frames, joint states, the task of every step) and LeRobot's actions, a policy built
    through the kind's own ``build`` (``policy_kind(kind)``), a runtime driven as the node
    drives it, and the node's parameters. A kind's fixture says where its files are and
    how it names its tasks (``VLAFixture`` here, ``pi_fixtures.PiFixture``)."""

    name: str
    inputs: Dict[str, np.ndarray]
    outputs: Dict[str, np.ndarray]
    references: Dict[str, np.ndarray]  # async.npz
    meta: Dict[str, Any]

    kind: ClassVar[str]
    node_deadline_ms: ClassVar[float] = 0.0        # control.deadline_ms of ``serving_params``

    @staticmethod
    def recorded(name: str) -> Tuple[Dict[str, np.ndarray], ...]:
        """inputs, outputs and async references of the fixture ``name``."""
        return (load_npz(FIXTURES / name / "inputs.npz"),
                *(load_npz(reference_path(name, f"{part}.npz")) for part in ("outputs", "async")))

    # -- what a kind's fixture says ----------------------------------------------------------------
    @property
    def checkpoint(self) -> Path:
        raise NotImplementedError

    @property
    def vlm_files(self) -> Path:
        """``policy.<kind>.vlm_files``: the staged VLM (SmolVLA) or tokenizer (π) files."""
        raise NotImplementedError

    @property
    def token_length(self) -> int:
        raise NotImplementedError

    def task(self, episode: int, step: int) -> str:
        raise NotImplementedError

    # -- the recording -----------------------------------------------------------------------------
    @property
    def features(self) -> Dict[str, np.ndarray]:
        return {k: v for k, v in self.inputs.items() if k not in NOT_FEATURES}

    @property
    def episodes(self) -> int:
        return int(self.inputs["task"].shape[0])

    @property
    def steps(self) -> int:
        return int(self.inputs["task"].shape[1])

    def seed(self, episode: int) -> int:
        return int(self.inputs["seeds"][episode])

    # -- building --------------------------------------------------------------------------------
    def port_specs(self, task_port: bool = True) -> List[BufferSpec]:
        specs = [BufferSpec(port_of(k), v.shape[2:], torch.uint8 if v.dtype == np.uint8 else torch.float32,
                            BufferKind.INPUT) for k, v in self.features.items()]
        if task_port:
            specs.append(BufferSpec(TASK_PORT, (2, self.token_length), torch.int64, BufferKind.INPUT))
        return specs

    def feature_entries(self, task_port: bool = True) -> List[str]:
        return [f"{k}:{port_of(k)}" for k in self.features] + ([f"task:{TASK_PORT}"] if task_port else [])

    def settings(self, **overrides: Any) -> Any:
        """The kind's settings (``policy.<kind>``) for this fixture, with ``overrides``."""
        values: Dict[str, Any] = dict(pretrained_model=str(self.checkpoint), vlm_files=str(self.vlm_files),
                                      features=tuple(self.feature_entries()))
        values.update(overrides)
        return policy_kind(self.kind).settings(**values)

    def context(self, settings: Any = None, *, rtc: Optional[RTCSettings] = None, task: str = "",
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
        return policy_kind(self.kind).build(self.context(rtc=rtc, **kw))

    def runtime(self, mode: str = "sync", delay: int = 0, rtc: Optional[RTCSettings] = None, worker: str = "auto",
                **kw: Any) -> PolicyRuntime:
        return chunked_runtime(self.policy(rtc), mode, delay, worker, **kw)

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

    def check_capsules_at_every_cursor(self, runtime: PolicyRuntime, what: str) -> bool:
        """The arena at every row of a chunk cycle (after the episode's first chunk) put back
        after three steps on other inputs: the same bytes, then the same actions as the run
        that never left. Returns whether a refill was in flight at any of them (async)."""
        from capsule_ros.chunking.mark import ChunkingMark
        end = runtime.mode.schedule.end
        steps = 3 * end + 2
        assert steps <= self.steps, f"{what}: a chunk cycle after the first chunk needs {steps} recorded steps"
        runtime.reset(episode=1, seed=self.seed(0))
        original = np.stack([self.act(runtime, 0, t) for t in range(steps)])
        seen_pending = False
        for k in range(end, 2 * end + 1):                # a whole chunk cycle, after the episode's first chunk
            runtime.reset(episode=1, seed=self.seed(0))
            for t in range(k):
                self.act(runtime, 0, t)
            runtime.synchronize()
            snapshot = runtime.arena.storage.clone()
            seen_pending |= ChunkingMark.parse(runtime.mark()).pending
            for t in range(k, k + 3):                    # move on (other inputs), then come back
                self.act(runtime, 1, t)
            runtime.load_state(snapshot)
            assert torch.equal(runtime.arena.storage, snapshot), f"{what}: restore at step {k} not byte-exact"
            again = np.stack([self.act(runtime, 0, t) for t in range(k, steps)])
            assert_same_actions(again[None], original[None, k:], f"{what}: capsule at step {k}")
        return seen_pending

    def rollout(self, runtime: PolicyRuntime, episodes: Optional[int] = None) -> np.ndarray:
        """Every action of the recorded episodes (``runtime.reset`` with the episode's seed between them)."""
        episodes = self.episodes if episodes is None else episodes
        actions = np.zeros((episodes, self.steps, self.outputs["action"].shape[-1]), np.float32)
        for e in range(episodes):
            runtime.reset(episode=e + 1, seed=self.seed(e))
            for t in range(self.steps):
                actions[e, t] = self.act(runtime, e, t)
        return actions

    # -- the node --------------------------------------------------------------------------------
    def port_params(self) -> Dict[str, Any]:
        return text_and_sensor_ports(self.features, self.token_length)

    def serving_params(self, episode: int = 0, **control: Any) -> Dict[str, Any]:
        """The full parameter mapping (config/policy.yaml with this fixture's ports, the task
        through a String port, and its policy; trigger mode on the joint port; seeded like
        ``episode``'s recording, ``policy.task`` its first step's) that
        ServingConfig.from_params takes."""
        from capsule_ros.config import load_params_file
        params = load_params_file(REPO / "config" / "policy.yaml")
        params["ports"] = self.port_params()
        params["policy"] = {"kind": self.kind, "weights": "", "task": self.task(episode, 0),
                            self.kind: {"pretrained_model": str(self.checkpoint), "vlm_files": str(self.vlm_files),
                                        "features": self.feature_entries()}}
        params["control"].update({"mode": "trigger", "trigger_port": "joints", "deadline_ms": self.node_deadline_ms,
                                  "status_rate_hz": 50.0, **control})
        params["runtime"].update(device="cpu", seed=self.seed(episode))
        params["capsules"]["directory"] = ""
        return params


@dataclass
class VLAFixture(RecordedVLA):
    """A SmolVLA fixture: its checkpoint and staged VLM files unpacked under ``root``; the
    tasks are indices into the recording's ``tasks``."""

    root: Path = Path()                # holds pretrained_model/ and vlm/

    kind: ClassVar[str] = "lerobot_smolvla"
    node_deadline_ms: ClassVar[float] = 10000.0

    @classmethod
    def load(cls, name: str, root: Path) -> VLAFixture:
        return cls(name, *cls.recorded(name), json.loads((FIXTURES / name / "meta.json").read_text()),
                   root=extract(FIXTURES / name / "pretrained_model.tar.xz", root / name))

    @property
    def checkpoint(self) -> Path:
        return self.root / "pretrained_model"

    @property
    def vlm(self) -> Path:
        return self.root / "vlm"

    @property
    def vlm_files(self) -> Path:
        return self.vlm

    @property
    def tasks(self) -> List[str]:
        return [str(t) for t in self.inputs["tasks"]]

    @property
    def token_length(self) -> int:
        return int(self.meta["options"]["tokenizer_max_length"])

    def task(self, episode: int, step: int) -> str:
        return self.tasks[int(self.inputs["task"][episode, step])]

    def async_cases(self) -> List[tuple]:
        """(reference key, delay, RTCSettings) of every async reference."""
        cases = []
        for delay in self.meta["delays"]:
            cases.append((f"action_d{delay}", delay, RTCSettings()))
            for r in self.meta["rtc"]:
                if r["delay"] == delay:
                    cases.append((f"action_d{delay}_rtc{r['index']}", delay,
                                  RTCSettings("guided", r["max_guidance_weight"], r["prefix_attention_schedule"],
                                              r["execution_horizon"])))
        return cases
