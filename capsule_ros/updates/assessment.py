"""What a model update does to each capsule file of a directory (``assess``), and the dry
run of ``capsule-ros check`` (``check``): from the headers alone, nothing written.

Each capsule's *fate* under the deployment:

- **keep**: its fingerprint is the deployment's (nothing to do);
- **regenerate**: its recipe can make it again: a recipe is stored (not cut), every input
  the new policy reads was recorded with the same binding, and its root is an initial
  state or a capsule of the directory that is itself kept or regenerated;
- **lost**: none of that, with the reason (no recipe, recipe cut, ports no longer
  compatible, root missing, ...).

Capsules are taken in dependency order (recipe roots and lineage parents first, then by
episode and step), so a capsule rooted at another is made from that root's *new* state.
The report is typed (``CheckReport``); the command turns it into text or JSON.
"""
from __future__ import annotations

import dataclasses
import enum
import heapq
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.fileformat import CapsuleHeader
from capsule_ros.capsules.recipe import CAPSULE, INITIAL, RecipeInfo
from capsule_ros.capsules.validity import Validity, judge
from capsule_ros.errors import CapsuleRosError
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.serving.recipes import input_mismatch
from capsule_ros.updates.deployment import Deployment
from capsule_ros.updates.errors import EXIT_LOST, EXIT_OK


class Fate(str, enum.Enum):
    """What a model update does to a capsule file (see the module docstring)."""

    KEEP = "keep"
    REGENERATE = "regenerate"
    LOST = "lost"


@dataclass
class Assessment:
    """One capsule file's fate under a deployment, from its header."""

    capsule_id: str
    header: Optional[CapsuleHeader]      # None: unreadable (then LOST)
    validity: Validity
    fate: Fate
    reason: str = ""                     # LOST: why
    depends_on: Tuple[str, ...] = ()     # capsules to take before it (recipe root, lineage parent)

    @property
    def recipe(self) -> Optional[RecipeInfo]:
        return self.header.recipe if self.header is not None else None

    @property
    def steps(self) -> int:
        recipe = self.recipe
        return recipe.steps if recipe is not None else 0


def _lost_reason(header: CapsuleHeader, deployment: Deployment) -> str:
    """Why a capsule of another fingerprint cannot be regenerated from what its header
    says ('' when it can, its root permitting)."""
    recipe = header.recipe
    if recipe is None:
        return ("no recipe (format version 1 files have none)" if header.version == 1 else
                "no recipe (it was saved with capsules.recipe off)")
    if not recipe.regenerable:
        return f"recipe cut: {recipe.reason}"
    mismatch = input_mismatch(recipe.inputs, deployment.inputs)
    if mismatch is not None:
        return f"ports no longer compatible: {mismatch}"
    if recipe.root is not None and recipe.root.kind == INITIAL and recipe.root.prefix and \
            not deployment.supports_prefill:
        return "its root has a token prefix, and the new policy takes none"
    return ""


def assess(directory: CapsuleDirectory, deployment: Deployment,
           only: Optional[Sequence[str]] = None) -> List[Assessment]:
    """Every capsule file of ``directory`` (or ``only`` these ids) from its header, in
    dependency order (see the module docstring)."""
    found: Dict[str, Assessment] = {}
    for capsule_id in directory.ids():
        try:
            header = directory.header(capsule_id)
        except CapsuleRosError as exc:
            found[capsule_id] = Assessment(capsule_id, None, Validity(False, (), "unreadable"), Fate.LOST,
                                           f"its header cannot be read: {exc}")
            continue
        validity = judge(header, deployment.fingerprint, deployment.parts, deployment.schema)
        root = header.recipe.root if header.recipe is not None else None
        depends = tuple(d for d in (root.capsule_id if root is not None and root.kind == CAPSULE else "",
                                    header.parent_id) if d and d != capsule_id)
        if validity.valid:
            found[capsule_id] = Assessment(capsule_id, header, validity, Fate.KEEP, depends_on=depends)
            continue
        reason = _lost_reason(header, deployment)
        found[capsule_id] = Assessment(capsule_id, header, validity, Fate.LOST if reason else Fate.REGENERATE,
                                       reason, depends)
    ordered = _dependency_order(found)
    for item in ordered:
        recipe = item.recipe
        if item.fate != Fate.REGENERATE or recipe is None or recipe.root is None or recipe.root.kind != CAPSULE:
            continue
        root = recipe.root
        base = found.get(root.capsule_id)
        if base is None:
            item.fate, item.reason = Fate.LOST, f"root missing: its recipe starts from {root.capsule_id}, not in " \
                                                "the directory"
        elif base.fate == Fate.LOST:
            item.fate, item.reason = Fate.LOST, f"its root {root.capsule_id} cannot be regenerated ({base.reason})"
    wanted = set(only) if only is not None else None
    return [item for item in ordered if wanted is None or item.capsule_id in wanted]


def _dependency_order(found: Dict[str, Assessment]) -> List[Assessment]:
    """Roots and parents before the capsules that depend on them, else by (episode, step,
    id); the capsules of a circle are lost."""
    waiting = {cid: {d for d in item.depends_on if d in found} for cid, item in found.items()}
    children: Dict[str, List[str]] = {cid: [] for cid in found}
    for cid, deps in waiting.items():
        for dep in deps:
            children[dep].append(cid)

    def key(cid: str) -> Tuple[int, int, str]:
        header = found[cid].header
        return (header.episode_id, header.step, cid) if header is not None else (0, 0, cid)

    ready = [key(cid) for cid, deps in waiting.items() if not deps]
    heapq.heapify(ready)
    out: List[Assessment] = []
    while ready:
        cid = heapq.heappop(ready)[2]
        out.append(found[cid])
        for child in children[cid]:
            waiting[child].discard(cid)
            if not waiting[child]:
                heapq.heappush(ready, key(child))
    for cid in sorted(set(found) - {a.capsule_id for a in out}):
        item = found[cid]
        if item.fate == Fate.REGENERATE:
            item.fate, item.reason = Fate.LOST, "its recipe roots and parents go round in a circle"
        out.append(item)
    return out


# -- check ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckedCapsule:
    """One capsule in ``check``'s report: its assessment and, when it would be regenerated,
    the expected time and the bytes of its new file (state and recipe)."""

    assessment: Assessment
    expected_seconds: Optional[float] = None
    new_bytes: int = 0


@dataclass(frozen=True)
class CheckReport:
    """``check``'s dry run of a directory under a deployment (see the module docstring)."""

    directory: str
    fingerprint: str
    capsules: Tuple[CheckedCapsule, ...]
    steps_per_second: Optional[float]           # the new policy's replay rate (None: nothing to regenerate)
    steps_per_second_from: str                  # "given", or how it was measured
    header_read_seconds: float

    def _of(self, fate: Fate) -> List[Assessment]:
        return [c.assessment for c in self.capsules if c.assessment.fate == fate]

    @property
    def total(self) -> int:
        return len(self.capsules)

    @property
    def invalidated(self) -> int:
        return sum(not c.assessment.validity.valid for c in self.capsules)

    @property
    def by_cause(self) -> Dict[str, int]:
        counts: Dict[str, int] = {}
        for checked in self.capsules:
            if not checked.assessment.validity.valid:
                for cause in checked.assessment.validity.causes:
                    counts[cause] = counts.get(cause, 0) + 1
        return counts

    @property
    def regenerable(self) -> int:
        return len(self._of(Fate.REGENERATE))

    @property
    def lost(self) -> int:
        return len(self._of(Fate.LOST))

    @property
    def recipe_coverage(self) -> float:
        """The share of capsules that carry a regenerable recipe (1.0 for an empty directory)."""
        covered = sum(1 for c in self.capsules if c.assessment.recipe is not None and c.assessment.recipe.regenerable)
        return covered / self.total if self.total else 1.0

    @property
    def regeneration_steps(self) -> int:
        return sum(a.steps for a in self._of(Fate.REGENERATE))

    @property
    def expected_seconds(self) -> float:
        rate = self.steps_per_second
        return self.regeneration_steps / rate if rate and self.regenerable else 0.0

    @property
    def storage_bytes(self) -> int:
        return sum(c.new_bytes for c in self.capsules)

    @property
    def exit(self) -> int:
        return EXIT_LOST if self.lost else EXIT_OK


def measure_steps_per_second(runtime: PolicyRuntime, seconds: float = 0.5, at_least: int = 20) -> float:
    """Steps per second of ``runtime`` replaying as a regeneration does (inputs uploaded
    when read, outputs read every step), from its initial state on zero inputs."""
    runtime.reset(episode=0)
    zeros = torch.zeros_like(runtime.input_staging)
    for _ in range(3):
        runtime.load_inputs(zeros)
        runtime.step()
        runtime.read_outputs()
    done, start = 0, time.perf_counter()
    while done < at_least or time.perf_counter() - start < seconds:
        if runtime.reads_inputs():
            runtime.load_inputs(zeros)
        runtime.step()
        runtime.read_outputs()
        done += 1
    return done / (time.perf_counter() - start)


def new_recipe_bytes(info: RecipeInfo, deployment: Deployment) -> int:
    """The recipe's binary part once regenerated: its rows laid out as the new input row,
    the new model's actions."""
    return dataclasses.replace(info, row_bytes=deployment.row_bytes, action_dim=deployment.policy.action_dim).data_bytes


def check(directory: CapsuleDirectory, deployment: Deployment, steps_per_second: Optional[float] = None) -> CheckReport:
    """The dry run (headers only): each capsule's validity and causes, recipe, and what
    regeneration would do; recipe coverage; expected regeneration time and storage. The
    time is the recipe steps over ``steps_per_second``, measured on a runtime of the
    deployment when not given."""
    started = time.perf_counter()
    items = assess(directory, deployment)
    read_s = time.perf_counter() - started
    todo = [a for a in items if a.fate == Fate.REGENERATE]
    how = "given"
    if steps_per_second is None and todo:
        steps_per_second = measure_steps_per_second(deployment.runtime_for(todo[0].header.mark
                                                                           if todo[0].header else None))
        how = "measured on this machine: steps of the new policy, as a regeneration replays them"
    state_bytes = deployment.layout.nbytes
    checked = []
    for item in items:
        recipe = item.recipe
        if item.fate == Fate.REGENERATE and recipe is not None:
            checked.append(CheckedCapsule(item, item.steps / steps_per_second if steps_per_second else None,
                                          state_bytes + new_recipe_bytes(recipe, deployment)))
        else:
            checked.append(CheckedCapsule(item))
    return CheckReport(str(directory.root), deployment.fingerprint, tuple(checked), steps_per_second, how, read_s)
