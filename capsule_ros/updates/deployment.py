"""A deployment: a parameter file's policy, ports, runtime and chunking, known without
building a runtime (its fingerprint and parts, arena layout and input rows), with runtimes
built on demand for regenerating capsules under it."""
from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Optional, Tuple

from capsule_ros.capsules.recipe import RecipeInput
from capsule_ros.chunking.mark import ChunkingMark
from capsule_ros.chunking.mode import mode_for
from capsule_ros.runtime.arena import ArenaLayout, BufferKind
from capsule_ros.runtime.builder import build_policy_runtime, runtime_identity
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.runtime.fingerprint import FingerprintParts, RuntimeIdentity
from capsule_ros.runtime.marks import ModeMark
from capsule_ros.runtime.policy import StatefulPolicy
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_policy, port_bindings
from capsule_ros.serving.recipes import layout_inputs
from capsule_ros.updates.errors import BadArguments


class Deployment:
    """See the module docstring. ``runtime_for`` builds runtimes on demand (one per chunk
    delay: an ``auto`` delay takes the one a capsule recorded), planning chunks inline as a
    replica does."""

    def __init__(self, config: ServingConfig, policy: StatefulPolicy, fingerprint: str, parts: FingerprintParts,
                 bindings: Mapping[str, object], runtime: Optional[PolicyRuntime] = None):
        self.config = config
        self.policy = policy
        self.fingerprint = fingerprint
        self.parts = parts
        self.bindings = bindings
        self.layout = ArenaLayout(policy.state_spec())
        self.schema = self.layout.schema()
        self.inputs: Tuple[RecipeInput, ...] = layout_inputs(self.layout, bindings)
        start, end = self.layout.byte_range(BufferKind.INPUT)
        self.row_bytes = end - start
        self._runtimes: Dict[Optional[int], PolicyRuntime] = {}
        self._given = runtime

    @classmethod
    def of_policy(cls, config: ServingConfig, policy: StatefulPolicy, bindings: Mapping[str, object]) -> Deployment:
        """A deployment of a policy built with its weights (``load_deployment``)."""
        identity = runtime_identity(policy, config.runtime, bindings)
        return cls(config, policy, identity.fingerprint, identity.parts, bindings)

    @classmethod
    def of_runtime(cls, config: ServingConfig, runtime: PolicyRuntime) -> Deployment:
        """A running deployment: every capsule is replayed on ``runtime`` (the node's replica)."""
        return cls(config, runtime.policy, runtime.fingerprint, runtime.fingerprint_parts, dict(runtime.inputs),
                   runtime)

    @property
    def supports_prefill(self) -> bool:
        return bool(self.policy.supports_prefill)

    def runtime_for(self, mark: Optional[ModeMark]) -> PolicyRuntime:
        """The runtime a capsule with ``mark`` is replayed on (an ``auto`` delay: the one
        its chunking mark recorded)."""
        if self._given is not None:
            return self._given
        settings = self.config.control.chunking_settings(worker="inline")
        if self.policy.cadence() is not None and settings.timing == "async" and settings.delay is None:
            if mark is None:
                raise BadArguments("control.inference_delay_steps is auto and the capsule records no chunk delay: "
                                   "set the delay in the parameter file")
            settings = dataclasses.replace(settings, delay=ChunkingMark.parse(mark).delay)
        if settings.delay not in self._runtimes:
            self._runtimes[settings.delay] = build_policy_runtime(
                self.policy, self.config.runtime, mode=mode_for(self.policy, settings), inputs=self.bindings,
                identity=RuntimeIdentity(self.fingerprint, self.parts))
        return self._runtimes[settings.delay]

    def close(self) -> None:
        for runtime in self._runtimes.values():
            runtime.close()
        self._runtimes.clear()


def load_deployment(config: ServingConfig) -> Deployment:
    """The deployment of a parameter file for ``capsule-ros check`` / ``regenerate`` and the
    node's background regeneration: its policy built with its weights on the CPU, its
    identity."""
    return Deployment.of_policy(config, build_policy(config), port_bindings(config))
