"""Comparing replayed actions with recorded ones, and the verdict of a replay.

Actions are compared as the node publishes them (``capsule_ros/msg/Action``: float32
values and chunk), bit for bit, together with their source, step, episode and lineage;
recorded episode ids and capsule ids are mapped to the replay's own.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

from capsule_ros.serving.records import ActionSource


@dataclass(frozen=True)
class Act:
    """One action in the form both sides share."""

    source: int
    step: int
    episode: int
    lineage: str
    values: np.ndarray          # float32 [action_dim]
    chunk: np.ndarray           # float32 [chunk_horizon * action_dim], empty for safe actions

    @classmethod
    def of_record(cls, record) -> Act:
        """From a session ``ActionRecord``, converted exactly as ``action_message`` does."""
        chunk = np.zeros(0, np.float32) if record.chunk is None else \
            np.asarray(record.chunk).astype(np.float32).ravel()
        return cls(int(record.source), int(record.step), int(record.episode_id), record.lineage,
                   np.asarray(record.values).astype(np.float32).ravel(), chunk)

    @classmethod
    def of_msg(cls, msg: Any) -> Act:
        """From an Action message (rosbags dataclass or rclpy message)."""
        return cls(int(msg.source), int(msg.step), int(msg.episode_id), str(msg.lineage),
                   np.asarray(msg.values, dtype=np.float32).ravel(), np.asarray(msg.chunk, dtype=np.float32).ravel())

    def brief(self) -> str:
        values = ", ".join(f"{v:.6g}" for v in self.values[:4])
        return f"{ActionSource(self.source).name} step {self.step} ep {self.episode} [{values}]"


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def differences(recorded: Act, replayed: Act, episode: Optional[int], lineage: Optional[str]) -> List[str]:
    """Names of the fields that differ (``episode`` / ``lineage``: the replay's expected
    values, None when unknown)."""
    out = []
    if recorded.source != replayed.source:
        out.append("source")
    if recorded.step != replayed.step:
        out.append("step")
    if episode is not None and replayed.episode != episode:
        out.append("episode")
    if lineage is not None and replayed.lineage != lineage:
        out.append("lineage")
    if recorded.values.tobytes() != replayed.values.tobytes():
        out.append("values")
    if recorded.chunk.tobytes() != replayed.chunk.tobytes():
        out.append("chunk")
    return out


@dataclass
class Divergence:
    """The first place the replay did not reproduce the recording."""

    what: str                   # fields that differ, or missing / extra / event
    step: int                   # recorded step (the state's step after the divergent action)
    episode: int
    bag_index: int              # message position in the bag
    time_ns: int
    port: str = ""              # the sensor message that preceded the divergent step
    inputs: List[str] = field(default_factory=list)   # ports with messages since the previous step
    max_abs_diff: Optional[float] = None
    recorded: str = ""
    replayed: str = ""
    detail: str = ""


@dataclass
class Verdict:
    """What a replay found; ``exit_code`` follows the CLI contract (0 match, 1 divergence)."""

    bag: str
    storage: str
    target: str
    mode: str
    start: str = "bag start"    # where verification began (initial state, capsule, reset): the scope's start
    steps_compared: int = 0
    steps_matched: int = 0
    steps_diverged: int = 0
    steps_before_anchor: int = 0  # recorded actions before the first anchor (out of scope)
    steps_skipped: int = 0      # in scope but not compared (anchor lost; a deadline miss through a node)
    steps_unrecorded: int = 0   # replayed steps whose action the recording stopped before
    deadline_misses: int = 0    # recorded safe actions of late or failed steps
    events_replayed: Dict[str, int] = field(default_factory=dict)
    events_skipped: Dict[str, int] = field(default_factory=dict)
    messages: int = 0
    first_divergence: Optional[Divergence] = None
    fingerprint_recorded: str = ""
    fingerprint_replay: str = ""
    versions_recorded: Dict[str, str] = field(default_factory=dict)
    numerics_recorded: str = ""  # CPU numerics level of the recording ('' = not recorded)
    numerics_replay: str = ""    # the level the replay ran at
    topics_ignored: List[str] = field(default_factory=list)   # bag topics neither fed nor checked
    notes: List[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def identical(self) -> bool:
        """Every compared action matched (and there was one); see ``complete`` for scope."""
        return self.first_divergence is None and self.steps_compared > 0

    @property
    def complete(self) -> bool:
        """Every recorded action in scope was compared."""
        return self.steps_skipped == 0

    def exit_code(self, allow_partial: bool = False) -> int:
        """0 identical (and complete, unless ``allow_partial``), 1 a divergence, 3 partial, 2 nothing compared."""
        if self.first_divergence is not None:
            return 1
        if self.steps_compared == 0:
            return 2
        return 0 if self.complete or allow_partial else 3

    def to_json(self) -> str:
        out = asdict(self)
        out["identical"] = self.identical
        out["complete"] = self.complete
        return json.dumps(out, indent=2, sort_keys=True)

    def render(self, console) -> None:
        """A rich table on ``console``."""
        from rich.table import Table
        if self.first_divergence is not None:
            title = "[bold red]DIVERGED[/]"
        elif self.steps_compared == 0:
            title = "[bold yellow]NOTHING VERIFIED[/]"
        elif not self.complete:
            title = (f"[bold yellow]PARTIALLY VERIFIED[/] ({self.steps_compared} compared, bit-identical; "
                     f"{self.steps_skipped} skipped)")
        else:
            title = "[bold green]BIT-IDENTICAL[/]"
        if self.topics_ignored:
            title += f" [yellow]({len(self.topics_ignored)} topic(s) of the bag not replayed: listed below)[/]"
        table = Table(title=f"capsule-ros replay: {title}", show_header=False, title_justify="left")
        table.add_column("what", style="bold")
        table.add_column("value")
        rows = [
            ("bag", f"{self.bag} ({self.storage}, {self.messages} messages)"),
            ("replayed", f"{self.target}, {self.mode} mode, from {self.start}"),
            ("steps compared", f"{self.steps_compared} ({self.steps_matched} bit-identical, "
                               f"{self.steps_diverged} diverged)"),
            ("steps skipped", f"{self.steps_skipped} (in scope, not compared)"),
            ("before the anchor", f"{self.steps_before_anchor} (out of scope)"),
            ("capsule events replayed", _counts(self.events_replayed)),
        ]
        if self.events_skipped:
            rows.append(("capsule events skipped", _counts(self.events_skipped)))
        if self.deadline_misses:
            rows.append(("recorded deadline misses", f"{self.deadline_misses} (safe actions of late or failed steps)"))
        if self.steps_unrecorded:
            rows.append(("recording ended", f"before the action of {self.steps_unrecorded} input(s)"))
        for topic in self.topics_ignored:           # neither fed to the policy nor compared
            rows.append(("[yellow]topic ignored[/]", topic))
        if self.numerics_replay:
            rows.append(("numerics", f"{self.numerics_replay} " + (
                "(as recorded)" if self.numerics_recorded == self.numerics_replay else
                f"[yellow](recorded {self.numerics_recorded or 'without a level'})[/]")))
        same = self.fingerprint_recorded == self.fingerprint_replay
        rows.append(("graph fingerprint", f"{self.fingerprint_replay[:12]} "
                     + ("(as recorded)" if same else f"[yellow](recorded {self.fingerprint_recorded[:12] or '?'})[/]")))
        d = self.first_divergence
        if d is not None:
            rows += [("first divergence", f"[red]step {d.step}[/] (episode {d.episode}), {d.what}"),
                     ("  at", f"bag message #{d.bag_index} (log time {d.time_ns} ns)"),
                     ("  port", f"{d.port or '-'}" + (f" (inputs since the previous step: {', '.join(d.inputs)})"
                                                      if d.inputs else "")),
                     ("  largest |difference|", "-" if d.max_abs_diff is None else f"{d.max_abs_diff:.6g}"),
                     ("  recorded", d.recorded or "-"), ("  replayed", d.replayed or "-")]
            if d.detail:
                rows.append(("  detail", d.detail))
        for note in self.notes:
            rows.append(("note", note))
        rows.append(("time", f"{self.seconds:.2f} s"))
        for row in rows:
            table.add_row(*row)
        console.print(table)


def _counts(counts: Dict[str, int]) -> str:
    total = sum(counts.values())
    return f"{total}" + (f" ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})" if counts else "")
