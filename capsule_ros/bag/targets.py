"""What a replay drives: the ``ReplayTarget`` protocol, and the in-process target.

A target offers the replay engine (``capsule_ros.bag.replay``) what a node offers: feed
a sensor message (and step when it is a trigger), step, and the verbs of the recorded
capsule events, one method per replayed verb of ``capsule_ros.serving.verbs``, named
after it. Two targets implement it: ``InProcessTarget`` here (a ``PolicySession`` built
from the recorded config), and ``capsule_ros.ros.replay_target.NodeTarget`` (a
``policy_node`` process driven through ROS; the bag layer itself needs no ROS).

Replays never write to a capsule directory: capsules the bag does not commit itself
(``--from-capsule``, a re-entry of a capsule saved before the recording) are read through
a read-only ``CapsuleDirectory``, which neither creates, changes nor recovers anything.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

from capsule_ros.bag.verdict import Act
from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.errors import NotFound
from capsule_ros.runtime.schema import BufferKind
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.options import SessionOptions
from capsule_ros.serving.records import ActionRecord, EventKind, EventRecord, HoldMode

if TYPE_CHECKING:
    from capsule_ros.serving.session import PolicySession


@runtime_checkable
class ReplayTarget(Protocol):
    """What the replay engine drives (see the module docstring). Capsule ids in and out
    are the target's own; the engine maps the recording's ids to them."""

    kind: str                             # the verdict's name for it
    reenacts_deadline_misses: bool        # step / feed with late=True hand out a recorded miss's safe action
    stages_without_stepping: bool         # feed(tick=False) stages a trigger message without a step
    directory: Optional[CapsuleDirectory]  # a read-only capsule directory: files the bag did not make, if any

    @property
    def fingerprint(self) -> str:
        """The graph fingerprint of the target's runtime."""

    # -- the message stream ---------------------------------------------------------------------
    def feed(self, port: str, raw: bytes, msg: Any, tick: bool, expect: bool = False,
             log_ns: Optional[int] = None, late: bool = False) -> List[Act]:
        """A recorded sensor message (``raw`` CDR and decoded ``msg``, None if undecodable)
        at log time ``log_ns``; a step if ``tick`` (``expect``: the recording has an action
        for it; ``late``: the recording says that step missed its deadline). The actions
        that came of it."""

    def step(self, stamp: Optional[int] = None, late: bool = False, log_ns: Optional[int] = None) -> List[Act]:
        """One step where a timer-mode recording acted (at log time ``log_ns``)."""

    def settle(self) -> List[Act]:
        """Before a new anchor: every message processed, what arrived meanwhile (discarded)."""

    def missing_inputs(self) -> List[str]:
        """Ports that have not received a value yet."""

    def clock_jump(self, delta_ns: int, log_ns: Optional[int] = None) -> bool:
        """The recorded node's clock jumped by ``delta_ns`` at log time ``log_ns`` (a CLOCK_JUMP
        event): re-enact it; False when the target cannot (its clock is its own)."""

    # -- the replayed verbs (capsule_ros.serving.verbs, replayed=True) ----------------------------
    def commit(self, label: str) -> str:
        """The new capsule's id."""

    def reset(self, capsule_id: str) -> int:
        """The new episode's id."""

    def interrupt(self, hold_mode: HoldMode, commit: bool) -> Tuple[str, List[Act]]:
        """The boundary capsule's id ("" without ``commit``) and the safe action published with it."""

    def reenter(self, capsule_id: str) -> Optional[int]:
        """The episode the state now belongs to (None when unknown: resuming an interrupt)."""

    def fork(self, capsule_id: str, label: str) -> str:
        """The new capsule's id."""

    def drop(self, capsule_id: str) -> None:
        """Forget a capsule from memory."""

    def load(self, capsule_id: str) -> None:
        """Read a capsule file of ``directory`` into memory (verified, same fingerprint)."""

    # -- queries and lifetime ---------------------------------------------------------------------
    def has(self, capsule_id: str) -> bool:
        """Whether the capsule is in the target's memory."""

    def close(self) -> None:
        """Stop the target (idempotent)."""

    def __enter__(self) -> ReplayTarget:
        ...

    def __exit__(self, *exc: object) -> None:
        ...


class InProcessTarget:
    """A PolicySession built from the recorded config, in this process. Its clock is the
    recording's log time, less the jumps of the node's clock the recording went on across
    (``clock_jump``: log times never go back), so the session counts what the node counted
    (dropped and stale inputs) where the node counted it."""

    kind = "in-process"
    reenacts_deadline_misses = True       # tick(late=True): the session hands out its safe action
    stages_without_stepping = True        # feed(tick=False) stages a trigger message without a step

    def __init__(self, config: ServingConfig, directory: Optional[CapsuleDirectory],
                 ablation: Sequence[BufferKind] = ()):
        self._now = 0                              # the log time of the message being replayed
        self._jumped_ns = 0                        # minus the node's clock jumps so far (NodeRecording)
        self._interrupt_action: Optional[ActionRecord] = None     # the last INTERRUPT's safe action
        # the replay's own capsule directory is the read-only one it was given: it never writes a file
        config = dataclasses.replace(config, capsules=dataclasses.replace(config.capsules, directory=""))
        # deadlines not enforced: verify the function, not this machine's timing; no warnings:
        # the verdict reports what the replay saw
        options = SessionOptions(clock_ns=self._clock_ns, enforce_deadline=False, warnings=False,
                                 on_event=self._on_event)
        self.session = self._build(config, directory, options)
        self.directory = directory
        self.ablation = tuple(ablation)

    def _build(self, config: ServingConfig, directory: Optional[CapsuleDirectory],
               options: SessionOptions) -> PolicySession:
        """The session the replay drives (a fleet robot's target serves it from a fleet)."""
        from capsule_ros.serving.factory import build_session
        return build_session(config, directory=directory, options=options)

    def __enter__(self) -> InProcessTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def fingerprint(self) -> str:
        return self.session.status().fingerprint

    def feed(self, port: str, raw: bytes, msg: Any, tick: bool, expect: bool = False,
             log_ns: Optional[int] = None, late: bool = False) -> List[Act]:
        """A sensor message through the session's port, as the node takes one (an
        undecodable one is counted and dropped), at the recording's log time: when the
        node received it."""
        self._at(log_ns)
        adapter = self.session.parts.loop.ports.get(port)
        fed = self.session.loop.feed(port, raw if adapter is not None and adapter.takes_raw else msg,
                                     stage_only=not tick, late=late)
        return _acts(fed.record)

    def step(self, stamp: Optional[int] = None, late: bool = False, log_ns: Optional[int] = None) -> List[Act]:
        self._at(log_ns)
        return _acts(self.session.loop.tick(stamp or 0, late=late))

    def settle(self) -> List[Act]:
        return []

    def missing_inputs(self) -> List[str]:
        """Ports that have not received a value yet (a step waits for all of them)."""
        return self.session.loop.missing_inputs()

    def clock_jump(self, delta_ns: int, log_ns: Optional[int] = None) -> bool:
        """The session's clock jumps as the node's did, where the node's did."""
        self._at(log_ns)
        self._jumped_ns -= delta_ns
        self.session.loop.clock_jumped(delta_ns)
        return True

    # -- the replayed verbs: each returns what the replay maps to the recording ---------------------
    def commit(self, label: str) -> str:
        return self.session.verbs.commit(label).id

    def reset(self, capsule_id: str) -> int:
        return self.session.verbs.reset(capsule_id).episode_id

    def interrupt(self, hold_mode: HoldMode, commit: bool) -> Tuple[str, List[Act]]:
        """Interrupt, and the safe action the node publishes with it."""
        self._interrupt_action = None
        capsule = self.session.verbs.interrupt(hold_mode, commit)
        return (capsule.id if capsule else ""), _acts(self._interrupt_action)

    def reenter(self, capsule_id: str) -> Optional[int]:
        self.session.verbs.reenter(capsule_id, only=self.ablation if capsule_id else ())
        return self.session.episode.episode_id

    def fork(self, capsule_id: str, label: str) -> str:
        return self.session.verbs.fork(capsule_id, label).id

    def drop(self, capsule_id: str) -> None:
        self.session.verbs.drop(capsule_id)

    def load(self, capsule_id: str) -> None:
        if self.directory is None:
            raise NotFound(f"no capsule file {capsule_id}.capsule: no capsule directory (use --capsule-dir)")
        self.session.verbs.load(capsule_id)

    def has(self, capsule_id: str) -> bool:
        return capsule_id in self.session.parts.store

    def close(self) -> None:
        pass

    def _clock_ns(self) -> int:
        return self._now - self._jumped_ns

    def _on_event(self, event: EventRecord) -> None:
        if event.kind == EventKind.INTERRUPT:
            self._interrupt_action = event.action

    def _at(self, log_ns: Optional[int]) -> None:
        if log_ns is not None:
            self._now = log_ns


def _acts(record: Optional[ActionRecord]) -> List[Act]:
    return [Act.of_record(record)] if record is not None else []
