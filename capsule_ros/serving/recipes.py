"""Recipes at work: describing a runtime's input rows, replaying a recipe on a runtime, and
following a capsule's recipe back to a state that can be had (``capsule_ros.capsules.recipe``
says what a recipe is).

Used by the recompute fallback (``capsule_ros.serving.recompute``: rebuild a capsule whose
bytes are lost, under the same fingerprint) and by regeneration
(``capsule_ros.updates.regeneration``: rebuild it under a new model). Nothing here takes the
session's boundary: ``resolve_chain`` reads files (outside it), ``replay`` steps a runtime
the caller owns (a replica, or a regeneration runtime).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.recipe import INITIAL, Recipe, RecipeInput, RecipeRoot
from capsule_ros.errors import CapsuleRosError, CorruptCapsule, InvalidArgument
from capsule_ros.runtime.arena import ArenaLayout, BufferKind, dtype_name
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.runtime.fingerprint import binding_digest

MAX_CHAIN_DEPTH = 16           # recipes rooted at capsules rooted at capsules ...


class RecipeMismatch(CorruptCapsule):
    """A recipe that does not fit the runtime replaying it: the runtime reads inputs at a
    step the recipe has no row for, it does not reach the capsule's step, or (where the
    actions must agree) it acts otherwise than recorded."""


def layout_inputs(layout: ArenaLayout, bindings: Mapping[str, object]) -> Tuple[RecipeInput, ...]:
    """The input buffers of a layout's input row (offsets within the row), each with the
    digest of what fills it (``bindings``: input name -> its port binding)."""
    start, _ = layout.byte_range(BufferKind.INPUT)
    return tuple(RecipeInput(slot.spec.name, slot.spec.shape, dtype_name(slot.spec.dtype), slot.offset - start,
                             binding_digest(bindings.get(slot.spec.name)))
                 for slot in layout if slot.spec.kind == BufferKind.INPUT)


def recipe_inputs(runtime: PolicyRuntime) -> Tuple[RecipeInput, ...]:
    """``layout_inputs`` of a runtime."""
    return layout_inputs(runtime.layout, runtime.inputs)


def row_bytes(runtime: PolicyRuntime) -> int:
    start, end = runtime.layout.byte_range(BufferKind.INPUT)
    return end - start


def input_mismatch(recorded: Sequence[RecipeInput], inputs: Sequence[RecipeInput]) -> Optional[str]:
    """Why rows of ``recorded`` inputs cannot feed a runtime of ``inputs`` (None: they
    can): every input it reads must have been recorded with the same shape, dtype and
    binding. Inputs it no longer has are ignored."""
    by_name = {i.name: i for i in recorded}
    for wanted in inputs:
        had = by_name.get(wanted.name)
        if had is None:
            return f"input {wanted.name!r} was not recorded"
        if (had.shape, had.dtype) != (wanted.shape, wanted.dtype):
            return (f"input {wanted.name!r} is {list(wanted.shape)} {wanted.dtype}, "
                    f"recorded as {list(had.shape)} {had.dtype}")
        if had.binding != wanted.binding:
            return f"input {wanted.name!r} is filled differently (its port's message type, fields or names changed)"
    return None


def rows_for(recipe: Recipe, runtime: PolicyRuntime) -> np.ndarray:
    """The recipe's rows laid out as this runtime's input row (the same bytes when its
    inputs sit where they were recorded; ``input_mismatch`` must be None)."""
    wanted = recipe_inputs(runtime)
    if wanted == recipe.info.inputs and row_bytes(runtime) == recipe.info.row_bytes:
        return recipe.rows
    by_name = {i.name: i for i in recipe.info.inputs}
    out = np.zeros((recipe.info.rows, row_bytes(runtime)), dtype=np.uint8)
    for item in wanted:
        had = by_name[item.name]
        out[:, item.offset:item.offset + item.nbytes] = recipe.rows[:, had.offset:had.offset + had.nbytes]
    return out


def start_from(runtime: PolicyRuntime, root: Union[RecipeRoot, torch.Tensor]) -> None:
    """Put the runtime in a recipe's starting state: an episode's initial state (reset with
    its seed, then its token prefix), or a capsule's bytes."""
    if isinstance(root, RecipeRoot):
        if root.kind != INITIAL:
            raise InvalidArgument(f"a recipe rooted at {root.describe()} starts from that capsule's bytes")
        runtime.reset(episode=root.episode, seed=root.seed)
        if root.prefix:
            runtime.prefill(root.prefix)
    else:
        runtime.load_state(root)


def replay(runtime: PolicyRuntime, recipe: Recipe, rows: Optional[np.ndarray] = None, *,
           expect_actions: bool = False, progress: Optional[Callable[[int], None]] = None) -> np.ndarray:
    """Step ``runtime`` through the recipe from the state it is in (its root's, relabelled
    to the root's episode); the actions of each step. ``rows``: ``rows_for`` this runtime
    (default: the recipe's own). ``expect_actions``: the actions must equal the recorded
    ones bit for bit (a rebuild under the same fingerprint), else RecipeMismatch at the first
    that differs. ``progress``: called with the steps done, every 256 steps.
    Raises RecipeMismatch when the runtime reads inputs at a step without a row, or does
    not end at the recipe's step."""
    info = recipe.info
    if info.root is not None and info.root.kind != INITIAL:
        runtime.set_episode(info.root.episode)
    device_rows = torch.from_numpy(np.ascontiguousarray(recipe.rows if rows is None else rows)).to(runtime.device)
    actions = np.empty((info.steps, runtime.policy.action_dim), dtype=np.float32)
    row = 0
    for i in range(info.steps):
        if runtime.reads_inputs():
            if not recipe.reads[i]:
                raise RecipeMismatch(f"step {info.base_step + i + 1} reads its inputs, and the recipe has no row "
                                     "for it (its policy read none there)")
            runtime.load_inputs(device_rows[row])
        row += bool(recipe.reads[i])
        runtime.step()
        actions[i] = runtime.read_outputs().action
        if expect_actions and actions[i].tobytes() != recipe.actions[i].tobytes():
            raise RecipeMismatch(f"step {info.base_step + i + 1} acted otherwise than recorded "
                                 f"({actions[i].tolist()} != {recipe.actions[i].tolist()}): the rebuild would "
                                 "not be byte-exact (another CPU numerics level or build?)")
        if progress is not None and (i + 1) % 256 == 0:
            progress(i + 1)
    reached = runtime.read_outputs().step if info.steps else None
    if reached is not None and reached != info.step:
        raise RecipeMismatch(f"the replay reached step {reached}, the recipe ends at step {info.step}")
    return actions


@dataclass(frozen=True)
class RecipeChain:
    """How to make a capsule's state again from files: a start (an initial root, the bytes
    of a capsule's verified file, or the id of a capsule in memory), then the recipes to
    replay in order (the last one makes the capsule). ``reason``: why there is none."""

    start: Union[RecipeRoot, torch.Tensor, str, None] = None
    stages: Tuple[Recipe, ...] = ()
    reason: str = ""
    label: str = ""
    parent_id: str = ""
    episode_id: int = 0
    step: int = 0
    visited: Tuple[str, ...] = field(default=())

    @property
    def steps(self) -> int:
        return sum(stage.info.steps for stage in self.stages)


def resolve_chain(directory: CapsuleDirectory, capsule_id: str, fingerprint: str, schema: Sequence[dict],
                  max_recipe_bytes: int, in_memory: Callable[[str], bool] = lambda capsule_id: False) -> RecipeChain:
    """Outside the boundary: follow a capsule's recipe (from its file) back to a state that
    can be had under ``fingerprint``: an episode's initial state, a capsule in memory
    (``in_memory``), or a capsule whose file verifies; a root whose file does not is made
    again from its own recipe (at most ``MAX_CHAIN_DEPTH`` deep, never in a circle). Never
    across fingerprints: a recipe of another graph is for ``capsule-ros regenerate``."""
    stages: List[Recipe] = []
    visited: List[str] = []
    current = capsule_id
    first = None
    while True:
        visited.append(current)
        try:
            header, recipe = directory.recipe(current, max_recipe_bytes)
        except CapsuleRosError as exc:
            return RecipeChain(reason=f"the recipe of {current} cannot be read ({exc})")
        first = first or header
        if header.fingerprint != fingerprint:
            return RecipeChain(reason=f"{current} was made by graph {header.fingerprint[:12]}, this runtime is "
                                      f"{fingerprint[:12]}: a recipe is replayed across graphs only by "
                                      "`capsule-ros regenerate` or capsules.regenerate_stale")
        if header.recipe is None:
            return RecipeChain(reason=f"the file of {current} has no recipe (format version {header.version}, "
                                      "or capsules.recipe was off)")
        if recipe is None:
            return RecipeChain(reason=f"the recipe of {current} was cut: {header.recipe.reason}")
        stages.insert(0, recipe)
        root = recipe.info.root
        assert root is not None
        chain = RecipeChain(None, tuple(stages), "", first.label, first.parent_id, first.episode_id, first.step,
                            tuple(visited))
        if root.kind == INITIAL:
            return dataclasses.replace(chain, start=root)
        if root.fingerprint != fingerprint:
            return RecipeChain(reason=f"the recipe of {current} starts from {root.capsule_id}, of graph "
                                      f"{root.fingerprint[:12]}")
        if root.capsule_id in visited:
            return RecipeChain(reason=f"the recipes of {' <- '.join(visited)} go round in a circle")
        if len(visited) >= MAX_CHAIN_DEPTH:
            return RecipeChain(reason=f"the recipes of {capsule_id} are more than {MAX_CHAIN_DEPTH} capsules deep")
        if in_memory(root.capsule_id):
            return dataclasses.replace(chain, start=root.capsule_id)
        try:
            _, data = directory.load(root.capsule_id, expected_fingerprint=fingerprint, expected_schema=schema)
            return dataclasses.replace(chain, start=data)
        except CapsuleRosError:
            current = root.capsule_id                 # its bytes are lost too: follow its own recipe
