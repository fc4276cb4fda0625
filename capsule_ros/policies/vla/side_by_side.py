"""Independent calls run side by side on the GPU: a VLA's cameras through its vision tower, a
layer's query, key and value projections, an MLP's gate and up projections
(``encoder_layer``: a SigLIP-style vision layer written out with its projections side by side;
``gated_mlp``: a Llama / Gemma MLP with its gate and up projections side by side).

LeRobot runs such calls one after the other. At batch 1 their kernels leave most of an H100
idle (SmolVLA's SigLIP at 1,024 patches per camera, π0's at 256, the action expert's 50
tokens), so on CUDA each call runs on a side stream of its own, forked from the current stream
and joined back to it: in a captured graph these are parallel branches. Every kernel is the one
the sequential code launches, on the same inputs, so the bits are the same (the CUDA tests
``test_side_by_side_gives_the_sequential_bits_eagerly_and_captured`` and, for the policies,
``test_cuda_graph_programs_equal_the_eager_cuda_plan`` check it); on a CPU the calls run in
order.

Side streams belong to the instance (made on first use and kept, so that a capture finds the
cuBLAS workspaces its warm-up runs made); a deep copy (the start-up check's copy of a policy)
gets streams of its own. Calls nest (a camera's tower, on a side stream, runs its layers'
projections side by side): each stream has side streams of its own, so one branch's
projections never queue behind another branch's work.

A side stream has the priority of the stream it forks from. torch hands out streams
round-robin from a pool of 32 per priority, so a process that made more than 32 gets old ones
again, and cuBLAS keeps one workspace per stream, which a captured graph keeps using. The
control step's graphs (on the step's high-priority stream) and a refill's (on its
low-priority stream, ``capsule_ros.runtime.streams``) replay at the same time; with their
branches drawn from their own priority's pool, no branch of one is a stream of the other, so
the two never share a cuBLAS workspace.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

Call = Callable[[], torch.Tensor]


class SideBySide:
    """``run(calls, device)``: ``[call() for call in calls]``, on CUDA with each call on a side
    stream (module docstring); ``map(fn, inputs)``: ``fn`` over ``inputs`` the same way.
    ``enabled`` False: always in order (the reference the tests compare to)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._streams: Dict[Tuple[torch.device, int], List[torch.cuda.Stream]] = {}   # by the stream they fork from

    def __deepcopy__(self, memo: Optional[dict] = None) -> SideBySide:
        return SideBySide(self.enabled)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        if not inputs:
            return []
        return self.run([functools.partial(fn, x) for x in inputs], inputs[0].device)

    def run(self, calls: Sequence[Call], device: torch.device) -> List[torch.Tensor]:
        if not self.enabled or device.type != "cuda" or len(calls) < 2:
            return [call() for call in calls]
        current = torch.cuda.current_stream(device)
        streams = self._side_streams(current, len(calls))
        outputs = []
        for stream, call in zip(streams, calls, strict=True):
            stream.wait_stream(current)                       # the inputs, made on the current stream
            with torch.cuda.stream(stream):
                outputs.append(call())
        for stream, out in zip(streams, outputs, strict=True):
            current.wait_stream(stream)
            out.record_stream(current)        # not reused for another stream while the current one reads it
        return outputs

    def _side_streams(self, current: torch.cuda.Stream, count: int) -> List[torch.cuda.Stream]:
        """``count`` side streams of ``current`` (its own, at its priority: module docstring)."""
        streams = self._streams.setdefault((current.device, current.cuda_stream), [])
        while len(streams) < count:
            streams.append(torch.cuda.Stream(current.device, priority=current.priority))
        return streams[:count]


def heads(proj: torch.nn.Module, x: torch.Tensor, shape: Tuple[int, ...]) -> torch.Tensor:
    """An attention's query, key or value as transformers makes them:
    ``proj(x).view(shape).transpose(1, 2)``."""
    return proj(x).view(shape).transpose(1, 2)


def gated_mlp(mlp: Any, x: torch.Tensor, side_by_side: SideBySide) -> torch.Tensor:
    """transformers' gated MLP (``LlamaMLP.forward``, ``GemmaMLP.forward``: the same code)
    written out, ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, its gate and up
    projections ``side_by_side``."""
    gated, up = side_by_side.run([functools.partial(_gate, mlp, x), functools.partial(mlp.up_proj, x)], x.device)
    return mlp.down_proj(gated * up)


def _gate(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    return mlp.act_fn(mlp.gate_proj(x))


def encoder_layer(layer: Any, hidden: torch.Tensor, mask: Optional[torch.Tensor],
                  side_by_side: SideBySide) -> torch.Tensor:
    """transformers' SigLIP-style vision encoder layer (``SiglipEncoderLayer.forward``, with
    ``SiglipAttention.forward``; SmolVLM's are the same code) written out, its query, key and
    value projections ``side_by_side``: the same operations on the same inputs, through the
    attention function its config names. ``check_encoder_layers`` first."""
    attn = layer.self_attn
    residual = hidden
    normed = layer.layer_norm1(hidden)
    shape = (*normed.shape[:-1], -1, attn.head_dim)
    queries, keys, values = side_by_side.run([functools.partial(heads, proj, normed, shape)
                                              for proj in (attn.q_proj, attn.k_proj, attn.v_proj)], normed.device)
    attend_with = _attention_functions().get_interface(attn.config._attn_implementation,
                                                       sys.modules[type(attn).__module__].eager_attention_forward)
    out, _ = attend_with(attn, queries, keys, values, mask, is_causal=attn.is_causal, scaling=attn.scale,
                         dropout=0.0)
    hidden = residual + attn.out_proj(out.reshape(*normed.shape[:-1], -1).contiguous())
    return hidden + layer.mlp(layer.layer_norm2(hidden))


def check_encoder_layers(layers: Iterable[Any], written_out: Sequence[Any], where: str) -> None:
    """ConfigError unless every layer's forward is one of ``written_out``'s (the classes whose
    forward ``encoder_layer`` writes out)."""
    from capsule_ros.errors import ConfigError
    forwards = {cls.forward for cls in written_out}
    for layer in layers:
        if type(layer).forward not in forwards:
            raise ConfigError(f"{where} has layers of type {type(layer).__name__}: capsule_ros writes out the "
                              f"forward of {', '.join(cls.__name__ for cls in written_out)} only")


def _attention_functions():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return ALL_ATTENTION_FUNCTIONS
