"""~/status (RuntimeStatus) and /diagnostics, built from one ``SessionStatus`` only (a
picture the session takes between steps): the node adds what is its own (its lifecycle
state, the actions it published, the stamp). ``test_session_parts.py`` holds it to that."""
from __future__ import annotations

from typing import Any, Tuple

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

from capsule_ros.capsules.store import Tier
from capsule_ros.capsules.validity import UNSPLIT
from capsule_ros.msg import PortStatus, RuntimeStatus
from capsule_ros.serving.records import EpisodeState, PortPicture, SessionStatus

# The stale_<cause> fields of RuntimeStatus, one per cause an invalidation can have.
STALE_CAUSES = ("weights", "architecture", "layout", "ports", "kernel", "build", UNSPLIT)


def runtime_status(s: SessionStatus, stamp: Any) -> RuntimeStatus:
    """The status message of a picture (``PolicySession.status``)."""
    restores = s.restores
    msg = RuntimeStatus(
        episode_state=int(s.state), episode_id=int(s.episode_id), step=int(s.step),
        lineage=s.lineage, device=s.device, fingerprint=s.fingerprint,
        graph_captured=s.graph_captured, steps_run=s.counters.steps,
        step_p50_ms=s.step_ms[50], step_p95_ms=s.step_ms[95], step_p99_ms=s.step_ms[99],
        restore_p50_ms=s.restore_ms[50], restore_p95_ms=s.restore_ms[95], restore_p99_ms=s.restore_ms[99],
        capsules_device=s.capsules[Tier.DEVICE], capsules_host=s.capsules[Tier.HOST],
        capsules_disk=s.capsules[Tier.DISK],
        hits_device=s.hits[Tier.DEVICE], hits_host=s.hits[Tier.HOST], hits_disk=s.hits[Tier.DISK],
        misses=s.misses,
        hit_rate_device=s.hits[Tier.DEVICE] / restores if restores else 0.0,
        hit_rate_host=s.hits[Tier.HOST] / restores if restores else 0.0,
        hit_rate_disk=s.hits[Tier.DISK] / restores if restores else 0.0,
        invalidations=s.invalidations, evictions=s.evictions, demotions=s.demotions,
        fallback_recomputes=s.counters.fallback_recomputes,
        dropped_inputs=sum(p.dropped_total for p in s.ports),
        deadline_misses=s.counters.deadline_misses, step_errors=s.counters.step_errors,
        nonfinite_steps=s.counters.nonfinite_steps, last_fault=s.counters.last_fault,
        late_refills=s.counters.late_refills, ports=[port_status(p) for p in s.ports],
        clock_jumps=s.counters.clock_jumps, last_clock_jump_s=s.counters.last_clock_jump_ns / 1e9)
    stale = s.stale
    msg.stale_capsules, msg.stale_regenerable = stale.stale, stale.regenerable
    for cause in STALE_CAUSES:
        setattr(msg, f"stale_{cause}", stale.by_cause.get(cause, 0))
    msg.regenerated, msg.regeneration_failed, msg.regeneration_left = stale.regenerated, stale.failed, stale.left
    msg.recipes_regenerable, msg.recipe_bytes = stale.files_regenerable, stale.recipe_bytes
    chunking = s.chunking
    if chunking is not None:
        msg.chunking, msg.inference_delay_steps = chunking.mode, chunking.delay
        msg.execution_horizon, msg.chunk_refills = chunking.horizon, chunking.refills
    msg.header.stamp = stamp
    return msg


def port_status(port: PortPicture) -> PortStatus:
    d = port.dropped
    return PortStatus(name=port.name, topic=port.topic, received=port.received, dropped_shape=d["shape"],
                      dropped_type=d["type"], dropped_nonfinite=d["nonfinite"], dropped_out_of_order=d["out_of_order"],
                      dropped_future=d["future"], stale_steps=port.stale_steps, age_ms=port.age_ms)


class DiagnosticsBuilder:
    """DiagnosticArray with a level that reflects what changed since the last report:
    ERROR on new deadline misses or failed / non-finite steps, WARN on new dropped inputs,
    stale ports or jumps of the node's clock."""

    def __init__(self, node_name: str):
        self.node_name = node_name
        self._last: Tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)

    def build(self, status: RuntimeStatus, stamp: Any) -> DiagnosticArray:
        stale = sum(p.stale_steps for p in status.ports)
        now = (status.deadline_misses, status.step_errors + status.nonfinite_steps, status.dropped_inputs, stale,
               status.clock_jumps)
        misses, faults, drops, stales, jumps = (a - b for a, b in zip(now, self._last, strict=True))
        self._last = now
        if faults:
            level, text = DiagnosticStatus.ERROR, f"{faults} failed or non-finite step(s) since the last report: " \
                                                  f"{status.last_fault}"
        elif misses:
            level, text = DiagnosticStatus.ERROR, f"{misses} deadline miss(es) since the last report"
        elif drops or stales:
            level = DiagnosticStatus.WARN
            text = f"{drops} dropped input(s), {stales} stale step(s) since the last report"
        elif jumps:
            level = DiagnosticStatus.WARN
            text = f"the clock jumped {jumps} time(s) since the last report (last {status.last_clock_jump_s:+.3f} s)"
        else:
            level, text = DiagnosticStatus.OK, "ok"
        values = {
            "episode_state": EpisodeState(status.episode_state).name, "episode_id": status.episode_id,
            "step": status.step, "lineage": status.lineage, "device": status.device,
            "graph_captured": status.graph_captured,
            "step_p50_ms": f"{status.step_p50_ms:.3f}", "step_p95_ms": f"{status.step_p95_ms:.3f}",
            "step_p99_ms": f"{status.step_p99_ms:.3f}", "restore_p50_ms": f"{status.restore_p50_ms:.3f}",
            "restore_p95_ms": f"{status.restore_p95_ms:.3f}", "restore_p99_ms": f"{status.restore_p99_ms:.3f}",
            "hits_device": status.hits_device, "hits_host": status.hits_host, "hits_disk": status.hits_disk,
            "misses": status.misses, "invalidations": status.invalidations, "evictions": status.evictions,
            "demotions": status.demotions, "fallback_recomputes": status.fallback_recomputes,
            "dropped_inputs": status.dropped_inputs, "deadline_misses": status.deadline_misses,
            "step_errors": status.step_errors, "nonfinite_steps": status.nonfinite_steps,
            "last_fault": status.last_fault, "clock_jumps": status.clock_jumps,
            "last_clock_jump_s": f"{status.last_clock_jump_s:.3f}",
        }
        values.update(recipes_regenerable=status.recipes_regenerable, recipe_bytes=status.recipe_bytes)
        if status.stale_capsules:
            values["stale_capsules"] = status.stale_capsules
            values.update({f"stale_{cause}": getattr(status, f"stale_{cause}") for cause in STALE_CAUSES
                           if getattr(status, f"stale_{cause}")})
            values.update(stale_regenerable=status.stale_regenerable, regenerated=status.regenerated,
                          regeneration_failed=status.regeneration_failed,
                          regeneration_left=status.regeneration_left)
        if status.chunking:
            values.update(chunking=status.chunking, inference_delay_steps=status.inference_delay_steps,
                          execution_horizon=status.execution_horizon, chunk_refills=status.chunk_refills,
                          late_refills=status.late_refills)
        for p in status.ports:
            values[f"port.{p.name}.received"] = p.received
            values[f"port.{p.name}.dropped"] = (f"shape={p.dropped_shape} type={p.dropped_type} "
                                                f"nonfinite={p.dropped_nonfinite} "
                                                f"out_of_order={p.dropped_out_of_order} "
                                                f"future={p.dropped_future}")
            values[f"port.{p.name}.stale_steps"] = p.stale_steps
            values[f"port.{p.name}.age_ms"] = f"{p.age_ms:.1f}"
        diag = DiagnosticStatus(level=level, name=f"{self.node_name}: policy runtime", message=text,
                                hardware_id=status.device,
                                values=[KeyValue(key=k, value=str(v)) for k, v in values.items()])
        array = DiagnosticArray(status=[diag])
        array.header.stamp = stamp
        return array
