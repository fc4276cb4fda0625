"""The export interface, and ``export_module``: a user's ``nn.Module`` to the ``.pt2``
program ``policy.kind: exported`` serves (``capsule-ros export`` is its command line).

A module keeps the interface when it has

- ``inputs``: a sequence of ``BufferSpec`` (kind input), one per node port it reads:
  name, shape without the batch dimension, dtype;
- ``state``: a sequence of ``BufferSpec`` (kinds recurrent, kv, conv, chunk, meta):
  everything the policy carries from one step to the next. A buffer named ``rng``,
  int64[2], is the runtime's counter-based generator (seed, counter), seeded at every
  reset (``capsule_ros.runtime.rng.counter_normal`` draws from it);
- ``action_dim`` and ``chunk_horizon`` (ints), and ``initial_state()``: name -> tensor,
  the state of a new episode (shapes without the batch dimension);
- ``forward(*inputs, *state) -> (action [B, A], chunk [B, H, A], *new_state)``, batch
  first, in the order of ``inputs`` then ``state``: a pure function that writes none of
  its arguments and keeps nothing between calls.

A chunking module (one whose network should run only when a chunk is due) has
``cadence`` (a ``ChunkCadence``: chunk length, rows executed per chunk, the names ``plan``
reads) and, instead of ``forward``, three pure functions (``capsule_ros.policies.phases``):
``observe(*inputs, *state) -> new_state``, ``plan(*reads) -> chunk [B, length, A]`` and
``emit(action [B, A], upcoming [B, H, A], *state) -> (action, chunk, *new_state)``. Each is
checked, traced and compared like ``forward``.

Such a module trains as usual (any batch size) and exports as it is: ``export_module``
checks the interface, runs the module eagerly (twice, to find a forward that is not a
pure function), traces it with ``torch.export`` at batch size 1 on the CPU (the runtime
moves the program to its device), makes the graph functional and checks that it writes
no buffer in place, runs
program and module side by side for a few steps to report whether they agree bit for bit,
and writes the ``.pt2`` atomically with the metadata (``capsule_ros.policies.exported``).
"""
from __future__ import annotations

import base64
import functools
import hashlib
import importlib
import io
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, cast

import torch
from torch import nn

from capsule_ros.errors import ConfigError
from capsule_ros.files import write_file
from capsule_ros.policies.binding import Requirement, require
from capsule_ros.policies.exported import MAX_INITIAL_BYTES, METADATA_FILE, PHASE_FILE, ProgramInterface, functional
from capsule_ros.runtime.arena import BufferSpec, dtype_name
from capsule_ros.runtime.policy import ChunkCadence


class InterfaceError(ConfigError):
    """The module does not keep the export interface; the message says what to change."""


class ExportSource(Protocol):
    """The export interface (the module docstring) as ``interface_of`` reads it from a module
    once it has checked that the names exist."""

    inputs: Sequence[BufferSpec]
    state: Sequence[BufferSpec]
    action_dim: int
    chunk_horizon: int

    def initial_state(self) -> Mapping[str, torch.Tensor]: ...


@dataclass(frozen=True)
class ExportReport:
    """What ``export_module`` wrote."""

    path: Path
    sha256: str
    nbytes: int
    interface: ProgramInterface
    checked_steps: int
    mismatch: Optional[str]      # None: the program's outputs equal the module's bit for bit

    def summary(self) -> str:
        agreement = (f"the program's outputs equal the module's bit for bit over {self.checked_steps} steps"
                     if self.mismatch is None else f"NOTE: the program differs from the module: {self.mismatch}")
        return (f"wrote {self.path} ({self.nbytes / 1024:.0f} KiB, sha256 {self.sha256[:16]}): "
                f"{self.interface.describe()}; {agreement}")


def load_factory(spec: str) -> Callable[..., Any]:
    """``package.module:attribute`` -> the attribute (a module class or a factory function)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise InterfaceError(f"--module {spec!r}: must be package.module:factory")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise InterfaceError(f"--module {spec!r}: {type(exc).__name__}: {exc}") from None


class _Declared:
    """A module as ``interface_of`` reads it; ``initial_state()`` is called once."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.source = cast(ExportSource, module)

    @functools.cached_property
    def initial(self) -> Any:
        return self.source.initial_state()

    def missing(self) -> List[str]:
        return [name for name in ("inputs", "state", "action_dim", "chunk_horizon", "initial_state")
                if not hasattr(self.module, name)]

    def cadence(self) -> Any:
        return getattr(self.module, "cadence", None)

    def lacking_phases(self) -> List[str]:
        return [name for name in ("observe", "plan", "emit") if not callable(getattr(self.module, name, None))]


def _specs(value: Any) -> bool:
    return not isinstance(value, (str, bytes)) and isinstance(value, Sequence) \
        and all(isinstance(s, BufferSpec) for s in value)


def _names_state(initial: Any, state: Sequence[BufferSpec]) -> bool:
    return isinstance(initial, Mapping) and set(initial) == {s.name for s in state}


# What a module must declare before its interface is built (in order: a row may assume those before hold).
DECLARATION = (
    Requirement(lambda d: not d.missing(),
                lambda d: f" lacks {d.missing()} of the export interface (docs/bring-your-own-policy.md)"),
    Requirement(lambda d: _specs(d.source.inputs), lambda d: ".inputs must be a sequence of capsule_ros BufferSpec"),
    Requirement(lambda d: _specs(d.source.state), lambda d: ".state must be a sequence of capsule_ros BufferSpec"),
    Requirement(lambda d: _names_state(d.initial, d.source.state),
                lambda d: f".initial_state() must map every state name {[s.name for s in d.source.state]} to a tensor, "
                          f"got {sorted(d.initial) if isinstance(d.initial, Mapping) else type(d.initial)}"),
    Requirement(lambda d: d.cadence() is None or isinstance(d.cadence(), ChunkCadence),
                lambda d: f".cadence must be a capsule_ros ChunkCadence, not {type(d.cadence()).__name__}"),
    Requirement(lambda d: d.cadence() is None or not d.lacking_phases(),
                lambda d: f" has a cadence but lacks {d.lacking_phases()}: a chunking module defines observe, plan and "
                          "emit (docs/bring-your-own-policy.md)"),
)


def interface_of(module: nn.Module) -> ProgramInterface:
    """The module's export interface, checked (``DECLARATION``, then the interface's own
    rules); InterfaceError naming what is missing or wrong."""
    where = f"module {type(module).__name__}"
    declared = _Declared(module)
    require(DECLARATION, declared, InterfaceError, prefix=where)
    source = declared.source
    interface = ProgramInterface(tuple(source.inputs), tuple(source.state), source.action_dim, source.chunk_horizon,
                                 {}, declared.cadence())
    interface.check(InterfaceError, where)
    return replace(interface, initial=_initial_values(interface, declared.initial, where))


def _initial_values(interface: ProgramInterface, initial: Mapping[str, Any], where: str) -> Dict[str, torch.Tensor]:
    """The state's non-zero initial values (``rng`` is seeded by the runtime instead), each
    checked against its spec, at most ``MAX_INITIAL_BYTES`` of them."""
    values = {}
    for spec in interface.state:
        value = initial[spec.name]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != spec.shape or value.dtype != spec.dtype:
            shown = f"{dtype_name(value.dtype)}{list(value.shape)}" if isinstance(value, torch.Tensor) else type(value)
            raise InterfaceError(f"{where}.initial_state()[{spec.name!r}] is {shown}, its state spec says "
                                 f"{dtype_name(spec.dtype)}{list(spec.shape)}")
        if spec.name != "rng" and bool(value.ne(0).any()):
            values[spec.name] = value.detach().cpu().clone()
    stored = sum(spec.nbytes for spec in interface.state if spec.name in values)
    if stored > MAX_INITIAL_BYTES:
        raise InterfaceError(f"{where}.initial_state() has {stored} bytes of non-zero values; at most "
                             f"{MAX_INITIAL_BYTES} are stored in the program's metadata (start large buffers at zero)")
    return values


def _random_inputs(interface: ProgramInterface, generator: torch.Generator) -> List[torch.Tensor]:
    """One step's inputs with a batch of one: normals for floats, bytes for uint8, 0/1 otherwise."""
    out = []
    for spec in interface.inputs:
        shape = (1, *spec.shape)
        if spec.dtype.is_floating_point:
            out.append(torch.randn(shape, generator=generator).to(spec.dtype))
        else:
            high = 256 if spec.dtype == torch.uint8 else 2
            out.append(torch.randint(0, high, shape, generator=generator, dtype=spec.dtype))
    return out


def _initial(interface: ProgramInterface, module: nn.Module) -> List[torch.Tensor]:
    """The initial state with a batch of one (rng seeded with 0, as the runtime would)."""
    initial = cast(ExportSource, module).initial_state()
    state = [initial[s.name].detach().cpu().clone()[None] for s in interface.state]
    for spec, value in zip(interface.state, state, strict=True):
        if spec.name == "rng":
            value.zero_()
    return state


def _check_outputs(interface: ProgramInterface, outputs: Any, where: str) -> Tuple[torch.Tensor, ...]:
    """The outputs of one forward must be (action, chunk, *new_state) of the right shapes and dtypes."""
    expected = [("action", (1, interface.action_dim), torch.float32),
                ("chunk", (1, interface.chunk_horizon, interface.action_dim), torch.float32),
                *((f"new state {s.name!r}", (1, *s.shape), s.dtype) for s in interface.state)]
    if not isinstance(outputs, (tuple, list)) or len(outputs) != len(expected):
        count = len(outputs) if isinstance(outputs, (tuple, list)) else type(outputs).__name__
        raise InterfaceError(f"{where} returns {count}; it must return a tuple (action, chunk, *new_state) of "
                             f"{len(expected)} tensors")
    for (what, shape, dtype), value in zip(expected, outputs, strict=True):
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or value.dtype != dtype:
            shown = f"{dtype_name(value.dtype)}{list(value.shape)}" if isinstance(value, torch.Tensor) else type(value)
            raise InterfaceError(f"{where} returns {what} as {shown}; it must be {dtype_name(dtype)}{list(shape)}")
    return tuple(outputs)


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class _Phase(nn.Module):
    """One of a chunking module's functions as a module's forward, so torch.export traces it."""

    def __init__(self, module: nn.Module, name: str):
        super().__init__()
        self.module, self.name = module, name

    def forward(self, *args: torch.Tensor):
        return getattr(self.module, self.name)(*args)


def _sample_args(interface: ProgramInterface, module: nn.Module) -> Dict[str, List[torch.Tensor]]:
    """Arguments of one call of each function to trace (batch of one, seeded)."""
    generator = torch.Generator().manual_seed(0)
    inputs, state = _random_inputs(interface, generator), _initial(interface, module)
    if interface.cadence is None:
        return {"forward": [*inputs, *state]}
    names = [s.name for s in (*interface.inputs, *interface.state)]
    values = dict(zip(names, [*inputs, *state], strict=True))
    upcoming = torch.randn((1, interface.chunk_horizon, interface.action_dim), generator=generator)
    return {"observe": [*inputs, *state], "plan": [values[r] for r in interface.cadence.reads],
            "emit": [upcoming[:, 0].clone(), upcoming, *state]}


def _check_pure(module: nn.Module, interface: ProgramInterface, phase: str, args: List[torch.Tensor],
                where: str) -> None:
    """A function must write none of its arguments and give the same outputs twice."""
    fn = module if phase == "forward" else getattr(module, phase)
    name = f"{where}.{phase}"
    with torch.no_grad():
        originals = [a.clone() for a in args]
        first = _check_phase_outputs(interface, phase, fn(*args), name)
        if not _same(args, originals):
            raise InterfaceError(f"{name} writes its arguments in place; it must return the new state instead")
        if not _same(_check_phase_outputs(interface, phase, fn(*args), name), first):
            raise InterfaceError(f"{name} gave other outputs when called again with the same arguments: it keeps "
                                 "state outside its declared state (return it as new state instead)")


def _check_phase_outputs(interface: ProgramInterface, phase: str, outputs: Any, where: str) -> Tuple[torch.Tensor, ...]:
    if phase in ("forward", "emit"):
        return _check_outputs(interface, outputs, where)
    if phase == "plan":
        assert interface.cadence is not None
        shape = (1, interface.cadence.length, interface.action_dim)
        if not isinstance(outputs, torch.Tensor) or tuple(outputs.shape) != shape or outputs.dtype != torch.float32:
            shown = f"{dtype_name(outputs.dtype)}{list(outputs.shape)}" if isinstance(outputs, torch.Tensor) \
                else type(outputs).__name__
            raise InterfaceError(f"{where} returns {shown}; it must return the chunk as float32{list(shape)}")
        return (outputs,)
    expected = [(f"new state {s.name!r}", (1, *s.shape), s.dtype) for s in interface.state]
    if not isinstance(outputs, (tuple, list)) or len(outputs) != len(expected) or any(
            not isinstance(v, torch.Tensor) or tuple(v.shape) != shape or v.dtype != dtype
            for (_, shape, dtype), v in zip(expected, outputs, strict=False)):
        raise InterfaceError(f"{where} must return the new state, a tuple of {len(expected)} tensors "
                             f"{[f'{dtype_name(d)}{list(sh)}' for _, sh, d in expected]}")
    return tuple(outputs)


def _trace(module: nn.Module, phase: str, args: List[torch.Tensor], where: str) -> torch.export.ExportedProgram:
    target = module if phase == "forward" else _Phase(module, phase).eval()
    try:
        program = torch.export.export(target, tuple(args))
    except Exception as exc:  # noqa: BLE001 - torch.export's own reason, shortened to one line
        reason = " ".join(str(exc).split())[:500]
        raise InterfaceError(f"torch.export cannot trace {where}.{phase}: {type(exc).__name__}: {reason}") from None
    program = functional(program)
    signature = program.graph_signature
    if signature.buffers_to_mutate or signature.user_inputs_to_mutate:
        written = sorted({*signature.buffers_to_mutate.values(), *signature.user_inputs_to_mutate.values()})
        raise InterfaceError(f"{where}.{phase} writes {written} in place: state kept between steps must be "
                             "declared in state and returned as new state")
    return program


def export_module(module: nn.Module, path: Path, *, check_steps: int = 8,
                  source: Optional[Mapping[str, Any]] = None) -> ExportReport:
    """Export ``module`` to ``path`` (see the module docstring)."""
    where = f"module {type(module).__name__}"
    module = module.cpu().eval()
    interface = interface_of(module)
    samples = _sample_args(interface, module)
    for phase, args in samples.items():
        _check_pure(module, interface, phase, args, where)
    programs = {phase: _trace(module, phase, args, where) for phase, args in samples.items()}
    mismatch = _compare(programs, module, interface, check_steps)
    extra = {METADATA_FILE: interface.to_json(source or {})}
    for phase in ("observe", "emit"):
        if phase in programs:
            buffer = io.BytesIO()
            torch.export.save(programs[phase], buffer)
            extra[PHASE_FILE.format(phase)] = base64.b64encode(buffer.getvalue()).decode()
    archive = io.BytesIO()       # in memory: torch's zip writer aborts the process on a failed file write
    torch.export.save(programs.get("forward") or programs["plan"], archive, extra_files=extra)
    data = archive.getvalue()
    write_file(Path(path), data)
    return ExportReport(Path(path), hashlib.sha256(data).hexdigest(), len(data), interface, check_steps, mismatch)


def _compare(programs: Mapping[str, torch.export.ExportedProgram], module: nn.Module, interface: ProgramInterface,
             steps: int) -> Optional[str]:
    """Run the programs and the module side by side from the initial state on seeded random
    inputs (a chunking module: its own loop, a chunk planned every ``horizon`` steps);
    None when every output agrees bit for bit, else where and by how much not."""
    traced = {phase: program.module() for phase, program in programs.items()}
    own = {phase: (module if phase == "forward" else getattr(module, phase)) for phase in programs}
    generator = torch.Generator().manual_seed(1)
    state_a = state_b = _initial(interface, module)
    chunk_a = chunk_b = None
    names = [s.name for s in (*interface.inputs, *interface.state)]
    with torch.no_grad():
        for step in range(steps):
            inputs = _random_inputs(interface, generator)
            if interface.cadence is None:
                out_a, out_b = own["forward"](*inputs, *state_a), traced["forward"](*inputs, *state_b)
            else:
                cadence = interface.cadence
                state_a = list(own["observe"](*inputs, *state_a))
                state_b = list(traced["observe"](*inputs, *state_b))
                cursor = step % cadence.horizon
                if cursor == 0:
                    values_a = dict(zip(names, [*inputs, *state_a], strict=True))
                    values_b = dict(zip(names, [*inputs, *state_b], strict=True))
                    chunk_a = own["plan"](*(values_a[r] for r in cadence.reads))
                    chunk_b = traced["plan"](*(values_b[r] for r in cadence.reads))
                assert chunk_a is not None and chunk_b is not None
                rows = torch.clamp(cursor + torch.arange(interface.chunk_horizon), max=cadence.horizon - 1)
                out_a = own["emit"](chunk_a[:, cursor], chunk_a[:, rows], *state_a)
                out_b = traced["emit"](chunk_b[:, cursor], chunk_b[:, rows], *state_b)
            if not _same(out_a, out_b):
                worst = max(float((x.double() - y.double()).abs().max()) for x, y in zip(out_a, out_b, strict=True))
                return f"at step {step + 1} by at most {worst:.3g}"
            state_a, state_b = list(out_a[2:]), list(out_b[2:])
    return None
