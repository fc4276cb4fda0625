"""report.png of `capsule-ros demo`: trajectories, the capsule timeline, latencies."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any, List, Mapping

import numpy as np

from capsule_ros.files import write_file

COLORS = {"original": "#1f77b4", "rolled_back": "#ff7f0e", "branch": "#2ca02c"}
LABELS = {"original": "original (interrupt, hold, re-enter)", "rolled_back": "rolled back to the start capsule",
          "branch": "fork: mirrored goal"}


def write_report(path: Path, segments: Mapping[str, Any], plan: dict, summary: dict,
                 round_trips_ms: List[float]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(16, 6.2), constrained_layout=True)
    grid = fig.add_gridspec(1, 3, width_ratios=[1.0, 1.25, 1.1])
    ax_ws, ax_tl, ax_lat = fig.add_subplot(grid[0]), fig.add_subplot(grid[1]), fig.add_subplot(grid[2])

    # 1. workspace: end-effector paths overlaid
    circle = np.linspace(0, 2 * np.pi, 200)
    for radius in (0.25, 0.8):
        ax_ws.plot(radius * np.cos(circle), radius * np.sin(circle), color="0.85", lw=1)
    ax_ws.plot([0], [0], "ks", ms=6, label="arm base")
    styles = {"original": "-", "rolled_back": "--", "branch": ":"}
    for name in ("original", "rolled_back", "branch"):
        seg = segments.get(name)
        if seg is not None and seg.path:
            xy = np.asarray(seg.path)
            ax_ws.plot(xy[:, 0], xy[:, 1], styles[name], color=COLORS[name], lw=2.2 if name != "original" else 3.5,
                       alpha=0.9, label=LABELS[name])
    if plan:
        ax_ws.plot(*plan["goal"], "*", color="crimson", ms=16, label="goal")
        ax_ws.plot(*plan["branch_goal"], "*", color=COLORS["branch"], ms=16, label="branch goal")
        original = segments.get("original")
        if original is not None and len(original.path) > plan["interrupt_at"]:
            ax_ws.plot(*original.path[plan["interrupt_at"] - 1], "o", mfc="none", mec="k", ms=12, mew=2,
                       label="interrupt")
    ax_ws.set_aspect("equal")
    ax_ws.set_title("episode 1: end-effector paths")
    ax_ws.set_xlabel("x [m]")
    ax_ws.set_ylabel("y [m]")
    ax_ws.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)

    # 2. timeline: distance to the goal per step, with the capsule events
    for name in ("original", "rolled_back", "branch"):
        seg = segments.get(name)
        if seg is None or not seg.path or not plan:
            continue
        goal = np.asarray(plan["branch_goal"] if name == "branch" else plan["goal"])
        dist = np.linalg.norm(np.asarray(seg.path) - goal, axis=1)
        ax_tl.plot(np.arange(1, len(dist) + 1), dist, styles[name], color=COLORS[name], lw=2, label=LABELS[name])
    if plan:
        ax_tl.axvline(0, color="k", lw=1)
        ax_tl.text(0.5, 0.97, "commit\n(start capsule)", transform=ax_tl.get_xaxis_transform(), fontsize=7, va="top")
        i, h = plan["interrupt_at"], plan["hold_ticks"]
        ax_tl.axvspan(i, i + h, color="0.85")
        ax_tl.text(i + 0.5, 0.75, "interrupt\n+ hold\n-> re-enter", transform=ax_tl.get_xaxis_transform(), fontsize=7)
    ident = summary.get("identical_after_rollback")
    ax_tl.set_title(f"rollback replay: {'bit-identical' if ident else 'DIFFERENT'} over "
                    f"{summary.get('compared_steps', 0)} steps")
    ax_tl.set_xlabel("step since the start capsule")
    ax_tl.set_ylabel("distance to goal [m]")
    ax_tl.legend(fontsize=7)

    # 3. latency
    if round_trips_ms:
        hi = float(np.percentile(round_trips_ms, 99.5)) * 1.2
        shown = [v for v in round_trips_ms if v <= hi]
        ax_lat.hist(shown, bins=40, color="#9467bd", alpha=0.8)
        if len(shown) < len(round_trips_ms):
            ax_lat.text(0.98, 0.55, f"{len(round_trips_ms) - len(shown)} step(s) > {hi:.1f} ms not shown",
                        transform=ax_lat.transAxes, ha="right", fontsize=7)
    ax_lat.set_xlabel("joint state -> action through ROS 2 [ms]")
    ax_lat.set_ylabel("steps")
    text = [f"episodes: {summary.get('episodes')}   success rate: {summary.get('success_rate', 0):.2f}"]
    if summary.get("step_p50_ms") is not None:
        text.append(f"policy step p50 / p99: {summary['step_p50_ms']:.2f} / {summary['step_p99_ms']:.2f} ms")
        text.append(f"capsule restore p50 / p99: {summary['restore_p50_us']:.0f} / {summary['restore_p99_us']:.0f} us")
    if round_trips_ms:
        text.append(f"round trip p50 / p99: {np.percentile(round_trips_ms, 50):.2f} / "
                    f"{np.percentile(round_trips_ms, 99):.2f} ms")
    ax_lat.text(0.98, 0.97, "\n".join(text), transform=ax_lat.transAxes, ha="right", va="top", fontsize=8,
                bbox=dict(boxstyle="round", fc="white", ec="0.7"))
    ax_lat.set_title("latency")
    fig.suptitle("capsule_ros demo: commit, interrupt, re-enter, roll back, fork on the simulated arm")
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    write_file(path, image.getvalue())
