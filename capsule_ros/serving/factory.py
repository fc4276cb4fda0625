"""Build the policy and its runtime from a ServingConfig."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.store import CapsuleStore
from capsule_ros.errors import ConfigError
from capsule_ros.policies.registry import BuildContext, policy_kind
from capsule_ros.policies.vla.rtc import RTCSettings
from capsule_ros.runtime import numerics
from capsule_ros.runtime.arena import ArenaLayout, BufferKind, BufferSpec, dtype_from_name
from capsule_ros.runtime.chunking import ChunkSchedule, resolve_delay
from capsule_ros.runtime.engine import ChunkingOptions, PolicyRuntime, StreamKeeper, runtime_identity
from capsule_ros.runtime.fingerprint import FingerprintParts
from capsule_ros.runtime.policy import StatefulPolicy
from capsule_ros.serving.config import ControlConfig, ServingConfig
from capsule_ros.serving.invalidation import Survey, survey
from capsule_ros.serving.ports import TEXT_TYPE
from capsule_ros.serving.recompute import check_log_size
from capsule_ros.serving.records import EventRecord
from capsule_ros.serving.regenerate import BackgroundRegeneration, CapsuleFiles, Deployment
from capsule_ros.serving.session import PolicySession

BUILTIN_DIR = Path(__file__).resolve().parents[1] / "policies"
LOG = logging.getLogger(__name__)


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
                           device=torch.device(device or "cpu"), task=config.policy.task,
                           rtc=rtc_settings(config.control))
    policy = policy_kind(config.policy.kind).build(context)
    if context.rtc is not None and context.rtc.guided and getattr(policy, "guidance", None) is None:
        raise ConfigError(f"control.rtc = 'guided': policy kind {config.policy.kind!r} has no real-time chunking "
                          "guidance (the VLA kinds have)")
    return policy


def rtc_settings(control: ControlConfig) -> RTCSettings:
    """``control.rtc`` and its settings."""
    return RTCSettings(control.rtc, control.rtc_max_guidance_weight, control.rtc_prefix_attention_schedule,
                       control.rtc_execution_horizon)


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


def check_text_ports(policy: StatefulPolicy, config: ServingConfig) -> None:
    """Every text port (``std_msgs/msg/String``) is one the policy encodes text into."""
    text = policy.text_inputs()
    for name, port in config.ports.items():
        if port.type == TEXT_TYPE and name not in text:
            raise ConfigError(f"port {name!r} ({TEXT_TYPE}): policy kind {config.policy.kind!r} reads no text from it "
                              "(a vision-language-action policy maps its task port as 'task:<port>')")


def port_bindings(config: ServingConfig) -> Dict[str, dict]:
    return {name: port.binding() for name, port in config.ports.items()}


def load_deployment(config: ServingConfig) -> Deployment:
    """The deployment of a parameter file for ``capsule-ros check`` / ``regenerate``: its
    policy built with its weights on the CPU, its identity (``Deployment``)."""
    return Deployment.of_policy(config, build_policy(config), port_bindings(config))


def capsule_directory_path(template: str, node_name: str) -> Path:
    """capsules.directory with ``{node}`` replaced by the node's name ("/robot1/capsule_policy"
    -> "robot1.capsule_policy"): one directory per node, since a directory recovers its
    unfinished saves at start-up."""
    return Path(template.replace("{node}", node_name.strip("/").replace("/", ".") or "capsule_policy")).expanduser()


@dataclass
class PreparedServing:
    """What can be known and checked before any device memory is used (the node's
    lifecycle ``configure``): the validated configuration, the policy with its weights on
    the CPU, the fingerprint its runtime will have (and its parts), the open capsule
    directory, and the survey of its files of another fingerprint."""

    config: ServingConfig
    policy: StatefulPolicy
    fingerprint: str
    directory: Optional[CapsuleDirectory] = None       # None when capsules.directory is ''
    parts: Optional[FingerprintParts] = None
    survey: Survey = field(default_factory=Survey)


def prepare_serving(config: ServingConfig, *, weights: Optional[str] = None, node_name: str = "capsule_policy",
                    directory: Optional[CapsuleDirectory] = None) -> PreparedServing:
    """Build the policy on the CPU (weights read and checked), check what needs the policy
    (the chunk schedule, the reset prefix, the input log's size), compute the fingerprint
    (and its parts), open the capsule directory (which moves unfinished saves aside) and
    count its capsules of another fingerprint by cause (headers only; logged when there are
    any); ``directory``: use this one instead of opening ``capsules.directory`` (a replay's
    read-only directory). A bad value raises ConfigError here, before any device memory is
    used."""
    policy = build_policy(config, weights)
    check_chunking(policy, config)
    check_text_ports(policy, config)
    policy.check_prefix(config.policy.prefix)
    in_start, in_end = ArenaLayout(policy.state_spec()).byte_range(BufferKind.INPUT)   # one step's inputs
    check_log_size(config.control.input_log_steps, in_end - in_start, config.control.input_log_max_mb)
    fingerprint, parts = runtime_identity(policy, config.runtime, port_bindings(config))
    if directory is None and config.capsules.directory:
        directory = CapsuleDirectory(capsule_directory_path(config.capsules.directory, node_name),
                                     key_file=config.capsules.key_file,
                                     chunk_bytes=int(config.capsules.chunk_mb * 2**20),
                                     max_file_bytes=int(config.capsules.max_file_mb * 2**20))
    found = survey(directory, fingerprint, parts, ArenaLayout(policy.state_spec()).schema())
    if found.stale:
        LOG.warning("capsule directory %s: %s (`capsule-ros check` says why; `capsule-ros regenerate` or "
                    "capsules.regenerate_stale rebuild those with a recipe)", directory.root if directory else "",
                    found.describe())
    return PreparedServing(config, policy, fingerprint, directory, parts, found)


def start_session(prepared: PreparedServing, *, on_event: Optional[Callable[[EventRecord], None]] = None,
                  streams: Optional[StreamKeeper] = None) -> PolicySession:
    """The runtime on its device (arena, graph capture, warm-up), the capsule store and the
    session over them (the node's lifecycle ``activate``); episode 1 starts when
    ``control.autostart``. ``streams``: pass the same keeper to every activation of one
    owner (``StreamKeeper`` says why). With ``capsules.regenerate_stale`` the directory's
    stale capsules that carry a recipe are regenerated in the background
    (``BackgroundRegeneration``), started last."""
    config = prepared.config
    runtime = PolicyRuntime(prepared.policy, config.runtime, inputs=port_bindings(config), streams=streams,
                            chunking=chunking_options(config), _fingerprint=prepared.fingerprint,
                            _parts=prepared.parts)
    store = CapsuleStore(runtime.layout.nbytes, runtime.fingerprint, runtime.device, config.capsules)
    found, background = prepared.survey, None
    if config.capsules.regenerate_stale and found.stale and prepared.directory is not None:
        background = BackgroundRegeneration(config, prepared.directory, found.stale_ids, runtime.fingerprint,
                                            load_deployment)
    session = PolicySession(runtime, store, resolved_control(config.control, runtime), directory=prepared.directory,
                            ports=config.ports, prefix=config.policy.prefix, on_event=on_event,
                            files=CapsuleFiles(found, background))
    if config.control.autostart:
        session.reset()
    session.warm_up()
    if background is not None:
        background.start()
    return session


def build_session(config: ServingConfig, *, weights: Optional[str] = None,
                  on_event: Optional[Callable[[EventRecord], None]] = None, node_name: str = "capsule_policy",
                  directory: Optional[CapsuleDirectory] = None) -> PolicySession:
    """Configure and start in one call (the demo, replays, benchmarks)."""
    return start_session(prepare_serving(config, weights=weights, node_name=node_name, directory=directory),
                         on_event=on_event)
