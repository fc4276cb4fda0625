"""Behaviour-tree client of the capsule services (py_trees; needs rclpy).

- :mod:`capsule_ros.bt.behaviours`: non-blocking service leaves (:class:`CapsuleServiceCall`
  and one thin class per verb) that fail with BehaviorTree.ROS2's error kinds and pass
  capsule ids through the blackboard.
- :mod:`capsule_ros.bt.run_policy`: :class:`RunPolicy`, the leaf of the ``~/run_policy``
  action (run until a budget, a cancel or a halt of the tree), with BehaviorTree.ROS2's
  action error kinds.
- :mod:`capsule_ros.bt.example`: "commit before the grasp; on failure re-enter the last
  good capsule and retry; give up after N tries" (``python -m capsule_ros.bt.example``).
- :mod:`capsule_ros.bt.pause`: interrupt an episode, run something else, resume it where it
  stopped (:func:`interrupt_then_resume`).
- :mod:`capsule_ros.bt.task`: :class:`SetTask`, give a vision-language-action policy a new
  task instruction (published on its task topic, acknowledged in its ``~/status``).

docs/behavior-trees.md covers these and calling the services from BehaviorTree.ROS2 / Nav2.
"""
from capsule_ros.bt.behaviours import (
                                       DEFAULT_CALL_TIMEOUT_S,
                                       DEFAULT_NODE,
                                       DEFAULT_SERVER_WAIT_S,
                                       DISK_CALL_TIMEOUT_S,
                                       FORK_KEY,
                                       INTERRUPT_KEY,
                                       LAST_GOOD_KEY,
                                       OUTCOME_PREFIX,
                                       CapsuleServiceCall,
                                       Commit,
                                       DropCapsule,
                                       FailureKind,
                                       Fork,
                                       Interrupt,
                                       InvalidRequest,
                                       LoadCapsule,
                                       Reenter,
                                       Reset,
                                       SaveCapsule,
                                       ServiceOutcome,
                                       capsule_id_from,
                                       spin_in_background,
                                       tick_until_done,
)
from capsule_ros.bt.pause import interrupt_then_resume
from capsule_ros.bt.run_policy import FEEDBACK_KEY, ActionFailure, RunOutcome, RunPolicy
from capsule_ros.bt.task import SetTask

__all__ = [
    "ActionFailure", "FEEDBACK_KEY", "RunOutcome", "RunPolicy",
    "DEFAULT_CALL_TIMEOUT_S", "DEFAULT_NODE", "DEFAULT_SERVER_WAIT_S", "DISK_CALL_TIMEOUT_S", "FORK_KEY",
    "INTERRUPT_KEY", "LAST_GOOD_KEY", "OUTCOME_PREFIX", "CapsuleServiceCall", "Commit", "DropCapsule", "FailureKind",
    "Fork", "Interrupt", "InvalidRequest", "LoadCapsule", "Reenter", "Reset", "SaveCapsule", "ServiceOutcome",
    "SetTask", "capsule_id_from", "interrupt_then_resume", "spin_in_background", "tick_until_done",
]
