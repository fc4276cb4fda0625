"""Model updates (no ROS): what a new deployment does to the capsules of a directory, and
capsules made again for it from their recipes.

- ``deployment``: a parameter file's policy and identity (``Deployment``, ``load_deployment``);
- ``invalidation``: a directory's capsules of another fingerprint, counted by cause (``survey``);
- ``assessment``: each capsule's fate (keep, regenerate, lost) and ``capsule-ros check``'s
  typed report (``check``);
- ``regeneration``: the runner (``Regeneration``) and its typed outcomes and report;
- ``staging``: ``capsule-ros regenerate``'s directories (written completely or not at all);
- ``background``: the node's background regeneration in a child process (``capsules.regenerate_stale``);
- ``watch``: what the node's status shows of it all (``ModelUpdateWatch``).

Between the serving session (whose recipes it replays) and the commands; JSON is made only
by the commands (``capsule_ros.cli``). docs/model-updates.md is the user's guide.
"""
from capsule_ros._lazy import lazy_exports

_EXPORTS = {
    "Deployment": "capsule_ros.updates.deployment",
    "load_deployment": "capsule_ros.updates.deployment",
    "Survey": "capsule_ros.updates.invalidation",
    "survey": "capsule_ros.updates.invalidation",
    "Assessment": "capsule_ros.updates.assessment",
    "Fate": "capsule_ros.updates.assessment",
    "CheckReport": "capsule_ros.updates.assessment",
    "assess": "capsule_ros.updates.assessment",
    "check": "capsule_ros.updates.assessment",
    "Regeneration": "capsule_ros.updates.regeneration",
    "RegenerationReport": "capsule_ros.updates.regeneration",
    "Outcome": "capsule_ros.updates.regeneration",
    "regenerate_directory": "capsule_ros.updates.staging",
    "BackgroundRegeneration": "capsule_ros.updates.background",
    "ModelUpdateWatch": "capsule_ros.updates.watch",
    "BadArguments": "capsule_ros.updates.errors",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
