"""``policy.kind: exported``: a ``torch.export`` program (``.pt2``, written by
``capsule-ros export``) served like any policy, with no Python model code.

The program keeps the export interface (``capsule_ros.policies.export``): batch first,
traced at batch size 1,

    program(*inputs, *state) -> (action [1, A], chunk [1, H, A], *new_state)

and the archive carries ``METADATA_FILE`` (torch.export.save's ``extra_files``): the
inputs and the state buffers (name, shape without the batch dimension, dtype, kind, and
how each starts an episode), ``action_dim`` and ``chunk_horizon``.

A chunking module (one with a ``cadence``, ``capsule_ros.policies.phases``) is exported as
its three phases instead: the archive's program is ``plan`` (the network), and
``observe`` / ``emit`` travel as two more ``.pt2`` archives inside it (``PHASE_FILE``,
base64), each checked exactly as the main one; the metadata (version 2) holds the
cadence. Served, the runtime runs the network only when a chunk is due. Served:

- the inputs bind to the node's ports by name, shape and dtype, checked from the
  metadata alone before the program is loaded, with errors that name the mismatch
  (``RULES``, the interface in the binding vocabulary of ``capsule_ros.policies.binding``);
- the state lives in the arena: each step calls the program on views of the buffers and
  copies the new state back in place, so a capsule is still one copy of the arena, and
  the step (program and copies) is captured as one CUDA graph on a GPU;
- the capsule fingerprint covers the file's SHA-256 (``architecture()``).

No arbitrary unpickling. ``torch.export.load`` (torch 2.13) reads plain tensors as raw
bytes, but hands three kinds of payload to the full unpickler: tensor subclasses and
custom or opaque objects among the weights and constants, and the sample inputs when
the restricted (weights-only) unpickler refuses them. ``read_program`` refuses a file
with any of the first kind and loads the sample inputs with the restricted unpickler
itself first, so torch's fallback to the full one never runs; the file is read once, so
what was checked is what is loaded.
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Type

import torch

from capsule_ros.chunking.reference import chunked_step
from capsule_ros.config import ConfigSection, setting
from capsule_ros.errors import ConfigError
from capsule_ros.policies.binding import (
    AS_IS,
    BindingRules,
    Count,
    Report,
    Requirement,
    Role,
    RoleRule,
    Tensor,
    Wording,
    bind,
    examine,
    ports_of,
    unmet,
)
from capsule_ros.policies.phases import ModuleSteps
from capsule_ros.policies.registry import BuildContext, PolicyKind
from capsule_ros.runtime.arena import STATE_KINDS, BufferKind, BufferSpec, dtype_from_name, dtype_name
from capsule_ros.runtime.policy import (
    ACTION,
    CHUNK,
    CHUNK_ACTIONS,
    CHUNK_CURSOR,
    CHUNK_PENDING,
    EPISODE,
    POSITION,
    RNG,
    STEP,
    ChunkCadence,
    State,
    StatefulPolicy,
    chunk_specs,
    standard_specs,
)

METADATA_FILE = "capsule_ros.json"       # in the archive's extra/ directory
PHASE_FILE = "capsule_ros.{}.pt2.b64"    # a chunking program's observe / emit programs, in extra/
FORMAT = "capsule_ros.exported"
VERSION = 2                              # 1: no cadence (still read)
PHASES = ("observe", "plan", "emit")
INIT_RULES = ("zeros", "seed", "values")  # a state buffer at reset: zeros, (seed, 0) for rng, stored values
MAX_INITIAL_BYTES = 64 * 2**20            # stored initial values, all buffers together (the rest start at 0)
RESERVED = (STEP, POSITION, EPISODE, ACTION, CHUNK, CHUNK_ACTIONS, CHUNK_CURSOR, CHUNK_PENDING)  # the runtime's
STATE_KIND_NAMES = tuple(k.value for k in STATE_KINDS)

# The interface in the binding vocabulary: each input is fed by the port of its name as it
# is; the state is carried, ``rng`` the runtime's generator. Every problem is reported.
RULES = BindingRules(
    roles=(
        RoleRule(Role.RNG, labels=("state",), names=(RNG,), kinds=STATE_KIND_NAMES, shape=(2,), dtypes=(torch.int64,),
                 wrong_type=f"state {RNG!r} is the counter-based generator: it must be int64[2], not "
                            "{dtype}{shape}"),
        RoleRule(Role.OBSERVATION, labels=("input",), count=Count.SOME, kinds=(BufferKind.INPUT.value,), feed=AS_IS),
        RoleRule(Role.STATE, labels=("state",), kinds=STATE_KIND_NAMES),
    ),
    reserved=RESERVED, unique=True, report=Report.ALL,
    wording=Wording(
        empty="inputs is empty (one entry per port the policy reads)",
        wrong_kind="{label} {key!r} has kind {kind} (must be {kinds})",
        twice="name {key!r} is used twice",
        reserved="name {key!r} is a standard buffer the runtime writes ({reserved})",
        wrong_label="{key!r} must be {labels}, not an {label}",
        port_undeclared="no port for its input {key!r} {want_dtype}{want_shape} (add it to ports.names)",
        port_unused="port {port!r} is not one of its inputs (remove it from ports.names)",
        port_mismatch="ports.{port} is {have_dtype}{have_shape}, its input {key!r} is {want_dtype}{want_shape} "
                      "(set ports.{port}.shape / dtype to match)"),
)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


SIZES = (Requirement(lambda i: _positive_int(i.action_dim), lambda i: f"action_dim = {i.action_dim!r} must be a "
                                                                       "positive int"),
         Requirement(lambda i: _positive_int(i.chunk_horizon), lambda i: f"chunk_horizon = {i.chunk_horizon!r} must be "
                                                                          "a positive int"))


class ProgramError(ConfigError):
    """An exported program that cannot be served; the message names the file and what to change."""


@dataclass(frozen=True)
class ProgramInterface:
    """What a program takes and returns (shapes without the batch dimension) and how its
    state starts an episode: ``initial`` holds the buffers that do not start at zero
    (``rng``, the counter-based generator, is seeded by the runtime instead)."""

    inputs: Tuple[BufferSpec, ...]
    state: Tuple[BufferSpec, ...]
    action_dim: int
    chunk_horizon: int
    initial: Mapping[str, torch.Tensor] = field(default_factory=dict)
    cadence: Optional[ChunkCadence] = None     # a chunking program (exported as its phases)

    def tensors(self) -> List[Tensor]:
        """The inputs and the state in the binding vocabulary (labelled by their group)."""
        return ([Tensor.of(s, label="input", kind=s.kind.value) for s in self.inputs]
                + [Tensor.of(s, label="state", kind=s.kind.value) for s in self.state])

    def check(self, error: Type[ConfigError], where: str) -> None:
        """Raise ``error`` naming ``where`` and every rule of the module docstring the interface breaks."""
        _, problems = examine(RULES, inputs=self.tensors())
        problems = unmet(SIZES, self) + problems + [
            f"initial value of {name!r} ({dtype_name(value.dtype)}{list(value.shape)}) does not fit a state buffer"
            for name, value in self.initial.items() if not self._fits_state(name, value)]
        unknown = [] if self.cadence is None else [r for r in self.cadence.reads if r not in self.names()]
        if unknown:
            problems.append(f"cadence reads {unknown}, which are neither inputs nor state")
        if problems:
            raise error(f"{where}: {'; '.join(problems)}")

    def names(self) -> List[str]:
        return [s.name for s in (*self.inputs, *self.state)]

    def _fits_state(self, name: str, value: torch.Tensor) -> bool:
        spec = next((s for s in self.state if s.name == name), None)
        return spec is not None and tuple(value.shape) == spec.shape and value.dtype == spec.dtype

    def init_rule(self, name: str) -> str:
        return "seed" if name == RNG else "values" if name in self.initial else "zeros"

    # -- the metadata file ---------------------------------------------------------------------
    def to_json(self, source: Mapping[str, Any]) -> str:
        state = []
        for spec in self.state:
            entry = {**_spec_json(spec), "kind": spec.kind.value, "init": self.init_rule(spec.name)}
            if entry["init"] == "values":
                entry["values"] = base64.b64encode(_raw_bytes(self.initial[spec.name])).decode()
            state.append(entry)
        meta = {"format": FORMAT, "version": VERSION if self.cadence is not None else 1, "batch": 1,
                "action_dim": self.action_dim, "chunk_horizon": self.chunk_horizon,
                "inputs": [_spec_json(s) for s in self.inputs], "state": state, "source": dict(source),
                "torch": torch.__version__}
        if self.cadence is not None:
            c = self.cadence
            meta["cadence"] = {"length": c.length, "horizon": c.horizon, "reads": list(c.reads),
                               "inputs_every_step": c.inputs_every_step}
        return json.dumps(meta, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str) -> ProgramInterface:
        """Parse and validate a metadata file; ProgramError naming ``where`` otherwise."""
        try:
            meta = json.loads(text)
            if meta.get("format") != FORMAT or meta.get("version") not in (1, VERSION) or meta.get("batch") != 1:
                raise ValueError(f"format {meta.get('format')!r} version {meta.get('version')!r} batch "
                                 f"{meta.get('batch')!r}, expected {FORMAT!r} version 1 or {VERSION}, batch 1")
            cadence = None
            if "cadence" in meta:
                c = meta["cadence"]
                if meta["version"] < 2 or sorted(c) != ["horizon", "inputs_every_step", "length", "reads"]:
                    raise ValueError(f"cadence {c!r} (version 2 metadata: length, horizon, reads, inputs_every_step)")
                cadence = ChunkCadence(int(c["length"]), int(c["horizon"]), tuple(str(r) for r in c["reads"]),
                                       bool(c["inputs_every_step"]))
            inputs = tuple(_spec_from_json(e, BufferKind.INPUT) for e in meta["inputs"])
            state, initial, stored = [], {}, 0
            for entry in meta["state"]:
                spec = _spec_from_json(entry, BufferKind(entry["kind"]))
                if entry["init"] not in INIT_RULES or (entry["init"] == "seed") != (spec.name == RNG):
                    raise ValueError(f"state {spec.name!r}: init {entry['init']!r} (one of {INIT_RULES}; 'seed' "
                                     f"for {RNG!r} only, and always)")
                if entry["init"] == "values":
                    raw = base64.b64decode(entry["values"], validate=True)
                    stored += len(raw)
                    if len(raw) != spec.nbytes or stored > MAX_INITIAL_BYTES:
                        raise ValueError(f"state {spec.name!r}: {len(raw)} bytes of initial values for "
                                         f"{spec.nbytes} bytes ({stored} stored in all, at most "
                                         f"{MAX_INITIAL_BYTES})")
                    initial[spec.name] = torch.frombuffer(bytearray(raw), dtype=spec.dtype).reshape(spec.shape)
                state.append(spec)
            interface = cls(inputs, tuple(state), meta["action_dim"], meta["chunk_horizon"], initial, cadence)
        except (ValueError, KeyError, TypeError) as exc:
            raise ProgramError(f"{where}: its capsule_ros metadata is not valid ({type(exc).__name__}: {exc}); "
                               "write the file with `capsule-ros export`") from None
        interface.check(ProgramError, where)
        return interface

    def describe(self) -> str:
        def show(specs):
            return ", ".join(f"{s.name} {dtype_name(s.dtype)}{list(s.shape)}" for s in specs)
        chunked = "" if self.cadence is None else (f"; chunks of {self.cadence.length}, {self.cadence.horizon} "
                                                    f"executed, planned from {list(self.cadence.reads)}")
        return (f"inputs {show(self.inputs)}; state {show(self.state)}; action_dim {self.action_dim}, "
                f"chunk_horizon {self.chunk_horizon}{chunked}")

    def phase_specs(self, phase: str) -> Tuple[List[Tuple[str, Tuple[int, ...], torch.dtype]], int]:
        """What a program takes, (name, shape with the batch, dtype) each, and how many
        tensors it returns: ``forward`` or a chunking program's ``observe``/``plan``/``emit``."""
        def batched(specs):
            return [(s.name, (1, *s.shape), s.dtype) for s in specs]
        by_name = {s.name: s for s in (*self.inputs, *self.state)}
        if phase == "forward":
            return batched((*self.inputs, *self.state)), 2 + len(self.state)
        if phase == "observe":
            return batched((*self.inputs, *self.state)), len(self.state)
        assert self.cadence is not None
        if phase == "plan":
            return batched([by_name[r] for r in self.cadence.reads]), 1
        rows = [("action", (1, self.action_dim), torch.float32),
                ("upcoming", (1, self.chunk_horizon, self.action_dim), torch.float32)]
        return rows + batched(self.state), 2 + len(self.state)


def _spec_json(spec: BufferSpec) -> dict:
    return {"name": spec.name, "shape": list(spec.shape), "dtype": dtype_name(spec.dtype)}


def _spec_from_json(entry: Mapping[str, Any], kind: BufferKind) -> BufferSpec:
    return BufferSpec(str(entry["name"]), tuple(int(d) for d in entry["shape"]), dtype_from_name(entry["dtype"]),
                      kind)


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    t = tensor.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


# --- reading a .pt2 -----------------------------------------------------------------------------

class _Archive:
    """The members of a PT2 archive by their path under its one root directory."""

    def __init__(self, source: Any, where: str):
        self.where = where
        try:
            self.zip = zipfile.ZipFile(source)
        except (OSError, zipfile.BadZipFile) as exc:
            raise ProgramError(f"{where}: {_not_a_zip(source)} ({exc})") from None
        names = self.zip.namelist()
        roots = {name.split("/", 1)[0] for name in names}
        if len(roots) != 1 or any("/" not in name for name in names):
            raise ProgramError(f"{where}: not a .pt2 archive of torch.export.save (entries outside one root folder)")
        root = roots.pop()
        self.members = {name[len(root) + 1:]: name for name in names}

    def read(self, member: str) -> bytes:
        if member not in self.members:
            raise ProgramError(f"{self.where}: the archive has no {member!r}; write it with `capsule-ros export`")
        try:
            return self.zip.read(self.members[member])
        except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
            raise ProgramError(f"{self.where}: the archive's {member!r} is damaged ({exc}); export it again") from None


def _not_a_zip(source: Any) -> str:
    """Why a file is no zip archive: one that starts as a zip but lacks the directory at
    its end was cut short (an interrupted copy), anything else is not a .pt2 at all."""
    try:
        if isinstance(source, io.BytesIO):
            head = source.getvalue()[:4]
        else:
            with open(source, "rb") as f:
                head = f.read(4)
    except OSError:
        head = b""
    return ("a .pt2 archive cut short: the file is truncated (no zip directory at its end)" if head == b"PK\x03\x04"
            else "not a .pt2 archive")


def read_interface(path: Path, where: str) -> ProgramInterface:
    """The interface in a .pt2's metadata, reading nothing else of the file."""
    if not path.is_file():
        raise ProgramError(f"{where}: no such file {path}")
    return ProgramInterface.from_json(_Archive(path, where).read(f"extra/{METADATA_FILE}").decode(), where)


def _check_payloads(archive: _Archive) -> None:
    """Refuse what torch.export.load would unpickle with the full unpickler (module docstring)."""
    where = archive.where
    if archive.read("archive_format").decode().strip() != "pt2":
        raise ProgramError(f"{where}: not a .pt2 archive of torch.export.save")
    models = sorted(m for m in archive.members if m.startswith("models/"))
    if models != ["models/model.json"]:
        raise ProgramError(f"{where}: holds {models}; capsule_ros serves one exported program ('model')")
    compiled = sorted(m for m in archive.members if m.startswith(("data/aotinductor/", "data/executorch/",
                                                                  "data/mtia", "xl_model_weights/")))
    legacy = [m for m in ("data/weights/model.pt", "data/constants/model.pt") if m in archive.members]
    if compiled or legacy:
        raise ProgramError(f"{where}: holds {compiled + legacy}, which torch.export.load would unpickle or run; "
                           "export the program again with `capsule-ros export` (plain tensors only)")
    for member, kind in (("data/weights/model_weights_config.json", "weight"),
                         ("data/constants/model_constants_config.json", "constant")):
        for name, payload in json.loads(archive.read(member))["config"].items():
            if payload.get("use_pickle", True) or (kind == "constant" and
                                                   not str(payload.get("path_name", "")).startswith("tensor_")):
                raise ProgramError(f"{where}: {kind} {name!r} is stored as a pickled object (a tensor subclass or "
                                   "a custom object), which capsule_ros does not load; export plain tensors")
    try:
        torch.load(io.BytesIO(archive.read("data/sample_inputs/model.pt")), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - anything the restricted unpickler refuses
        raise ProgramError(f"{where}: its sample inputs are not plain tensors ({type(exc).__name__}); torch would "
                           "load them with the full unpickler, capsule_ros does not") from None


def _load(data: bytes, where: str) -> torch.export.ExportedProgram:
    """One checked, functional program from the bytes of a .pt2 archive."""
    _check_payloads(_Archive(io.BytesIO(data), where))
    try:
        program = torch.export.load(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001 - a file torch cannot read: say so in one line
        raise ProgramError(f"{where}: torch.export.load fails ({type(exc).__name__}: {exc}); the file may come "
                           f"from another torch version (this is {torch.__version__}): export it again") from None
    return functional(program)


def read_program(path: Path, where: str) -> Tuple[Dict[str, torch.export.ExportedProgram], ProgramInterface, str]:
    """({phase: program}, interface, SHA-256 of the file) from a .pt2, checked as the module
    docstring says: ``forward``, or a chunking program's ``observe``, ``plan`` and ``emit``."""
    data = path.read_bytes()
    archive = _Archive(io.BytesIO(data), where)
    interface = ProgramInterface.from_json(archive.read(f"extra/{METADATA_FILE}").decode(), where)
    programs = {"forward" if interface.cadence is None else "plan": _load(data, where)}
    if interface.cadence is not None:
        for phase in ("observe", "emit"):
            try:
                nested = base64.b64decode(archive.read(f"extra/{PHASE_FILE.format(phase)}"), validate=True)
            except ValueError:
                raise ProgramError(f"{where}: its {phase} program is not base64; export it again") from None
            programs[phase] = _load(nested, f"{where} ({phase} program)")
    for phase, program in programs.items():
        _check_signature(program, interface, where, phase)
    return programs, interface, hashlib.sha256(data).hexdigest()


def functional(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """The program with every in-place operation made functional: torch.export's default
    graph keeps in-place writes (a buffer updated with ``add_``), and only a functional
    graph lists what it writes in its signature (``buffers_to_mutate``). No operation is
    decomposed (an empty table), so the arithmetic stays the module's."""
    mutable = any(node.op == "call_function" and getattr(getattr(node.target, "_schema", None), "is_mutable", False)
                  for node in program.graph.nodes)
    return program.run_decompositions({}) if mutable else program


def _check_signature(program: torch.export.ExportedProgram, interface: ProgramInterface, where: str,
                     phase: str = "forward") -> None:
    """The program's own signature must be the one its metadata describes for ``phase``,
    and it must keep nothing between calls (no buffer or input written in place)."""
    signature = program.graph_signature
    if signature.buffers_to_mutate or signature.user_inputs_to_mutate:
        raise ProgramError(f"{where}: the {phase} program writes {sorted(signature.buffers_to_mutate)} "
                           f"{sorted(signature.user_inputs_to_mutate)} in place: state kept between steps must be "
                           "returned as new_state, not written into buffers or inputs")
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    expected, outputs_expected = interface.phase_specs(phase)
    got = [placeholders[name].meta.get("val") for name in signature.user_inputs]
    outputs = len(signature.user_outputs)
    mismatched = [f"{name} is {'?' if val is None else f'{dtype_name(val.dtype)}{list(val.shape)}'} in the "
                  f"program, {dtype_name(dtype)}{list(shape)} in the metadata"
                  for (name, shape, dtype), val in zip(expected, got, strict=False)
                  if val is None or tuple(val.shape) != shape or val.dtype != dtype]
    if len(got) != len(expected) or outputs != outputs_expected or mismatched:
        raise ProgramError(f"{where}: the {phase} program takes {len(got)} tensors and returns {outputs}, its "
                           f"metadata says {len(expected)} and {outputs_expected} ({interface.describe()})"
                           + (f"; mismatched: {'; '.join(mismatched)}" if mismatched else "") + ": export it again")


def bind_inputs(interface: ProgramInterface, ports: Sequence[BufferSpec], where: str) -> None:
    """The node's ports must be the program's inputs: same names, shapes and dtypes (``RULES``)."""
    bind(RULES, inputs=interface.tensors(), ports=ports_of(ports), where=f"{where} does not fit the ports",
         error=ProgramError)


# --- the policy ---------------------------------------------------------------------------------

class ExportedPolicy(StatefulPolicy):
    """An exported program over the arena (see the module docstring)."""

    def __init__(self, programs: Mapping[str, torch.export.ExportedProgram], interface: ProgramInterface,
                 sha256: str):
        super().__init__()
        self.interface, self.sha256 = interface, sha256
        self.action_dim, self.chunk_horizon = interface.action_dim, interface.chunk_horizon
        self._exported = dict(programs)
        self._device = torch.device("cpu")
        self._bind()

    def _bind(self) -> None:
        """The phases' callables (``module()`` of each program) behind ``ModuleSteps``."""
        run = {phase: program.module() for phase, program in self._exported.items()}
        self.programs = run
        self.steps = ModuleSteps(self.interface.inputs, self.interface.state, forward=run.get("forward"),
                                 cadence=self.interface.cadence, observe=run.get("observe"), plan=run.get("plan"),
                                 emit=run.get("emit"))

    @classmethod
    def from_file(cls, path: Path, inputs: Optional[Sequence[BufferSpec]] = None,
                  where: Optional[str] = None) -> ExportedPolicy:
        """The policy of a .pt2; ``inputs`` (the ports) are checked against its metadata
        before the program is loaded."""
        path = Path(path).expanduser()
        where = where or f"exported program {path}"
        interface = read_interface(path, where)
        if inputs is not None:
            bind_inputs(interface, inputs, where)
        return cls(*read_program(path, where))

    def to(self, *args, **kwargs):
        """Move to a device like any module, and the programs' graphs with it: a traced
        graph names devices (e.g. of ``arange``), which torch.export's device pass rewrites."""
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None and torch.device(device) != self._device:
            from torch.export.passes import move_to_device_pass
            self._exported = {phase: move_to_device_pass(program, torch.device(device))
                              for phase, program in self._exported.items()}
            self._device = torch.device(device)
            self._bind()
        return super().to(*args, **kwargs)

    def train(self, mode: bool = True):
        """Only this wrapper's flag: a traced program has no modes (torch refuses train())."""
        self.training = mode
        return self

    def architecture(self) -> dict:
        return {"policy": "exported", "program_sha256": self.sha256, "action_dim": self.action_dim,
                "chunk_horizon": self.chunk_horizon,
                "inputs": [_spec_json(s) for s in self.interface.inputs],
                "state": [{**_spec_json(s), "kind": s.kind.value} for s in self.interface.state]}

    def cadence(self) -> Optional[ChunkCadence]:
        return self.interface.cadence

    def state_spec(self) -> List[BufferSpec]:
        own = [s for s in self.interface.state if s.name != RNG]     # rng is the standard buffer
        specs = [*self.interface.inputs, *own, *standard_specs(self.action_dim, self.chunk_horizon)]
        cadence = self.interface.cadence
        if cadence is not None:
            by_name = {s.name: s for s in specs}
            specs += chunk_specs(cadence.length, self.action_dim, [by_name[r] for r in cadence.reads])
        return specs

    def init_state(self, state: State, *, episode: int, seed: int) -> None:
        inputs = {s.name for s in self.interface.inputs}
        for name, view in state.items():
            if name not in inputs:
                view.zero_()
        for name, value in self.interface.initial.items():
            state[name].copy_(value)
        state[EPISODE].fill_(episode)
        state[RNG][0] = seed & 0xFFFFFFFF

    def observe(self, state: State) -> None:
        self.steps.observe(state)

    def plan(self, state: State, chunk: torch.Tensor) -> None:
        self.steps.plan(state, chunk)

    def emit(self, state: State, action: torch.Tensor, upcoming: torch.Tensor) -> None:
        self.steps.emit(state, action, upcoming)

    def step(self, state: State) -> None:
        if self.interface.cadence is not None:
            chunked_step(self, state, self.interface.cadence.horizon)
        else:
            self.steps.step(state)


# --- the kind -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExportedConfig(ConfigSection):
    """A torch.export program written by `capsule-ros export` (docs/bring-your-own-policy.md)."""

    SECTION = "policy.exported"

    program: str = setting("", "the .pt2 file `capsule-ros export` wrote; its inputs must be the ports (names, "
                           "shapes, dtypes); its SHA-256 is part of the capsule fingerprint", read_only=True)

    def check(self) -> None:
        if not self.program:
            raise ConfigError(f"{self.SECTION}.program: must name a .pt2 file written by `capsule-ros export`")


def _build(context: BuildContext) -> ExportedPolicy:
    settings = context.settings
    assert isinstance(settings, ExportedConfig)
    if context.weights is not None:
        raise ConfigError(f"policy.weights names {context.weights}: an exported program carries its own weights; "
                          "set policy.weights: '' with policy.kind: exported")
    return ExportedPolicy.from_file(Path(settings.program), context.inputs,
                                    where=f"policy.exported.program = {settings.program!r}")


POLICY_KIND = PolicyKind("exported", ExportedConfig, _build,
                         "a torch.export program (.pt2) written by `capsule-ros export`; its state lives in the arena")

