"""Timing and reporting helpers shared by the benchmarks."""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Union

import numpy as np
import torch

from capsule_ros.paths import share_file
from capsule_ros.runtime.arena import ArenaLayout, StateArena


def config_path(name: str) -> Path:
    """A file of the package's config/ (installed share/ first, then the source tree)."""
    return share_file("config", name)


def child_pythonpath(python: Path) -> str:
    """PYTHONPATH of a child running the repository's tools under ``python``: the repository,
    and this process's own path too where the child is this interpreter (LeRobot installed
    beside capsule_ros, as on the GPU machine); another environment gets the repository only."""
    repo = str(Path(__file__).resolve().parents[2])
    inherited = os.environ.get("PYTHONPATH", "") if Path(python) == Path(sys.executable) else ""
    return os.pathsep.join(p for p in (repo, inherited) if p)


def resolve_device(name: str) -> torch.device:
    """The benchmark device. On a CPU, torch runs single-threaded as the node does
    (runtime.cpu_threads: 1): an intra-op thread pool turns every small copy into a
    wake-up of the other cores, which costs milliseconds on a busy machine."""
    device = torch.device("cuda" if name == "auto" and torch.cuda.is_available() else
                          "cpu" if name == "auto" else name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: no CUDA device available")
    if device.type == "cpu":
        torch.set_num_threads(1)
    return device


def time_calls(fn: Callable[[], object], reps: int, device: torch.device, warmup: int = 2,
               stream: Optional[torch.cuda.Stream] = None,
               clock: Callable[[], float] = time.perf_counter) -> np.ndarray:
    """Seconds per call: CUDA events around each call on a GPU (``stream`` or the current
    one), ``clock`` on a CPU (wall time; ``time.thread_time``: the calling thread's CPU
    time, which a busy machine's other processes do not inflate)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out = np.empty(reps)
    for i in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            out[i] = start.elapsed_time(end) / 1e3
        else:
            t0 = clock()
            fn()
            out[i] = clock() - t0
    return out


def pct(samples: Union[Sequence[float], np.ndarray], scale: float = 1e6) -> Dict[str, float]:
    """p50 / p99 in microseconds (scale 1e6) or milliseconds (1e3)."""
    a = np.asarray(samples, dtype=np.float64) * scale
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def environment(device: torch.device) -> dict:
    info = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": str(device), "torch": torch.__version__, "python": platform.python_version(),
            "command": " ".join(["capsule-ros", *sys.argv[1:]]) if sys.argv else "",
            "cpu_threads": torch.get_num_threads(), "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
            "load_average": list(os.getloadavg())}        # 1, 5 and 15 minutes: how busy the machine was
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


@dataclass
class ArenaHost:
    """The slice of a runtime a CapsuleStore needs: benchmarks snapshot bare arenas."""

    arena: StateArena
    layout: ArenaLayout
    fingerprint: str
    stream: Optional[torch.cuda.Stream]
    numerics: str = ""

    def mark(self) -> None:
        """A bare arena has no execution mode (no mark to carry, none to check)."""
        return None

    def admit(self, mark: object, data: Callable[[], torch.Tensor], capsule_id: str) -> None:
        pass


def random_arena(layout: ArenaLayout, device: torch.device, seed: int = 0) -> ArenaHost:
    """An arena filled with random bytes (never benchmark on zeros)."""
    arena = StateArena(layout, device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    arena.storage.copy_(torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, generator=gen))
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    return ArenaHost(arena, layout, f"bench-{layout.digest()}", stream)


def paced_ticks(session, seconds: float, rng: np.random.Generator, period_s: float = 0.002,
                until: Callable[[], bool] = lambda: False) -> np.ndarray:
    """Tick a ``PolicySession`` every ``period_s`` for ``seconds`` (or until ``until``), each
    tick on fresh random inputs, as a timer-driven node does; each tick's wall time (s)."""
    out = []
    end = time.monotonic() + seconds
    next_tick = time.monotonic()
    while time.monotonic() < end and not until():
        for name, view in session.parts.runtime.staging.items():
            session.loop.write_input(name, rng.normal(size=view.shape).astype(view.dtype))
        start = time.perf_counter()
        session.loop.tick()
        out.append(time.perf_counter() - start)
        next_tick += period_s
        time.sleep(max(0.0, next_tick - time.monotonic()))
    return np.asarray(out)


def chosen(option: Optional[str], names: Sequence[str], what: str, bench: str) -> List[str]:
    """A comma-separated option's names (default all), each one of ``names``; SystemExit
    naming the unknown ones (``capsule-ros bench <bench>: --<what> ...``)."""
    picked = [c.strip() for c in (option or ",".join(names)).split(",") if c.strip()]
    unknown = sorted(set(picked) - set(names))
    if unknown:
        raise SystemExit(f"capsule-ros bench {bench}: --{what} {unknown}: {what} are {', '.join(names)}")
    return picked


def print_table(title: str, header: List[str], rows: Iterable[List[object]]) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title)
    for column in header:
        table.add_column(column, justify="right" if column != header[0] else "left")
    for row in rows:
        table.add_row(*[f"{v:.3g}" if isinstance(v, float) else str(v) for v in row])
    Console(width=200).print(table)


def write_report(out_dir: Union[str, Path], name: str, lines: Sequence[str]) -> Path:
    """A profiling script's text report: ``out_dir/name`` (made if missing), also printed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / name
    target.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return target


def emit(result: dict, as_json: bool, table: Callable[[dict], None]) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        table(result)
