"""A deployment: a parameter file's policy, ports, runtime and chunking, known without
building a runtime (its fingerprint and parts, arena layout and input rows), with runtimes
built on demand for regenerating capsules under it."""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

from capsule_ros.capsules.recipe import RecipeInput
from capsule_ros.runtime.arena import ArenaLayout, BufferKind
from capsule_ros.runtime.chunkmark import ChunkMark
from capsule_ros.runtime.engine import ChunkingOptions, PolicyRuntime, runtime_identity
from capsule_ros.runtime.fingerprint import FingerprintParts
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
        fingerprint, parts = runtime_identity(policy, config.runtime, bindings)
        return cls(config, policy, fingerprint, parts, bindings)

    @classmethod
    def of_runtime(cls, config: ServingConfig, runtime: PolicyRuntime) -> Deployment:
        """A running deployment: every capsule is replayed on ``runtime`` (the node's replica)."""
        return cls(config, runtime.policy, runtime.fingerprint, runtime.fingerprint_parts, dict(runtime.inputs),
                   runtime)

    @property
    def supports_prefill(self) -> bool:
        return bool(self.policy.supports_prefill)

    def runtime_for(self, chunk: Optional[ChunkMark]) -> PolicyRuntime:
        if self._given is not None:
            return self._given
        control = self.config.control
        delay: Optional[int] = None
        if self.policy.cadence() is not None and control.chunking == "async":
            delay = int(control.inference_delay_steps) if control.inference_delay_steps != "auto" else (
                chunk.delay if chunk is not None else None)
            if delay is None:
                raise BadArguments("control.inference_delay_steps is auto and the capsule records no chunk delay: "
                                   "set the delay in the parameter file")
        if delay not in self._runtimes:
            options = ChunkingOptions(control.chunking, delay, control.execution_horizon, control.rate_hz, "inline")
            self._runtimes[delay] = PolicyRuntime(self.policy, self.config.runtime, inputs=self.bindings,
                                                  chunking=options, _fingerprint=self.fingerprint,
                                                  _parts=self.parts)
        return self._runtimes[delay]

    def close(self) -> None:
        for runtime in self._runtimes.values():
            runtime.close()
        self._runtimes.clear()


def load_deployment(config: ServingConfig) -> Deployment:
    """The deployment of a parameter file for ``capsule-ros check`` / ``regenerate`` and the
    node's background regeneration: its policy built with its weights on the CPU, its
    identity."""
    return Deployment.of_policy(config, build_policy(config), port_bindings(config))
