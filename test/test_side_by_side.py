"""``SideBySide``: a VLA's cameras through one tower, side by side on a GPU, in order on a CPU.

The policy-level check is in test_vla_parity.py and test_lerobot_pi.py (the captured refill,
its cameras side by side, against the eager plan embedding them in order, bit for bit, on
CUDA); this file checks the helper itself: the same results in the same order, inside and
outside a captured graph, and a deep copy with streams of its own.
"""
from __future__ import annotations

import copy

import pytest
import torch

from capsule_ros.policies.vla.side_by_side import SideBySide
from capsule_ros.runtime.streams import StreamKeeper


def tower(weights: torch.Tensor):
    """A stand-in vision tower: GEMMs and a nonlinearity, each call allocating temporaries."""
    def run(x: torch.Tensor) -> torch.Tensor:
        for w in weights:
            x = torch.tanh(x @ w) * 1.5 + x
        return x.sum(dim=0, keepdim=True) + x
    return run


def inputs(device: str, count: int = 3):
    g = torch.Generator(device="cpu").manual_seed(0)
    xs = [torch.randn(256, 384, generator=g).to(device) for _ in range(count)]
    weights = torch.randn(6, 384, 384, generator=g).to(device) / 20
    return xs, tower(weights)


def test_on_a_cpu_the_calls_run_in_order_and_give_the_functions_results():
    xs, fn = inputs("cpu")
    calls = []

    def noted(x):
        calls.append(len(calls))
        return fn(x)
    got = SideBySide().map(noted, xs)
    assert calls == [0, 1, 2]
    assert all(torch.equal(a, fn(x)) for a, x in zip(got, xs, strict=True))
    assert SideBySide().map(fn, []) == []


def test_a_deep_copy_has_streams_of_its_own_and_keeps_the_setting():
    original = SideBySide(enabled=False)
    original._streams[torch.device("cpu")] = ["a stream"]             # stands for one made on first use
    copied = copy.deepcopy(original)
    assert copied.enabled is False and copied._streams == {}


@pytest.mark.cuda
def test_side_by_side_gives_the_sequential_bits_eagerly_and_captured():
    """Three calls on side streams, eagerly and replayed from a captured graph (whose side
    streams fork from and join the capture stream), equal the calls in order bit for bit;
    the outputs keep their values while later work allocates on the current stream."""
    xs, fn = inputs("cuda")
    expected = [fn(x) for x in xs]
    side = SideBySide()
    eager = side.map(fn, xs)
    assert all(torch.equal(a, b) for a, b in zip(eager, expected, strict=True))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):                                              # warm-up on the capture stream
            side.map(fn, xs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = side.map(fn, xs)
        total = torch.stack(captured).sum(dim=0)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, expected, strict=True))
    assert torch.equal(total, torch.stack(expected).sum(dim=0))
    assert len(side._streams[(stream.device, stream.cuda_stream)]) == 3


@pytest.mark.cuda
def test_nested_calls_fork_from_streams_of_their_own_and_give_the_sequential_bits():
    """A call that itself runs calls side by side (a camera's tower and its layers'
    projections) gives the sequential bits, eagerly and captured, and its inner calls run on
    side streams of the outer call's stream, none of them an outer branch's."""
    xs, fn = inputs("cuda")
    side = SideBySide()

    def nested(x):
        halves = side.run([lambda: fn(x), lambda: fn(x * 0.5)], x.device)
        return halves[0] - halves[1]
    expected = [fn(x) - fn(x * 0.5) for x in xs]
    assert all(torch.equal(a, b) for a, b in zip(side.map(nested, xs), expected, strict=True))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        side.map(nested, xs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = side.map(nested, xs)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, expected, strict=True))
    outer = side._streams[(stream.device, stream.cuda_stream)]
    inner = [s for branch in outer for s in side._streams[(branch.device, branch.cuda_stream)]]
    assert len(outer) == 3 and len(inner) == 6
    assert len({s.cuda_stream for s in (*outer, *inner)}) == 9


@pytest.mark.cuda
def test_the_steps_branches_and_a_refills_never_share_a_cuda_stream_however_many_streams_were_made():
    """torch hands out streams round-robin from a pool of 32 per priority, and cuBLAS keeps a
    workspace per stream that a captured graph keeps using: side streams take their parent's
    priority, so the control step's branches (and their branches) and a refill's come from
    different pools and never are the same CUDA stream, after any number of streams."""
    device = torch.device("cuda")
    keeper = StreamKeeper()
    step, refill = keeper.get(device, "step"), keeper.get(device, "refill")
    assert step is not None and refill is not None and step.priority < refill.priority
    of_step, of_refill = [], []
    for _ in range(12):                         # one policy's SideBySide after another: the pools wrap
        side = SideBySide()
        for parent, found in ((step, of_step), (refill, of_refill)):
            branches = side._side_streams(parent, 3)
            nested = [s for branch in branches for s in side._side_streams(branch, 3)]
            assert all(s.priority == parent.priority for s in (*branches, *nested))
            found.extend((*branches, *nested))
        torch.cuda.Stream()                     # other streams of the process
    step_side = {s.cuda_stream for s in (step, *of_step)}
    refill_side = {s.cuda_stream for s in (refill, *of_refill)}
    assert len(of_step) == len(of_refill) == 12 * 12
    assert step_side.isdisjoint(refill_side)
