"""A chunking policy's every-step reference: what its ``step`` is (no chunking mode needed)."""
from __future__ import annotations

import torch

from capsule_ros.runtime.policy import CHUNK, CHUNK_ACTIONS, CHUNK_CURSOR, State, StatefulPolicy


def chunked_step(policy: StatefulPolicy, state: State, execution_horizon: int) -> None:
    """Synchronous chunking as one branch-free step: the network runs every step, and its
    chunk is kept only when the current one is used up (after ``execution_horizon`` rows).
    Capturable, and what a plain ``step`` caller gets (an export check, a runtime in the
    every-step mode): the actions of the chunking mode's sync schedule, at the cost of a
    plan per step."""
    chunk, cursor = state[CHUNK_ACTIONS], state[CHUNK_CURSOR]
    policy.observe(state)
    fresh = torch.empty_like(chunk)
    policy.plan(state, fresh)
    due = cursor >= execution_horizon
    chunk.copy_(torch.where(due, fresh, chunk))
    cursor.copy_(torch.where(due, torch.zeros_like(cursor), cursor))
    rows = torch.arange(state[CHUNK].shape[0], device=chunk.device)
    upcoming = chunk.index_select(0, torch.clamp(cursor + rows, max=execution_horizon - 1))
    policy.emit(state, upcoming[0], upcoming)
    cursor.add_(1)
