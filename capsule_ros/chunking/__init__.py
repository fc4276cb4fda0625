"""The chunking mode (no ROS): a chunking policy's network runs only when a chunk is due.

An execution mode above the runtime's core (``capsule_ros.runtime.mode`` has the protocol;
the core imports nothing from here). A chunking policy (``StatefulPolicy.cadence()``, e.g.
ACT with an action queue, Diffusion Policy) predicts ``length`` actions at once, an action
chunk, and executes them one per step. Running its network at every step and discarding
the result (the branch-free step a single CUDA graph needs: ``reference.chunked_step``)
costs a whole forward pass per step; here the host decides, from a mirror of the chunk
cursor, which phases each step runs, and the runtime replays the one program (a CUDA
graph on a GPU, the same Python eagerly on a CPU) made for that mix:

========== ========================================= =====================================
program    phases                                     when (cursor c, pending p)
========== ========================================= =====================================
refill     observe, plan (into chunk.actions), act    c == end and nothing requested
consume    observe, act                               otherwise
request    observe, request (copy plan's reads), act  async: c == execution horizon
adopt      adopt (the worker's chunk), observe, act   async: c == end and a request is out
========== ========================================= =====================================

``act`` executes row ``c`` of ``chunk.actions`` (``emit`` gets it and the rows after it)
and advances the cursor. ``end`` = execution horizon + delay: a chunk is executed up to
row ``end - 1`` (``schedule.ChunkSchedule``).

Synchronous refills (``control.chunking: sync``, delay 0): exactly LeRobot's
``select_action``: when the chunk is used up, the step plans a new one from its own
observation and executes its first row.

Asynchronous refills (``async``, delay d >= 1 steps, fixed and recorded): the refill for
the chunk that takes over at step t + d is requested at step t from step t's observation
(``request`` copies the buffers ``plan`` reads into ``chunk.request.*``, in the arena) and
planned off the control loop by a refill worker (``workers``: a thread with its own torch
threads on a CPU, its own stream and graph on a GPU), whose plan lands in the arena's
scratch buffer ``chunk.fresh``. Steps t .. t+d-1 keep executing the current chunk; at
t + d the new chunk takes over at row d: its first d actions count as already executed
(real-time chunking's convention). Every action is therefore a function of the inputs and
step indices alone, never of wall time. The first chunk of an episode has nothing to
overlap with: it is planned synchronously (rows 0 .. end - 1). A refill that has not
finished by its takeover step is a deadline event: the step waits for it (its state
stays exact) and reports itself late (``StepReport.late``; the session hands out the safe
action and counts it).

A plan may read the chunk it replaces: ``cadence().reads`` may name ``chunk.actions`` and
``chunk.cursor`` (real-time chunking's leftover rows). A request then copies them with the
rest, so an asynchronous plan sees the chunk and cursor of its request step; in sync mode
``plan``'s ``chunk`` argument is ``chunk.actions`` itself, so a plan reads what it needs
of the old chunk before it writes the new one.

The cursor and pending flag live in the arena (meta buffers: a capsule holds them, and
the host reads them back with the outputs); the mode keeps a host mirror so that choosing
a program never waits for the device. A capsule carries the mode's mark of its state
(``mark.ChunkingMark``, opaque to the store); restoring one checks the mark against the
capsule's bytes and this runtime's schedule before the live state is touched
(``ChunkingMode.admit``), and afterwards, when told (``PolicyRuntime.after_restore``),
mirrors it and re-issues a pending request from the restored ``chunk.request.*``.
"""
from capsule_ros._lazy import lazy_exports

_EXPORTS = {
    "Chunking": "capsule_ros.chunking.mode",
    "ChunkingMode": "capsule_ros.chunking.mode",
    "ChunkProgram": "capsule_ros.chunking.mode",
    "mode_for": "capsule_ros.chunking.mode",
    "resolve_chunking": "capsule_ros.chunking.mode",
    "ChunkingMark": "capsule_ros.chunking.mark",
    "ChunkSchedule": "capsule_ros.chunking.schedule",
    "ChunkingSettings": "capsule_ros.chunking.schedule",
    "RefillTiming": "capsule_ros.chunking.schedule",
    "chunked_step": "capsule_ros.chunking.reference",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
