"""The in-process replay target: a ``PolicySession`` built from the recorded config.

A target offers the replay engine (``capsule_ros.bag.replay``) the same verbs as a node:
feed a sensor message (and step when it is a trigger), step, and the capsule services.
Sensor messages reach the policy through the same port code as in the node. The other
target, a ``policy_node`` process driven through ROS, is ``capsule_ros.ros.replay_target``
(the bag layer itself needs no ROS).

Replays never write to a capsule directory: capsules the bag does not commit itself
(``--from-capsule``, a re-entry of a capsule saved before the recording) are read through
a read-only ``CapsuleDirectory``, which neither creates, changes nor recovers anything.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

from capsule_ros.bag.ablation import complement_runs
from capsule_ros.bag.verdict import Act
from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.errors import NotFound
from capsule_ros.runtime.schema import BufferKind
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.ports import PortDrop, stamp_ns
from capsule_ros.serving.records import HoldMode


class InProcessTarget:
    """A PolicySession built from the recorded config, in this process."""

    kind = "in-process"
    reenacts_deadline_misses = True       # tick(late=True): the session hands out its safe action
    stages_without_stepping = True        # feed(tick=False) stages a trigger message without a step

    def __init__(self, config: ServingConfig, files: Optional[CapsuleDirectory], ablation: Sequence[BufferKind] = ()):
        from capsule_ros.serving.factory import build_session
        # no capsule directory: the replay reads capsule files itself and never writes one
        config = dataclasses.replace(config, capsules=dataclasses.replace(config.capsules, directory=""))
        self.session = build_session(config)
        self.session.enforce_deadline = False      # verify the function, not this machine's timing
        self.files = files
        self.ablation = tuple(ablation)

    def __enter__(self) -> InProcessTarget:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def fingerprint(self) -> str:
        return self.session.runtime.fingerprint

    def feed(self, port: str, raw: bytes, msg: Any, tick: bool, expect: bool = False,
             log_ns: Optional[int] = None, late: bool = False) -> List[Act]:
        """A sensor message through the session's port, checked against the clock of the
        recording (its log time: when the node received it); a step if ``tick`` and it
        was accepted (``late``: the recording says that step missed its deadline)."""
        if msg is None:                            # undecodable: the node counts it and drops it
            self.session.ports[port].counters.dropped["type"] += 1
            return []
        try:
            self.session.receive(port, msg, log_ns)
        except PortDrop:
            return []
        return self.step(stamp_ns(msg), late=late) if tick else []

    def step(self, stamp: Optional[int] = None, late: bool = False) -> List[Act]:
        record = self.session.tick(stamp or 0, late=late)
        return [Act.of_record(record)] if record is not None else []

    def settle(self) -> List[Act]:
        return []

    def missing_inputs(self) -> List[str]:
        """Ports that have not received a value yet (a step waits for all of them)."""
        return self.session.inputs.missing()

    # -- capsule verbs: each returns what the replay maps to the recording ------------------------
    def commit(self, label: str) -> str:
        return self.session.commit(label).id

    def interrupt(self, mode: HoldMode, commit: bool) -> Tuple[str, List[Act]]:
        """Interrupt, and the safe action the node publishes with it."""
        capsule = self.session.interrupt(mode, commit)
        record = self.session.safe_record(self.session.hold_mode)
        return (capsule.id if capsule else ""), ([Act.of_record(record)] if record is not None else [])

    def reenter(self, capsule_id: str) -> Optional[int]:
        if self.ablation and capsule_id:
            self._reenter_ablated(capsule_id)
        else:
            self.session.reenter(capsule_id)
        return self.session.episode_id

    def reset(self, capsule_id: str) -> int:
        return self.session.reset(capsule_id)[0]

    def fork(self, capsule_id: str, label: str) -> str:
        return self.session.fork(capsule_id, label).id

    def drop(self, capsule_id: str) -> None:
        self.session.drop(capsule_id)

    def has(self, capsule_id: str) -> bool:
        return capsule_id in self.session.store

    def adopt(self, capsule_id: str) -> None:
        """Load a capsule file into memory (verified, same fingerprint and schema)."""
        session = self.session
        if self.files is None:
            raise NotFound(f"no capsule file {capsule_id}.capsule: no capsule directory (use --capsule-dir)")
        capsule, data = self.files.load(capsule_id, expected_fingerprint=session.store.fingerprint,
                                        expected_schema=session.runtime.layout.schema())
        with session.at_boundary():
            session.store.adopt(capsule, data)

    def close(self) -> None:
        pass

    def _reenter_ablated(self, capsule_id: str) -> None:
        """Re-enter, then put back every buffer kind but the ablated ones from the state
        before: only the ablated kinds end up restored."""
        session, store, runtime = self.session, self.session.store, self.session.runtime
        with session.at_boundary():
            live = store.snapshot(runtime, label="ablation: live state", episode_id=session.episode_id,
                                  step=session.step, held=True)
        try:
            session.reenter(capsule_id)
            with session.at_boundary():
                for kinds in complement_runs(self.ablation):
                    store.restore(live.id, runtime, kinds=kinds)
        finally:
            with session.at_boundary():
                store.drop(live.id)
