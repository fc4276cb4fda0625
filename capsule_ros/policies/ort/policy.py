"""``OnnxPolicy``: an ONNX model run by ONNX Runtime over the arena.

Buffers (``state_spec``), besides the ports' inputs and the standard ones:

| buffer | kind | what |
| --- | --- | --- |
| ``onnx.<state input>`` | recurrent | each state the model takes (``onnx.h_in``, ``onnx.c_in``) |
| ``onnx.<state output>`` | recurrent | where a returned state lands (``onnx.h_out``), unless written in place |
| ``onnx.<action output>`` | recurrent | the model's raw action: the ``last_action`` observation term of the next step |
| ``onnx.<episode start>`` | meta | the episode-start flag, 1 until the first step of an episode has run |
| ``onnx.<observation input>`` | output | the observation the model saw at this step |
| ``onnx.<other output>`` | output | any other output of the model |

``action`` is the raw action scaled and offset to joint targets (``raw * scale + offset``,
then clipped; Isaac Lab's joint position action), ``chunk`` the same as one row.

A step, all in place and allocating nothing: the observation terms write the observation
buffer (``observations.assembler``); ONNX Runtime runs through an IO binding in which every
input and output is an arena buffer (bound once per arena, by address); the state
outputs that are not written in place move into their inputs with one copy (of one
contiguous byte range when they lie that way, which the layout arranges); the raw action
becomes ``action`` and ``chunk``; the episode-start flag is cleared; ``step`` and
``position`` advance. Everything but the run is a few element-wise operations on small
vectors, done with numpy over a CPU arena and with torch over a CUDA one
(``capsule_ros.policies.ort.arrays``: the same bits either way).

In place. A state output is bound straight to its input's buffer when ONNX Runtime's own
optimised graph shows that every node reading the input runs before the node writing the
output (``model.in_place_safe``); a model whose state output comes straight out of the
node that reads the state (an LSTM's ``Y_h``) gets one copy. Only on the CPU provider,
whose optimised graph is what was analysed at configure.

CUDA (``onnxruntime-gpu``; the package here is the CPU build). One session per arena, on
the runtime's own CUDA stream (``user_compute_stream``), so the observation terms, the run
and the copies are ordered without a host synchronisation; with ``cuda_graph`` ONNX
Runtime captures the run as a CUDA graph itself (torch's capture does not see its
kernels: ``torch_graph_capture = False``). ONNX Runtime runs a captured session twice
before it captures (issue 32243 of onnxruntime): with the state bound, those runs would
advance it, so every bound buffer is saved before and put back after. A model with
control flow, or a capture that fails, is served without a graph with a warning
(``cuda_graph: auto``) or refused (``on``). State outputs are always copied on CUDA.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from capsule_ros.errors import ConfigError
from capsule_ros.policies.ort.arrays import ArrayOps, ops_for
from capsule_ros.policies.ort.interface import ModelRoles, StatePair, buffer_name
from capsule_ros.policies.ort.model import OnnxModel, OnnxModelError, in_place_safe, onnxruntime_reason
from capsule_ros.policies.ort.observations import ObservationPlan, assembler, constant_tensors
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.policy import (
    ACTION,
    CHUNK,
    EPISODE,
    POSITION,
    RNG,
    STEP,
    State,
    StatefulPolicy,
    standard_specs,
)

LOG = logging.getLogger(__name__)

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
OPTIMIZATION = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
                "all": "ORT_ENABLE_ALL"}
CAPTURE_RUNS = 3          # ONNX Runtime's CUDA provider runs twice, then captures (and replays) on the third


@dataclass(frozen=True)
class SessionSettings:
    """How ONNX Runtime runs the model (policy.onnx.*)."""

    provider: str              # cpu | cuda
    optimization: str          # disable | basic | extended | all
    threads: int               # intra-op threads (0: ONNX Runtime's default)
    cuda_graph: str            # auto | on | off
    dims: Tuple[Tuple[str, int], ...] = ()

    def options(self, ort: Any):
        options = ort.SessionOptions()
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPTIMIZATION[self.optimization])
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL       # nodes in one topological order
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.use_deterministic_compute = True
        options.log_severity_level = 4                  # fatal only: errors reach us as exceptions (open_session)
        for name, value in self.dims:
            options.add_free_dimension_override_by_name(name, value)
        return options


@dataclass(frozen=True)
class ActionMap:
    """Raw action -> joint targets: ``raw * scale + offset``, then clamped to ``clip``."""

    scale: Tuple[float, ...]
    offset: Tuple[float, ...]
    clip: Tuple[float, float]

    def describe(self) -> dict:
        return {"scale": list(self.scale), "offset": list(self.offset), "clip": [str(v) for v in self.clip]}


def _ort():
    import onnxruntime
    return onnxruntime


class OnnxPolicy(StatefulPolicy):
    """An ONNX model over the arena (see the module docstring)."""

    torch_graph_capture = False       # ONNX Runtime's kernels run outside torch's capture

    def __init__(self, model: OnnxModel, roles: ModelRoles, observations: ObservationPlan, actions: ActionMap,
                 inputs: Sequence[BufferSpec], session: SessionSettings):
        super().__init__()
        self.model, self.roles, self.observations, self.actions = model, roles, observations, actions
        self.session_settings = session
        self.port_specs = tuple(inputs)
        self.action_dim, self.chunk_horizon = roles.action.numel, 1
        if observations.size != roles.observation.numel:
            terms = ", ".join(f"{t.text.split()[0]} {t.size}" for t in observations.terms)
            raise OnnxModelError(f"{model.where}: the observation terms make {observations.size} values ({terms}), "
                                 f"the model's observation input {roles.observation.describe()} takes "
                                 f"{roles.observation.numel}")
        for name, value in constant_tensors(observations).items():
            self.register_buffer(f"obs_{name}", value, persistent=False)
        self.register_buffer("action_scale", torch.tensor(actions.scale, dtype=torch.float32), persistent=False)
        self.register_buffer("action_offset", torch.tensor(actions.offset, dtype=torch.float32), persistent=False)
        self.register_buffer("action_low", torch.tensor(actions.clip[0], dtype=torch.float32), persistent=False)
        self.register_buffer("action_high", torch.tensor(actions.clip[1], dtype=torch.float32), persistent=False)
        self._cpu_session = None
        self._bindings: Dict[int, _Binding] = {}
        if session.provider == "cpu":
            self._cpu_session = self._new_session("cpu", None, graph=False)

    # -- the contract ---------------------------------------------------------------------------
    def architecture(self) -> dict:
        s = self.session_settings
        return {"policy": "onnx", "model_sha256": self.model.sha256, "onnxruntime": _ort().__version__,
                "execution_provider": PROVIDERS[s.provider], "optimization": s.optimization,
                "intra_op_threads": s.threads, "cuda_graph": s.cuda_graph if s.provider == "cuda" else "off",
                "dims": [list(d) for d in s.dims], "roles": self.roles.describe(),
                "observations": self.observations.describe(), "actions": self.actions.describe(),
                "ports": [{"name": p.name, "shape": list(p.shape)} for p in self.port_specs]}

    def state_spec(self) -> List[BufferSpec]:
        def spec(tensor, kind):
            return BufferSpec(buffer_name(tensor.name), tensor.shape, tensor.dtype, kind)
        copied = [p for p in self.roles.pairs if not p.in_place]
        specs = [*self.port_specs]
        specs += [spec(p.input, BufferKind.RECURRENT) for p in copied]            # copied back in one range
        specs += [spec(p.output, BufferKind.RECURRENT) for p in copied]
        specs += [spec(p.input, BufferKind.RECURRENT) for p in self.roles.pairs if p.in_place]
        specs.append(spec(self.roles.action, BufferKind.RECURRENT))              # the last action
        if self.roles.episode_start is not None:
            specs.append(spec(self.roles.episode_start, BufferKind.META))
        specs.append(spec(self.roles.observation, BufferKind.OUTPUT))
        specs += [spec(t, BufferKind.OUTPUT) for t in self.roles.extra_outputs]
        return specs + standard_specs(self.action_dim, self.chunk_horizon)

    def init_state(self, state: State, *, episode: int, seed: int) -> None:
        ports = {p.name for p in self.port_specs}
        for name, view in state.items():
            if name not in ports:
                view.zero_()
        if self.roles.episode_start is not None:
            state[buffer_name(self.roles.episode_start.name)].fill_(1)
        state[EPISODE].fill_(episode)
        state[RNG][0] = seed & 0xFFFFFFFF

    def step(self, state: State) -> None:
        binding = self._bindings.get(state[ACTION].data_ptr())
        if binding is None:
            binding = self._bind(state)
        binding.step()

    def to(self, *args, **kwargs):
        """Like any module; a device the execution provider cannot serve is refused here,
        before an arena is made on it."""
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            kind = torch.device(device).type
            provider = self.session_settings.provider
            if kind != provider:
                raise ConfigError(f"{self.model.where}: policy.onnx.execution_provider is {provider!r} but the runtime "
                                  f"is on {kind}: set runtime.device: {provider}"
                                  + (" (or execution_provider: cuda, with onnxruntime-gpu installed)"
                                     if kind == "cuda" else ""))
        return super().to(*args, **kwargs)

    # -- sessions and bindings -------------------------------------------------------------------
    def _new_session(self, device_type: str, stream: Optional[int], *, graph: bool, device_id: int = 0):
        ort = _ort()
        options = self.session_settings.options(ort)
        if device_type == "cpu":
            providers: list = ["CPUExecutionProvider"]
        else:
            cuda = {"device_id": str(device_id), "enable_cuda_graph": "1" if graph else "0"}
            if stream is not None:
                cuda.update(user_compute_stream=str(stream), has_user_compute_stream="1")
            providers = [("CUDAExecutionProvider", cuda)]
        session = open_session(ort, self.model, options, providers, PROVIDERS[device_type])
        if session.get_providers()[0] != PROVIDERS[device_type]:
            raise OnnxModelError(f"{self.model.where}: ONNX Runtime runs it on {session.get_providers()}, not "
                                 f"{PROVIDERS[device_type]}")
        return session

    def _bind(self, state: State) -> _Binding:
        device = state[ACTION].device
        if device.type == "cpu":
            binding = _Binding(self, state, self._cpu_session, ("cpu", 0), None)
        else:
            binding = self._bind_cuda(state, device)
        self._bindings[state[ACTION].data_ptr()] = binding
        return binding

    def _bind_cuda(self, state: State, device: torch.device) -> _Binding:
        """A session on the runtime's stream, captured as a CUDA graph where it can be
        (with the state saved around the capture runs: onnxruntime issue 32243)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(device)
        mode = self.session_settings.cuda_graph
        graph, reason = cuda_graph_choice(self.model, mode)
        if graph:
            try:
                binding = _Binding(self, state, self._new_session("cuda", stream.cuda_stream, graph=True,
                                                                  device_id=index), ("cuda", index), stream)
                saved = [view.clone() for view in state.values()]
                try:
                    for _ in range(CAPTURE_RUNS):
                        binding.run()
                    stream.synchronize()
                finally:
                    for view, value in zip(state.values(), saved, strict=True):
                        view.copy_(value)
                LOG.info("ONNX Runtime captured the model as a CUDA graph")
                return binding
            except Exception as exc:  # noqa: BLE001 - a model the CUDA graph cannot take
                if mode == "on":
                    raise OnnxModelError(f"{self.model.where}: ONNX Runtime cannot capture it as a CUDA graph "
                                         f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); set "
                                         "policy.onnx.cuda_graph: auto to serve it without one") from None
                reason = f"ONNX Runtime cannot capture it ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
        if reason:
            LOG.warning("%s: served without a CUDA graph (slower): %s", self.model.where, reason)
        return _Binding(self, state, self._new_session("cuda", stream.cuda_stream, graph=False, device_id=index),
                        ("cuda", index), stream)


def cuda_graph_choice(model: OnnxModel, mode: str) -> Tuple[bool, str]:
    """(capture a CUDA graph?, why not) for ``policy.onnx.cuda_graph`` = ``mode``: a model
    with control flow cannot be captured, which ``on`` refuses (OnnxModelError with the
    reason) and ``auto`` serves without a graph (the reason is logged as a warning)."""
    reason = f"the model has control flow ({', '.join(model.control_flow[:3])})" if model.control_flow else ""
    if reason and mode == "on":
        raise OnnxModelError(f"{model.where}: policy.onnx.cuda_graph is 'on' but {reason}, which a CUDA graph cannot "
                             "take; set cuda_graph: auto to serve it without one")
    return mode != "off" and not reason, reason


class _Binding:
    """One arena bound to one session: the IO binding and every view a step touches, made once."""

    def __init__(self, policy: OnnxPolicy, state: State, session: Any, device: Tuple[str, int], stream: Any):
        ort = _ort()
        roles = policy.roles
        self.session, self.io = session, session.io_binding()
        self.run_options = ort.RunOptions()
        # the CUDA graph id, set to ONNX Runtime's default: when it is unset, its Python
        # run_with_iobinding looks it up through an exception (docs/benchmarks.md, "ONNX Runtime's run option")
        self.run_options.add_run_config_entry("gpu_graph_id", "0")
        if device[0] == "cuda":          # the runtime's stream orders what follows; no host synchronisation
            self.run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")

        def bind(method: Callable, tensor, view: torch.Tensor) -> None:
            method(tensor.name, device[0], device[1], _numpy_dtype(view.dtype), list(tensor.shape), view.data_ptr())

        view = {name: state[buffer_name(name)] for name in
                [roles.observation.name, roles.action.name, *[p.input.name for p in roles.pairs],
                 *[p.output.name for p in roles.pairs if not p.in_place], *[t.name for t in roles.extra_outputs],
                 *([roles.episode_start.name] if roles.episode_start is not None else [])]}
        bind(self.io.bind_input, roles.observation, view[roles.observation.name])
        if roles.episode_start is not None:
            bind(self.io.bind_input, roles.episode_start, view[roles.episode_start.name])
        for pair in roles.pairs:
            bind(self.io.bind_input, pair.input, view[pair.input.name])
            bind(self.io.bind_output, pair.output, view[(pair.input if pair.in_place else pair.output).name])
        bind(self.io.bind_output, roles.action, view[roles.action.name])
        for tensor in roles.extra_outputs:
            bind(self.io.bind_output, tensor, view[tensor.name])
        ops = self.ops = ops_for(torch.device(device[0]))
        raw = view[roles.action.name].reshape(-1)
        constants = {name: getattr(policy, f"obs_{name}") for name in
                     ("offset", "low", "high", "scale", "gravity_factors", "gravity_coefficients", "one")}
        self.assemble = assembler(policy.observations, state, view[roles.observation.name], raw, constants, ops)
        self.copies = [(ops.array(target), ops.array(source))
                       for target, source in _copies([p for p in roles.pairs if not p.in_place], view)]
        self.act = _action_map(policy, raw, state[ACTION], state[CHUNK].reshape(-1), ops)
        self.episode_start = (ops.array(view[roles.episode_start.name]) if roles.episode_start is not None
                              else None)
        self.counters = [ops.array(state[STEP]), ops.array(state[POSITION])]

    def run(self) -> None:
        self.session.run_with_iobinding(self.io, self.run_options)

    def step(self) -> None:
        """The step of the module docstring, in its order."""
        ops = self.ops
        self.assemble()
        self.run()
        for target, source in self.copies:
            ops.copy(target, source)
        self.act()
        if self.episode_start is not None:
            ops.fill(self.episode_start, 0)
        ops.increment(self.counters)                                   # step and position


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty((), dtype=dtype).numpy().dtype


def _copies(pairs: List[StatePair], view: Dict[str, torch.Tensor]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(target, source) copies moving the state outputs into their inputs: one copy of
    one byte range when the outputs lie in the arena as the inputs do (state_spec orders
    them so), one per pair otherwise."""
    if not pairs:
        return []
    inputs = [view[p.input.name] for p in pairs]
    outputs = [view[p.output.name] for p in pairs]
    whole = torch.empty(0, dtype=torch.uint8, device=inputs[0].device).set_(inputs[0].untyped_storage())
    base = whole.data_ptr()

    def span(views):
        start = views[0].data_ptr() - base
        return start, [v.data_ptr() - base - start for v in views], views[-1].data_ptr() - base + _nbytes(views[-1])
    in_start, in_offsets, in_end = span(inputs)
    out_start, out_offsets, out_end = span(outputs)
    if in_offsets == out_offsets and in_end - in_start == out_end - out_start:
        return [(whole[in_start:in_end], whole[out_start:out_end])]
    return list(zip(inputs, outputs, strict=True))


def _nbytes(view: torch.Tensor) -> int:
    return view.numel() * view.element_size()


def _action_map(policy: OnnxPolicy, raw_view: torch.Tensor, action_view: torch.Tensor, chunk_view: torch.Tensor,
                ops: ArrayOps) -> Callable[[], None]:
    """The joint targets of the raw action, into ``action`` and ``chunk`` (ActionMap), with ``ops``."""
    actions = policy.actions
    raw, action, chunk = (ops.array(v) for v in (raw_view, action_view, chunk_view))
    scale, offset, low, high = (ops.array(getattr(policy, f"action_{name}"))
                                for name in ("scale", "offset", "low", "high"))
    scaled = any(s != 1.0 for s in actions.scale)
    offset_used = any(o != 0.0 for o in actions.offset)
    raise_to_low, lower_to_high = math.isfinite(actions.clip[0]), math.isfinite(actions.clip[1])

    def act() -> None:
        if scaled:
            ops.mul(raw, scale, out=action)
        else:
            ops.copy(action, raw)
        if offset_used:
            ops.add(action, offset, out=action)
        if raise_to_low:
            ops.maximum(action, low, out=action)
        if lower_to_high:
            ops.minimum(action, high, out=action)
        ops.copy(chunk, action)
    return act


def open_session(ort: Any, model: OnnxModel, options: Any, providers: list, provider: str) -> Any:
    """An ``InferenceSession`` of the model; OnnxModelError with ONNX Runtime's reason in
    one line (``onnxruntime_reason``) when it cannot be made. ONNX Runtime logs nothing of
    its own (``SessionSettings.options``: fatal messages only) and falls back to no other
    provider (it would print an "EP Error" block on stdout): its full message is logged at
    DEBUG."""
    try:
        return ort.InferenceSession(str(model.path), sess_options=options, providers=providers, enable_fallback=0)
    except Exception as exc:  # noqa: BLE001 - ONNX Runtime's own reason, in one line
        LOG.debug("%s: ONNX Runtime on %s: %s", model.where, provider, exc)
        raise OnnxModelError(f"{model.where}: ONNX Runtime cannot load it on {provider}: "
                             f"{onnxruntime_reason(exc)}") from None


def decide_in_place(policy_model: OnnxModel, roles: ModelRoles, settings: SessionSettings,
                    binding: str) -> ModelRoles:
    """The roles with ``in_place`` set for every pair ONNX Runtime's optimised CPU graph
    allows (``model.in_place_safe``); unchanged on CUDA or with ``state_binding: copy``."""
    if binding == "copy" or settings.provider != "cpu" or not roles.pairs:
        return roles
    import tempfile
    from dataclasses import replace
    from pathlib import Path

    import onnx
    ort = _ort()
    with tempfile.TemporaryDirectory() as tmp:
        options = settings.options(ort)
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        open_session(ort, policy_model, options, ["CPUExecutionProvider"], "CPUExecutionProvider")
        try:
            graph = onnx.load(options.optimized_model_filepath, load_external_data=False).graph
        except Exception as exc:  # noqa: BLE001 - no analysis: every state is copied (always correct)
            LOG.info("%s: state outputs are copied (ONNX Runtime's optimised graph could not be read: %s)",
                     policy_model.where, " ".join(str(exc).split()))
            return roles
    pairs = tuple(replace(p, in_place=in_place_safe(graph, p.input.name, p.output.name)) for p in roles.pairs)
    LOG.info("%s: state %s", policy_model.where, ", ".join(
        f"{p.input.name} <- {p.output.name} {'in place' if p.in_place else 'by one copy'}" for p in pairs))
    return replace(roles, pairs=pairs)
