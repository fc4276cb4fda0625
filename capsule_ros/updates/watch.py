"""What a node shows of its capsule directory's model updates (``~/status``, ``/diagnostics``).

At configure (``ModelUpdateWatch.survey``) the directory's capsule files of another
fingerprint are counted by cause from their headers, and logged when there are any. At
activate (``start``), with ``capsules.regenerate_stale``, those that carry a recipe are
regenerated in the background (``BackgroundRegeneration``). The session keeps the
recipes of the directory's files current through its saves and drops
(``capsule_ros.serving.capsule_set.DirectoryWatch``, the face it sees), and its status
shows the picture (``StalePicture``).
"""
from __future__ import annotations

import logging
from typing import Dict, Optional, Tuple

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.recipe import RecipeInfo
from capsule_ros.runtime.arena import ArenaLayout
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import PreparedServing
from capsule_ros.serving.records import StalePicture
from capsule_ros.updates.background import BackgroundRegeneration
from capsule_ros.updates.deployment import load_deployment
from capsule_ros.updates.invalidation import Survey, survey
from capsule_ros.updates.regeneration import Status

LOG = logging.getLogger(__name__)


class ModelUpdateWatch:
    """See the module docstring. The session calls ``saved``, ``removed`` and ``picture``
    under its boundary."""

    def __init__(self, found: Survey, directory: Optional[CapsuleDirectory] = None, fingerprint: str = ""):
        self.survey = found
        self._directory = directory
        self._fingerprint = fingerprint
        self._recipes: Dict[str, Tuple[int, bool]] = dict(found.recipes)     # id -> (recipe bytes, regenerable)
        self.background: Optional[BackgroundRegeneration] = None

    @classmethod
    def of(cls, prepared: PreparedServing) -> ModelUpdateWatch:
        """The node's configure: count the prepared directory's capsules of another
        fingerprint by cause (headers only; logged when there are any)."""
        directory = prepared.directory
        found = survey(directory, prepared.fingerprint, prepared.identity.parts,
                       ArenaLayout(prepared.policy.state_spec()).schema())
        if found.stale:
            LOG.warning("capsule directory %s: %s (`capsule-ros check` says why; `capsule-ros regenerate` or "
                        "capsules.regenerate_stale rebuild those with a recipe)", directory.root if directory else "",
                        found.describe())
        return cls(found, directory, prepared.fingerprint)

    def start(self, config: ServingConfig) -> None:
        """The node's activate, once its session serves: with ``capsules.regenerate_stale``,
        regenerate the stale capsules in the background (a child process)."""
        if (config.capsules.regenerate_stale and self.survey.stale and self._directory is not None
                and self.background is None):
            self.background = BackgroundRegeneration(config, self._directory, self.survey.stale_ids,
                                                     self._fingerprint, load_deployment)
            self.background.start()

    def saved(self, capsule_id: str, recipe: Optional[RecipeInfo]) -> None:
        """The session wrote this capsule's file (with ``recipe``, None: none)."""
        self._recipes[capsule_id] = (recipe.nbytes, recipe.regenerable) if recipe is not None else (0, False)

    def removed(self, capsule_id: str) -> None:
        """The session removed this capsule's file."""
        self._recipes.pop(capsule_id, None)

    def picture(self) -> StalePicture:
        background = self.background
        done, failed, left = background.progress() if background is not None else (0, 0, 0)
        if background is not None:
            for outcome in background.outcomes:
                if outcome.status == Status.REGENERATED:
                    self._recipes[outcome.capsule_id] = (outcome.recipe_bytes, True)
        regenerable = sum(1 for _, ok in self._recipes.values() if ok)
        found = self.survey
        return StalePicture(found.stale, dict(found.by_cause), found.regenerable, done, failed, left, regenerable,
                            sum(nbytes for nbytes, _ in self._recipes.values()))

    def close(self) -> None:
        """Stop the background regeneration (after the capsule in progress, at most 5 s)."""
        if self.background is not None:
            self.background.close()
