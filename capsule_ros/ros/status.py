"""~/status (RuntimeStatus) and /diagnostics from the session's counters."""
from __future__ import annotations

from typing import Dict, Tuple

from capsule_ros.msg import PortStatus, RuntimeStatus
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

from capsule_ros.capsules.store import Tier
from capsule_ros.serving.ports import PortAdapter
from capsule_ros.serving.session import PolicySession


def runtime_status(session: PolicySession, adapters: Dict[str, PortAdapter], stamp) -> RuntimeStatus:
    store, counters = session.store, session.store.counters
    session.store.flush_timings()
    step_p = session.step_latency.percentiles_ms(50, 95, 99)
    restore_p = store.restore_latency.percentiles_ms(50, 95, 99)
    restores = max(counters.restores, 1)
    msg = RuntimeStatus(
        episode_state=int(session.state), episode_id=int(session.episode_id), step=int(session.step),
        lineage=session.lineage, device=str(session.runtime.device), fingerprint=session.runtime.fingerprint,
        graph_captured=session.runtime.plan.captured, steps_run=session.counters.steps,
        step_p50_ms=step_p[50], step_p95_ms=step_p[95], step_p99_ms=step_p[99],
        restore_p50_ms=restore_p[50], restore_p95_ms=restore_p[95], restore_p99_ms=restore_p[99],
        capsules_device=store.count(Tier.DEVICE), capsules_host=store.count(Tier.HOST),
        capsules_disk=store.count(Tier.DISK),
        hits_device=counters.hits[Tier.DEVICE], hits_host=counters.hits[Tier.HOST], hits_disk=counters.hits[Tier.DISK],
        misses=counters.misses,
        hit_rate_device=counters.hits[Tier.DEVICE] / restores if counters.restores else 0.0,
        hit_rate_host=counters.hits[Tier.HOST] / restores if counters.restores else 0.0,
        hit_rate_disk=counters.hits[Tier.DISK] / restores if counters.restores else 0.0,
        invalidations=counters.invalidations, evictions=counters.evictions, demotions=counters.demotions,
        fallback_recomputes=session.counters.fallback_recomputes,
        dropped_inputs=sum(a.counters.dropped_total for a in adapters.values()),
        deadline_misses=session.counters.deadline_misses,
        ports=[port_status(a) for a in adapters.values()])
    msg.header.stamp = stamp
    return msg


def port_status(adapter: PortAdapter) -> PortStatus:
    c = adapter.counters
    return PortStatus(name=adapter.name, topic=adapter.config.topic, received=c.received,
                      dropped_shape=c.dropped["shape"], dropped_type=c.dropped["type"],
                      dropped_nonfinite=c.dropped["nonfinite"], dropped_out_of_order=c.dropped["out_of_order"],
                      stale_steps=c.stale_steps, age_ms=adapter.age_ms())


class DiagnosticsBuilder:
    """DiagnosticArray with a level that reflects what changed since the last report:
    ERROR on new deadline misses, WARN on new dropped inputs, stale ports or BUSY waits."""

    def __init__(self, node_name: str):
        self.node_name = node_name
        self._last: Tuple[int, int, int] = (0, 0, 0)

    def build(self, status: RuntimeStatus, stamp) -> DiagnosticArray:
        stale = sum(p.stale_steps for p in status.ports)
        now = (status.deadline_misses, status.dropped_inputs, stale)
        misses, drops, stales = (a - b for a, b in zip(now, self._last))
        self._last = now
        if misses:
            level, text = DiagnosticStatus.ERROR, f"{misses} deadline miss(es) since the last report"
        elif drops or stales:
            level, text = DiagnosticStatus.WARN, f"{drops} dropped input(s), {stales} stale step(s) since the last report"
        else:
            level, text = DiagnosticStatus.OK, "ok"
        state = ("IDLE", "RUNNING", "INTERRUPTED")[status.episode_state]
        values = {
            "episode_state": state, "episode_id": status.episode_id, "step": status.step,
            "lineage": status.lineage, "device": status.device, "graph_captured": status.graph_captured,
            "step_p50_ms": f"{status.step_p50_ms:.3f}", "step_p95_ms": f"{status.step_p95_ms:.3f}",
            "step_p99_ms": f"{status.step_p99_ms:.3f}", "restore_p50_ms": f"{status.restore_p50_ms:.3f}",
            "restore_p95_ms": f"{status.restore_p95_ms:.3f}", "restore_p99_ms": f"{status.restore_p99_ms:.3f}",
            "hits_device": status.hits_device, "hits_host": status.hits_host, "hits_disk": status.hits_disk,
            "misses": status.misses, "invalidations": status.invalidations, "evictions": status.evictions,
            "demotions": status.demotions, "fallback_recomputes": status.fallback_recomputes,
            "dropped_inputs": status.dropped_inputs, "deadline_misses": status.deadline_misses,
        }
        for p in status.ports:
            values[f"port.{p.name}.received"] = p.received
            values[f"port.{p.name}.dropped"] = (f"shape={p.dropped_shape} type={p.dropped_type} "
                                                f"nonfinite={p.dropped_nonfinite} out_of_order={p.dropped_out_of_order}")
            values[f"port.{p.name}.stale_steps"] = p.stale_steps
            values[f"port.{p.name}.age_ms"] = f"{p.age_ms:.1f}"
        diag = DiagnosticStatus(level=level, name=f"{self.node_name}: policy runtime", message=text,
                                hardware_id=status.device,
                                values=[KeyValue(key=k, value=str(v)) for k, v in values.items()])
        array = DiagnosticArray(status=[diag])
        array.header.stamp = stamp
        return array
