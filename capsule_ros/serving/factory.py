"""Build the policy, its execution mode, its runtime and the session over them from a
ServingConfig.

In the order of the node's lifecycle: ``prepare_serving`` (configure: the policy on the
CPU, every check that needs no device, the identity), ``settle_mode`` (activate: the
execution mode, an ``auto`` inference delay measured on the device, and the configuration
that records it), ``start_session`` (activate: the runtime built in that mode, the store,
the session); ``build_session`` does all three. Each passes its result down; nothing is
read back up from a runtime."""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.store import CapsuleStore
from capsule_ros.chunking.mode import Chunking, mode_for
from capsule_ros.chunking.schedule import RefillTiming, check_settings
from capsule_ros.errors import ConfigError
from capsule_ros.policies.registry import BuildContext, policy_kind
from capsule_ros.policies.vla.rtc import RTCSettings
from capsule_ros.runtime import numerics
from capsule_ros.runtime.arena import ArenaLayout, BufferKind, BufferSpec, dtype_from_name
from capsule_ros.runtime.builder import build_policy_runtime, place_policy, runtime_identity
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.runtime.fingerprint import RuntimeIdentity
from capsule_ros.runtime.mode import ModeSetup
from capsule_ros.runtime.policy import StatefulPolicy
from capsule_ros.runtime.streams import StreamKeeper
from capsule_ros.serving.capsule_set import DirectoryWatch
from capsule_ros.serving.config import ControlConfig, ServingConfig
from capsule_ros.serving.options import SessionOptions
from capsule_ros.serving.ports import TEXT_TYPE
from capsule_ros.serving.recompute import check_log_size
from capsule_ros.serving.session import PolicySession
from capsule_ros.serving.statecheck import StateCheckBeside

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


def build_runtime(config: ServingConfig, weights: Optional[str] = None, *, worker: str = "auto") -> PolicyRuntime:
    """The configured policy's runtime, in its configured mode (``worker``: the chunking
    mode's refill worker); its fingerprint covers what fills each input."""
    policy, streams = build_policy(config, weights), StreamKeeper()
    return build_policy_runtime(policy, config.runtime, mode=execution_mode(policy, config, streams=streams,
                                                                            worker=worker),
                                inputs=port_bindings(config), streams=streams)


def execution_mode(policy: StatefulPolicy, config: ServingConfig, *, streams: Optional[StreamKeeper] = None,
                   worker: str = "auto") -> ModeSetup:
    """The mode the configured policy runs in, settled before its runtime is built: the
    every-step mode, or its chunking under ``control`` (an ``auto`` inference delay is
    measured now, with the policy placed on ``runtime.device``)."""
    if policy.cadence() is None:
        return mode_for(policy)
    placed = place_policy(policy, config.runtime)
    return mode_for(placed.policy, config.control.chunking_settings(worker), device=placed.device, streams=streams,
                    use_graphs=config.runtime.cuda_graphs)


def recorded_control(control: ControlConfig, mode: ModeSetup) -> ControlConfig:
    """``control`` as capsules, bags and a replay must record it under ``mode``: an
    ``inference_delay_steps: auto`` becomes the number the mode was settled with."""
    if not isinstance(mode, Chunking) or mode.schedule.timing != RefillTiming.ASYNC \
            or control.inference_delay_steps != "auto":
        return control
    return dataclasses.replace(control, inference_delay_steps=str(mode.schedule.delay))


def check_chunking(policy: StatefulPolicy, config: ServingConfig) -> None:
    """Refuse at configure a chunk schedule whose numbers cannot work (ConfigError with the
    numbers); an ``auto`` delay is known, and checked, only at activate."""
    cadence = policy.cadence()
    if cadence is not None:
        check_settings(cadence, config.control.chunking_settings())


def check_text_ports(policy: StatefulPolicy, config: ServingConfig) -> None:
    """Every text port (``std_msgs/msg/String``) is one the policy encodes text into."""
    text = policy.text_inputs()
    for name, port in config.ports.items():
        if port.type == TEXT_TYPE and name not in text:
            raise ConfigError(f"port {name!r} ({TEXT_TYPE}): policy kind {config.policy.kind!r} reads no text from it "
                              "(a vision-language-action policy maps its task port as 'task:<port>')")


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
    the CPU, the identity its runtime will have (fingerprint and parts) and the open capsule
    directory. ``settle_mode`` adds the execution mode (at ``activate``) and the
    configuration that records it."""

    config: ServingConfig
    policy: StatefulPolicy
    identity: RuntimeIdentity
    directory: Optional[CapsuleDirectory] = None       # None when capsules.directory is ''
    mode: Optional[ModeSetup] = None                   # None until ``settle_mode``
    weights: Optional[str] = None                      # what overrode policy.weights (``prepare_serving``)

    @property
    def fingerprint(self) -> str:
        return self.identity.fingerprint


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
    check_text_ports(policy, config)
    policy.check_prefix(config.policy.prefix)
    in_start, in_end = ArenaLayout(policy.state_spec()).byte_range(BufferKind.INPUT)   # one step's inputs
    check_log_size(config.control.input_log_steps, in_end - in_start, config.control.input_log_max_mb)
    identity = runtime_identity(policy, config.runtime, port_bindings(config))
    if directory is None and config.capsules.directory:
        directory = CapsuleDirectory(capsule_directory_path(config.capsules.directory, node_name),
                                     key_file=config.capsules.key_file,
                                     chunk_bytes=int(config.capsules.chunk_mb * 2**20),
                                     max_file_bytes=int(config.capsules.max_file_mb * 2**20))
    return PreparedServing(config, policy, identity, directory, weights=weights)


def settle_mode(prepared: PreparedServing, *, streams: Optional[StreamKeeper] = None) -> PreparedServing:
    """``prepared`` with its execution mode settled (``execution_mode``: an ``auto``
    inference delay is measured on the device, so this belongs to ``activate``) and the
    configuration that records it (``recorded_control``); unchanged when settled already."""
    if prepared.mode is not None:
        return prepared
    config = prepared.config
    mode = execution_mode(prepared.policy, config, streams=streams)
    config = dataclasses.replace(config, control=recorded_control(config.control, mode))
    return dataclasses.replace(prepared, config=config, mode=mode)


def checks_state_while_serving(config: ServingConfig, policy: StatefulPolicy) -> bool:
    """Whether ``runtime.state_check_timing`` puts the state check beside serving (``auto``:
    on a CPU, for a chunking policy: ``capsule_ros.serving.statecheck``)."""
    runtime = config.runtime
    if not runtime.runs_state_check or runtime.state_check_timing == "before_serving":
        return False
    if runtime.state_check_timing == "while_serving":
        return True
    return runtime.resolve_device().type == "cpu" and policy.cadence() is not None


def start_session(prepared: PreparedServing, *, options: Optional[SessionOptions] = None,
                  streams: Optional[StreamKeeper] = None, watch: Optional[DirectoryWatch] = None,
                  warm_up: bool = True, check_beside: bool = False) -> PolicySession:
    """The runtime on its device (arena, graph capture, warm-up) in the settled mode
    (``settle_mode``, run here when the caller has not), the capsule store and the session
    over them (the node's lifecycle ``activate``); episode 1 starts when
    ``control.autostart``. ``options``: how the session is driven (its clock, events...).
    ``streams``: pass the same keeper to every activation of one owner (``StreamKeeper``
    says why). ``watch``: the model updates of the capsule directory the session's status
    shows (the node's: ``capsule_ros.updates.watch``). ``warm_up`` False: the caller runs
    ``PolicySession.warm_up`` itself right before stepping starts (the node does, after it
    settles its heap; twice cost a camera policy two more steps of its start-up).
    ``check_beside``: the state check may run beside serving where
    ``runtime.state_check_timing`` says so (``checks_state_while_serving``; the node's
    choice: a replay or a benchmark checks before its first step)."""
    streams = streams or StreamKeeper()         # one keeper for an auto delay's measurement and the runtime
    prepared = settle_mode(prepared, streams=streams)
    config = prepared.config
    mode = prepared.mode
    assert mode is not None
    beside = check_beside and checks_state_while_serving(config, prepared.policy)
    bindings = port_bindings(config)
    runtime = build_policy_runtime(prepared.policy, config.runtime, mode=mode, inputs=bindings,
                                   identity=prepared.identity, streams=streams, checked_elsewhere=beside)
    state_check = None
    if beside:
        def checking_runtime(policy: StatefulPolicy, stop: threading.Event) -> PolicyRuntime:
            return build_policy_runtime(policy, config.runtime, mode=mode, inputs=bindings,
                                        identity=prepared.identity, streams=StreamKeeper(), stream_role="check",
                                        stop_check=stop)
        state_check = StateCheckBeside(prepared.policy, checking_runtime,
                                       lambda: build_policy(config, prepared.weights))
    store = CapsuleStore(runtime.layout.nbytes, runtime.fingerprint, runtime.device, config.capsules)
    session = PolicySession(runtime, store, config.control, directory=prepared.directory,
                            ports=config.ports, prefix=config.policy.prefix, watch=watch, options=options,
                            state_check=state_check)
    if config.control.autostart:
        session.verbs.reset()
    if warm_up:
        session.warm_up()
    return session


def build_session(config: ServingConfig, *, weights: Optional[str] = None, options: Optional[SessionOptions] = None,
                  node_name: str = "capsule_policy", directory: Optional[CapsuleDirectory] = None) -> PolicySession:
    """Configure and start in one call (the demo, replays, benchmarks)."""
    return start_session(prepare_serving(config, weights=weights, node_name=node_name, directory=directory),
                         options=options)
