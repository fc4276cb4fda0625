"""Pause an episode for something else, then resume it exactly where it stopped.

The tree (:func:`interrupt_then_resume`; what runs in between is any behaviour you plug in:
an operator's teleoperation, a scripted tool change, waiting for a person to clear the
workspace)::

    [-] InterruptThenResume          Sequence (memory)
        --> InterruptEpisode         Interrupt: stop at the next step boundary, publish the safe
                                     action (hold_mode), commit the boundary capsule
                                     -> /capsule/interrupt
        --> <while_interrupted>      your behaviour; the policy node holds meanwhile
        --> ResumeEpisode            Reenter /capsule/interrupt: the policy's state as it was at
                                     the boundary, and stepping resumes

While interrupted the node steps no policy: in trigger mode each trigger message, in timer
mode each period, publishes the hold mode's safe action (HOLD_LAST: the last action;
HOLD_ZERO: zeros; HOLD_SILENT: nothing), and the output adapters stop the robot where it
is (docs/controllers.md). The re-entry restores the whole execution state, for a LeRobot
policy its action queue or temporal-ensembling sums, Diffusion's observation history and
its RNG counter: the actions after the resume are the ones the policy would have produced
had the pause not happened, given the same sensor inputs (test/test_lerobot_node.py checks
it bit for bit). The robot itself is wherever the pause left it; the policy sees that
through its inputs.

If ``while_interrupted`` fails, the tree fails without resuming: the episode stays
INTERRUPTED and holding, and the capsule id is still on the blackboard for a later
``Reenter`` (or a ``Reset`` to start over).
"""
from __future__ import annotations

from typing import Any, Optional

import py_trees

from capsule_ros import srv
from capsule_ros.bt.behaviours import DEFAULT_NODE, INTERRUPT_KEY, Interrupt, Reenter


def interrupt_then_resume(while_interrupted: py_trees.behaviour.Behaviour, *,
                          hold_mode: int = srv.Interrupt.Request.HOLD_LAST, node_path: str = DEFAULT_NODE,
                          capsule_key: str = INTERRUPT_KEY, node: Optional[Any] = None,
                          name: str = "InterruptThenResume", **calls: Any) -> py_trees.behaviour.Behaviour:
    """The tree of the module docstring around ``while_interrupted``; returns its root.
    ``calls``: ``server_wait_s`` / ``call_timeout_s`` for both service leaves."""
    interrupt = Interrupt("InterruptEpisode", hold_mode=hold_mode, commit=True, capsule_key=capsule_key,
                          node_path=node_path, node=node, **calls)
    resume = Reenter("ResumeEpisode", capsule_key=capsule_key, node_path=node_path, node=node, **calls)
    return py_trees.composites.Sequence(name, memory=True, children=[interrupt, while_interrupted, resume])
