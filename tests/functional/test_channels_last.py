"""Channels-last conversion as plain functions: which weights change, batch conversion, identical numerics."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
from torch import nn

from lightning_perf.functional.channels_last import (
    apply_channels_last,
    batch_to_channels_last,
    find_conv_layers,
    validate_dims,
)

CL, CL3 = torch.channels_last, torch.channels_last_3d


class Mixed(nn.Module):
    """Every kind of layer the conversion must tell apart."""

    def __init__(self) -> None:
        super().__init__()
        self.conv2d = nn.Conv2d(3, 8, 3)
        self.deconv2d = nn.ConvTranspose2d(8, 4, 3)
        self.conv3d = nn.Conv3d(2, 4, 3)
        self.deconv3d = nn.ConvTranspose3d(4, 2, 3)
        self.conv1d = nn.Conv1d(2, 4, 3)
        self.linear = nn.Linear(4, 4)


def test_weights_of_each_rank_take_their_format_and_keep_their_parameter_objects() -> None:
    model = Mixed()
    params_before = {name: p for name, p in model.named_parameters()}
    values_before = {name: p.detach().clone() for name, p in model.named_parameters()}

    report = apply_channels_last(model)

    assert report.dims == {2, 3}
    assert report.layers == {2: ["conv2d", "deconv2d"], 3: ["conv3d", "deconv3d"]}
    assert report.changed == 4 and report.skipped_reason is None
    for name in ("conv2d", "deconv2d"):
        weight = getattr(model, name).weight
        assert weight.is_contiguous(memory_format=CL) and not weight.is_contiguous()
    for name in ("conv3d", "deconv3d"):
        assert getattr(model, name).weight.is_contiguous(memory_format=CL3)
    assert model.conv1d.weight.is_contiguous() and model.linear.weight.is_contiguous()
    for name, p in model.named_parameters():
        assert p is params_before[name], f"{name} was replaced instead of converted in place"
        assert torch.equal(p, values_before[name])
    assert apply_channels_last(model).changed == 0  # idempotent


@pytest.mark.parametrize(("dims", "converted", "untouched"), [(2, "conv2d", "conv3d"), (3, "conv3d", "conv2d")])
def test_forced_dims_converts_only_that_rank(dims: int, converted: str, untouched: str) -> None:
    model = Mixed()
    report = apply_channels_last(model, dims=dims)  # type: ignore[arg-type]
    assert report.dims == {dims}
    assert not getattr(model, converted).weight.is_contiguous()
    assert getattr(model, untouched).weight.is_contiguous()


def test_nothing_applies_without_conv_layers_or_with_the_other_rank() -> None:
    mlp = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(1, 1, 3))
    report = apply_channels_last(mlp)
    assert report.dims == frozenset() and "no 2D or 3D convolution" in str(report.skipped_reason)

    only3d = nn.Sequential(nn.Conv3d(1, 2, 3))
    report = apply_channels_last(only3d, dims=2)
    assert report.dims == frozenset()
    assert report.skipped_reason == "dims=2 was asked for but the model has only 3D convolution layers"
    assert only3d[0].weight.is_contiguous()


def test_uninitialized_lazy_conv_is_skipped() -> None:
    model = nn.Sequential(nn.LazyConv2d(4, 3), nn.Conv2d(4, 4, 3))
    assert find_conv_layers(model) == {2: ["1"], 3: []}


class Custom(nn.Conv2d):
    """A user's conv subclass: found by capability (a 4D weight of a ``_ConvNd``), not by exact class."""


def test_conv_subclasses_count() -> None:
    assert find_conv_layers(nn.Sequential(Custom(1, 2, 3))) == {2: ["0"], 3: []}


@pytest.mark.parametrize("bad", [4, 1, "2", True, None])
def test_dims_validation_names_the_value(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"apply_channels_last\(dims={bad!r}\).*Expected one of 'auto', 2, 3"):
        validate_dims(bad)
    with pytest.raises(ValueError):
        apply_channels_last(nn.Conv2d(1, 1, 1), dims=bad)  # type: ignore[arg-type]


@dataclass
class Sample:
    image: torch.Tensor
    volume: torch.Tensor
    label: torch.Tensor
    name: str


class Pair(NamedTuple):
    image: torch.Tensor
    mask: torch.Tensor


def test_batch_conversion_reaches_nested_tensors_and_leaves_the_rest() -> None:
    image, volume = torch.randn(2, 3, 4, 5), torch.randn(2, 1, 3, 4, 5)
    int_image = torch.randint(0, 3, (2, 1, 4, 5))
    sample = Sample(image, volume, torch.tensor([1, 0]), "x")
    batch = {"pair": Pair(image, int_image), "list": [image, (volume, torch.randn(2, 3))], "sample": sample}
    out = batch_to_channels_last(batch)
    assert out["pair"].image.is_contiguous(memory_format=CL) and isinstance(out["pair"], Pair)
    assert out["pair"].mask is int_image  # integer tensors are labels or masks: untouched
    assert out["list"][0].is_contiguous(memory_format=CL)
    assert out["list"][1][0].is_contiguous(memory_format=CL3)
    assert out["list"][1][1].is_contiguous()
    sample = out["sample"]
    assert isinstance(sample, Sample) and sample.name == "x"
    assert sample.image.is_contiguous(memory_format=CL) and sample.volume.is_contiguous(memory_format=CL3)
    assert torch.equal(sample.image, image) and torch.equal(sample.volume, volume)
    assert batch["sample"].image is image  # the input batch is not modified

    only2d = batch_to_channels_last((image, volume), dims={2})
    assert only2d[0].is_contiguous(memory_format=CL) and only2d[1] is volume
    assert batch_to_channels_last(image, dims=()) is image


def _net2d() -> nn.Module:
    convs = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.ConvTranspose2d(8, 8, 2, stride=2)]
    return nn.Sequential(*convs, nn.Conv2d(8, 4, 3, stride=2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def _net3d() -> nn.Module:
    return nn.Sequential(
        nn.Conv3d(1, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(), nn.ConvTranspose3d(4, 2, 2, stride=2)
    )


@pytest.mark.parametrize(("make", "shape", "fmt"), [(_net2d, (4, 3, 8, 8), CL), (_net3d, (2, 1, 4, 6, 6), CL3)])
def test_forward_and_gradients_match_contiguous(make, shape: tuple[int, ...], fmt: torch.memory_format) -> None:
    torch.manual_seed(0)
    plain = make()
    converted = copy.deepcopy(plain)
    report = apply_channels_last(converted)
    x = torch.randn(shape)

    out_plain = plain(x)
    out_cl = converted(batch_to_channels_last(x, report.dims))
    torch.testing.assert_close(out_cl, out_plain, rtol=1e-5, atol=1e-5)
    out_plain.square().sum().backward()
    out_cl.square().sum().backward()

    for (name, p), q in zip(plain.named_parameters(), converted.parameters()):
        assert q.grad is not None and p.grad is not None
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
        if q.dim() == len(shape):  # conv weights: the gradient takes the weight's layout
            assert q.grad.is_contiguous(memory_format=fmt), name
