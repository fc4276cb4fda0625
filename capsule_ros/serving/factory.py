"""Build the policy, its runtime and the session over them from a ServingConfig, in the
node's two lifecycle phases: ``prepare_serving`` (configure: no device memory yet) and
``start_session`` (activate); ``build_session`` does both."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.store import CapsuleStore
from capsule_ros.errors import ConfigError
from capsule_ros.policies.registry import BuildContext, policy_kind
from capsule_ros.runtime import numerics
from capsule_ros.runtime.arena import ArenaLayout, BufferKind, BufferSpec, dtype_from_name
from capsule_ros.runtime.chunking import ChunkSchedule, resolve_delay
from capsule_ros.runtime.engine import ChunkingOptions, PolicyRuntime, StreamKeeper, runtime_identity
from capsule_ros.runtime.fingerprint import FingerprintParts
from capsule_ros.runtime.policy import StatefulPolicy
from capsule_ros.serving.capsule_set import DirectoryWatch
from capsule_ros.serving.config import ControlConfig, ServingConfig
from capsule_ros.serving.options import SessionOptions
from capsule_ros.serving.recompute import check_log_size
from capsule_ros.serving.session import PolicySession

BUILTIN_DIR = Path(__file__).resolve().parents[1] / "policies"


def resolve_weights(spec: str) -> Optional[Path]:
    """'builtin:<name>' -> the shipped file; a path -> itself; '' -> None (random init)."""
    if not spec:
        return None
    if spec.startswith("builtin:"):
        path = BUILTIN_DIR / f"{spec[len('builtin:'):]}.safetensors"
    else:
        path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"policy.weights = {spec!r}: no such file {path}")
    return path


def input_specs(config: ServingConfig) -> List[BufferSpec]:
    """One input buffer per port, of the port's shape and dtype."""
    return [BufferSpec(name, port.shape, dtype_from_name(port.dtype), BufferKind.INPUT)
            for name, port in config.ports.items()]


def build_policy(config: ServingConfig, weights: Optional[str] = None,
                 device: Optional[torch.device] = None) -> StatefulPolicy:
    """The configured kind's policy for the configured ports (``weights`` overrides
    policy.weights). ``device`` lets the kind build its modules there directly (random
    initialisation of a large policy is much faster on a GPU). The CPU numerics level is
    pinned first: building the policy runs torch's first kernels (``runtime.numerics``)."""
    numerics.pin(config.runtime.numerics)
    spec = config.policy.weights if weights is None else weights
    context = BuildContext(settings=config.policy_settings, inputs=tuple(input_specs(config)), ports=config.ports,
                           weights=resolve_weights(spec), seed=config.policy.init_seed,
                           device=torch.device(device or "cpu"))
    return policy_kind(config.policy.kind).build(context)


def build_runtime(config: ServingConfig, weights: Optional[str] = None) -> PolicyRuntime:
    """The configured policy's runtime; its fingerprint covers what fills each input."""
    return PolicyRuntime(build_policy(config, weights), config.runtime, inputs=port_bindings(config),
                         chunking=chunking_options(config))


def chunking_options(config: ServingConfig, *, worker: str = "auto") -> ChunkingOptions:
    """The chunk schedule settings of ``control`` (``chunking``, ``inference_delay_steps``,
    ``execution_horizon``; the rate for an ``auto`` delay)."""
    control = config.control
    return ChunkingOptions(control.chunking, resolve_delay(control.inference_delay_steps), control.execution_horizon,
                           control.rate_hz, worker)


def resolved_control(control: ControlConfig, runtime: PolicyRuntime) -> ControlConfig:
    """``control`` with the delay the runtime fixed (``inference_delay_steps: auto`` becomes
    the measured number): what capsules, bags and a replay must use, never ``auto`` again."""
    schedule = runtime.schedule
    if schedule is None or schedule.mode.value != "async" or control.inference_delay_steps != "auto":
        return control
    return dataclasses.replace(control, inference_delay_steps=str(schedule.delay))


def check_chunking(policy: StatefulPolicy, config: ServingConfig) -> None:
    """Refuse at configure a chunk schedule whose numbers cannot work (ConfigError with the
    numbers); an ``auto`` delay is known, and checked, only at activate."""
    cadence = policy.cadence()
    options = chunking_options(config)
    if cadence is not None and (options.mode == "sync" or options.delay is not None):
        ChunkSchedule.resolve(cadence, options.mode, options.delay or 0, options.horizon)


def port_bindings(config: ServingConfig) -> Dict[str, dict]:
    return {name: port.binding() for name, port in config.ports.items()}


def capsule_directory_path(template: str, node_name: str) -> Path:
    """capsules.directory with ``{node}`` replaced by the node's name ("/robot1/capsule_policy"
    -> "robot1.capsule_policy"): one directory per node, since a directory recovers its
    unfinished saves at start-up."""
    return Path(template.replace("{node}", node_name.strip("/").replace("/", ".") or "capsule_policy")).expanduser()


@dataclass
class PreparedServing:
    """What can be known and checked before any device memory is used (the node's
    lifecycle ``configure``): the validated configuration, the policy with its weights on
    the CPU, the fingerprint its runtime will have (and its parts), and the open capsule
    directory."""

    config: ServingConfig
    policy: StatefulPolicy
    fingerprint: str
    directory: Optional[CapsuleDirectory] = None       # None when capsules.directory is ''
    parts: Optional[FingerprintParts] = None


def prepare_serving(config: ServingConfig, *, weights: Optional[str] = None, node_name: str = "capsule_policy",
                    directory: Optional[CapsuleDirectory] = None) -> PreparedServing:
    """Build the policy on the CPU (weights read and checked), check what needs the policy
    (the chunk schedule, the reset prefix, the input log's size), compute the fingerprint
    (and its parts) and open the capsule directory (which moves unfinished saves aside);
    ``directory``: use this one instead of opening ``capsules.directory`` (a replay's
    read-only directory). A bad value raises ConfigError here, before any device memory is
    used. (The node also surveys the directory's capsules of another fingerprint:
    ``capsule_ros.updates.watch``.)"""
    policy = build_policy(config, weights)
    check_chunking(policy, config)
    policy.check_prefix(config.policy.prefix)
    in_start, in_end = ArenaLayout(policy.state_spec()).byte_range(BufferKind.INPUT)   # one step's inputs
    check_log_size(config.control.input_log_steps, in_end - in_start, config.control.input_log_max_mb)
    fingerprint, parts = runtime_identity(policy, config.runtime, port_bindings(config))
    if directory is None and config.capsules.directory:
        directory = CapsuleDirectory(capsule_directory_path(config.capsules.directory, node_name),
                                     key_file=config.capsules.key_file,
                                     chunk_bytes=int(config.capsules.chunk_mb * 2**20),
                                     max_file_bytes=int(config.capsules.max_file_mb * 2**20))
    return PreparedServing(config, policy, fingerprint, directory, parts)


def start_session(prepared: PreparedServing, *, options: Optional[SessionOptions] = None,
                  streams: Optional[StreamKeeper] = None, watch: Optional[DirectoryWatch] = None) -> PolicySession:
    """The runtime on its device (arena, graph capture, warm-up), the capsule store and the
    session over them (the node's lifecycle ``activate``); episode 1 starts when
    ``control.autostart``. ``options``: how the session is driven (its clock, events...).
    ``streams``: pass the same keeper to every activation of one owner (``StreamKeeper``
    says why). ``watch``: the model updates of the capsule directory the session's status
    shows (the node's: ``capsule_ros.updates.watch``)."""
    config = prepared.config
    runtime = PolicyRuntime(prepared.policy, config.runtime, inputs=port_bindings(config), streams=streams,
                            chunking=chunking_options(config), _fingerprint=prepared.fingerprint,
                            _parts=prepared.parts)
    store = CapsuleStore(runtime.layout.nbytes, runtime.fingerprint, runtime.device, config.capsules)
    session = PolicySession(runtime, store, resolved_control(config.control, runtime), directory=prepared.directory,
                            ports=config.ports, prefix=config.policy.prefix, watch=watch, options=options)
    if config.control.autostart:
        session.verbs.reset()
    session.warm_up()
    return session


def build_session(config: ServingConfig, *, weights: Optional[str] = None, options: Optional[SessionOptions] = None,
                  node_name: str = "capsule_policy", directory: Optional[CapsuleDirectory] = None) -> PolicySession:
    """Configure and start in one call (the demo, replays, benchmarks)."""
    return start_session(prepare_serving(config, weights=weights, node_name=node_name, directory=directory),
                         options=options)
