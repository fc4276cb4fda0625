"""Pieces shared by the LeRobot policies: normalisation, image conversion and the ResNet
backbone (their action queue is the runtime's chunk cadence, ``capsule_ros.chunking``).

Every function mirrors LeRobot's arithmetic operation by operation (same operands, same
order), so that results agree to the last bit where the kernels do.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from capsule_ros.errors import ConfigError
from capsule_ros.policies.lerobot.checkpoint import STATS_OF_MODE, Normalization

# --- normalisation ---------------------------------------------------------------------------


class FeatureNorm(nn.Module):
    """LeRobot's (un)normalisation of one feature (``_NormalizationMixin._apply_transform``).

    Buffers (persistent, so they enter the capsule fingerprint): ``low`` (mean, min, q01 or
    q10), ``spread`` (std for MEAN_STD, else the high statistic) and ``denom``: ``std + eps``
    for MEAN_STD, ``high - low`` with 0 replaced by eps otherwise, as LeRobot computes them.
    """

    low: torch.Tensor                # buffers (register_buffer), declared for the type checker
    spread: torch.Tensor
    denom: torch.Tensor

    def __init__(self, norm: Normalization, shape: Sequence[int]):
        super().__init__()
        self.key, self.mode = norm.key, norm.mode
        if self.mode == "IDENTITY":
            low = spread = denom = torch.zeros(1)      # placeholders (not read)
        else:
            low_name, high_name = STATS_OF_MODE[self.mode]
            low, spread = norm.stats[low_name], norm.stats[high_name]
            try:      # numpy's: torch.broadcast_shapes imports torch._refs and sympy (1.5 s of start-up)
                np.broadcast_shapes(tuple(low.shape), tuple(spread.shape), tuple(shape))
            except ValueError:
                raise ConfigError(f"normalisation statistics of {norm.key!r} have shapes {list(low.shape)} and "
                                  f"{list(spread.shape)}; they do not broadcast to the feature {list(shape)}") from None
            if self.mode == "MEAN_STD":
                denom = spread + norm.eps
            else:
                denom = spread - low
                denom = torch.where(denom == 0, torch.tensor(norm.eps, dtype=denom.dtype), denom)
        self.register_buffer("low", low.clone())
        self.register_buffer("spread", spread.clone())
        self.register_buffer("denom", denom.clone())

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "IDENTITY":
            return x
        if self.mode == "MEAN_STD":
            return (x - self.low) / self.denom
        return 2 * (x - self.low) / self.denom - 1             # MIN_MAX and the quantile modes

    def unnormalize(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "IDENTITY":
            return x
        if self.mode == "MEAN_STD":
            return x * self.spread + self.low
        if self.mode == "MIN_MAX":
            return (x + 1) / 2 * self.denom + self.low
        return (x + 1) * self.denom / 2 + self.low             # the quantile modes: LeRobot's order differs


def camera_to_float(image: torch.Tensor, size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """uint8 [..., h, w, 3] RGB -> float32 [..., 3, H, W] in [0, 1], as LeRobot's
    ``prepare_observation_for_inference`` converts a camera frame. The result is made
    contiguous as there: a channels-last layout would select other convolution kernels
    (different last bits). ``size`` (H, W): resize a frame of another size to it
    (``resize_cameras``), before normalisation, as a frame captured at that size would be.

    LeRobot divides on the CPU, a true division. On CUDA, torch divides by a Python number
    as a multiplication by its reciprocal, which can round differently in the last bit; a
    0-dim tensor on the device makes CUDA divide too, so both devices give LeRobot's bits."""
    x = image.to(torch.float32)
    x = torch.movedim(x / x.new_full((), 255.0), -1, -3).contiguous()
    return x if size is None else resize_image(x, size)


def resize_image(x: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """torchvision's ``Resize(size)`` on float images [..., C, H, W]: bilinear with
    antialiasing (a triangle filter as wide as the scale when shrinking), half-pixel
    centres; an image already of that size is returned as it is (torchvision does the
    same). LeRobot's Diffusion ``resize_shape`` and the ``resize_cameras`` option use it."""
    height, width = int(size[0]), int(size[1])
    if tuple(x.shape[-2:]) == (height, width):
        return x
    lead = x.shape[:-3]
    out = F.interpolate(x.reshape(-1, *x.shape[-3:]), size=(height, width), mode="bilinear", align_corners=False,
                        antialias=True)
    return out.reshape(*lead, *out.shape[-3:])


# --- ResNet backbone ---------------------------------------------------------------------------

RESNET_BLOCKS = {"resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3)}


class FrozenBatchNorm2d(nn.Module):
    """Batch norm with fixed statistics and affine, computed as torchvision's FrozenBatchNorm2d."""

    weight: torch.Tensor             # buffers (register_buffer), declared for the type checker
    bias: torch.Tensor
    running_mean: torch.Tensor
    running_var: torch.Tensor

    def __init__(self, channels: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(channels))
        self.register_buffer("bias", torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.reshape(1, -1, 1, 1)
        b = self.bias.reshape(1, -1, 1, 1)
        rv = self.running_var.reshape(1, -1, 1, 1)
        rm = self.running_mean.reshape(1, -1, 1, 1)
        scale = w * (rv + self.eps).rsqrt()
        bias = b - rm * scale
        return x * scale + bias


NormFactory = Callable[[int], nn.Module]


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convolutions and a (projected) shortcut."""

    def __init__(self, inplanes: int, planes: int, stride: int, norm: NormFactory):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = norm(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), norm(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


def resnet_trunk(name: str, norm: NormFactory) -> OrderedDict[str, nn.Module]:
    """The children of a torchvision ResNet up to layer4 (no pooling, no fc), by their names:
    conv1, bn1, relu, maxpool, layer1..layer4. ACT keeps these names (IntermediateLayerGetter),
    Diffusion numbers them 0..7 (``nn.Sequential(*children)``)."""
    if name not in RESNET_BLOCKS:
        raise ConfigError(f"vision_backbone {name!r} is not supported; supported: {sorted(RESNET_BLOCKS)}")
    children: OrderedDict[str, nn.Module] = OrderedDict(
        conv1=nn.Conv2d(3, 64, 7, 2, 3, bias=False), bn1=norm(64), relu=nn.ReLU(), maxpool=nn.MaxPool2d(3, 2, 1))
    inplanes = 64
    for i, (planes, blocks) in enumerate(zip((64, 128, 256, 512), RESNET_BLOCKS[name], strict=True)):
        stride = 1 if i == 0 else 2
        layer = [BasicBlock(inplanes, planes, stride, norm)]
        layer += [BasicBlock(planes, planes, 1, norm) for _ in range(blocks - 1)]
        children[f"layer{i + 1}"] = nn.Sequential(*layer)
        inplanes = planes
    return children


RESNET_CHANNELS = 512


def resnet_feature_size(height: int, width: int) -> Tuple[int, int]:
    """Spatial size of layer4's output for an input image (stride-2 stages, no dilation)."""
    def conv(n: int, kernel: int, stride: int, pad: int) -> int:
        return (n + 2 * pad - kernel) // stride + 1
    sizes = []
    for n in (height, width):
        n = conv(conv(n, 7, 2, 3), 3, 2, 1)          # conv1, maxpool
        for _ in range(3):                           # layer2..layer4 stride 2
            n = conv(n, 3, 2, 1)
        sizes.append(n)
    return sizes[0], sizes[1]
