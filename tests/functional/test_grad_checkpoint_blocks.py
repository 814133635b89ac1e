"""Checkpointing on model shapes of the real zoos: which blocks ``"auto"`` picks, that they really recompute, and calls
with keyword arguments, masks, key/value caches and tuple or dataclass outputs through a checkpointed block."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_perf.functional.checkpoint.apply import (
    CheckpointedForward,
    apply_activation_checkpointing,
    select_blocks,
)
from lightning_perf.functional.checkpoint.blocks import MIN_LAYERS, count_layers, find_checkpoint_blocks
from lightning_perf.functional.surgery import find_repeated_blocks
from tests._models import ResNet, Stage

# ------------------------------------------------------------------------------------------------ models of the zoos


class ConvNormAct(nn.Sequential):
    """MONAI's ``Convolution`` / timm's ``ConvNormAct``: a Sequential subclass, so a "block" to structural search."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__(nn.Conv2d(cin, cout, 3, stride, 1), nn.GroupNorm(1, cout), nn.ReLU())


class WindowAttention(nn.Module):
    def __init__(self, dim: int, heads: int, window: int) -> None:
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:  # (B, H, W, C) -> same
        B, H, W, C = x.shape
        w = self.window
        windows = x.view(B, H // w, w, W // w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, C)
        q, k, v = self.qkv(windows).view(-1, w * w, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1) * (C // self.heads) ** -0.5).softmax(-1)
        out = self.proj((att @ v).transpose(1, 2).reshape(-1, w * w, C))
        return out.view(B, H // w, W // w, w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, C)


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int = 2, window: int = 2) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, window)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.reduction(self.norm(x))


class SwinStage(nn.Module):
    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SwinBlock(dim) for _ in range(depth))
        self.downsample = PatchMerging(dim)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.downsample(x)


class SwinUNetLike(nn.Module):
    """SwinUNETR's shape: Swin stages as the encoder, conv-norm-act sub-blocks around them (stem, decoder head)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(ConvNormAct(3, dim), ConvNormAct(dim, dim), ConvNormAct(dim, dim))
        self.stages = nn.ModuleList([SwinStage(dim, 2), SwinStage(2 * dim, 2)])
        self.head = nn.Sequential(ConvNormAct(4 * dim, 4 * dim), ConvNormAct(4 * dim, dim), nn.Conv2d(dim, 2, 1))

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x).permute(0, 2, 3, 1)
        for stage in self.stages:
            x = stage(x)
        return self.head(x.permute(0, 3, 1, 2))


class DownStage(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(cin, cout, 3, padding=1), nn.Conv2d(cout, cout, 3, padding=1)
        self.norm1, self.norm2 = nn.BatchNorm2d(cout), nn.BatchNorm2d(cout)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x))))))


class UpStage(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        self.conv1, self.conv2 = nn.Conv2d(2 * cout, cout, 3, padding=1), nn.Conv2d(cout, cout, 3, padding=1)
        self.norm1, self.norm2 = nn.BatchNorm2d(cout), nn.BatchNorm2d(cout)

    def forward(self, x: Tensor, skip: Tensor) -> Tensor:
        x = torch.cat([self.up(x), skip], 1)
        return F.relu(self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x))))))


class UNetLike(nn.Module):
    """Encoder and decoder stages of different classes, joined by skip connections passed as a second argument."""

    def __init__(self, widths: tuple[int, ...] = (4, 8, 16)) -> None:
        super().__init__()
        cins = (1, *widths[:-1])
        self.down = nn.ModuleList(DownStage(a, b) for a, b in zip(cins, widths))
        self.up = nn.ModuleList(UpStage(widths[i + 1], widths[i]) for i in reversed(range(len(widths) - 1)))
        self.out = nn.Conv2d(widths[0], 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        skips = []
        for i, stage in enumerate(self.down):
            x = stage(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        for stage, skip in zip(self.up, reversed(skips[:-1])):
            x = stage(x, skip)
        return self.out(x)


class SkipConnection(nn.Module):
    """MONAI's ``SkipConnection``: ``cat([x, submodule(x)])``, the submodule being the next level down."""

    def __init__(self, submodule: nn.Module) -> None:
        super().__init__()
        self.submodule = submodule

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([x, self.submodule(x)], dim=1)


class Convolution3d(nn.Sequential):
    """MONAI's ``Convolution``: conv (or transposed conv), instance norm, PReLU; ``conv_only`` keeps the conv alone."""

    def __init__(self, cin: int, cout: int, stride: int, transposed: bool = False, conv_only: bool = False) -> None:
        conv: nn.Module = (
            nn.ConvTranspose3d(cin, cout, 3, stride, padding=1, output_padding=stride - 1)
            if transposed
            else nn.Conv3d(cin, cout, 3, stride, padding=1)
        )
        super().__init__(conv) if conv_only else super().__init__(conv, nn.InstanceNorm3d(cout), nn.PReLU())


class NestedUNet(nn.Module):
    """MONAI ``UNet``'s structure (``_create_block``): each level is ``Sequential(down, SkipConnection(next level),
    up)``, the innermost level's submodule is the bottleneck, the top up-convolution is a lone transposed conv."""

    def __init__(self, channels: tuple[int, ...] = (4, 8, 16), in_channels: int = 1, out_channels: int = 2) -> None:
        super().__init__()

        def level(cin: int, cout: int, chans: tuple[int, ...], top: bool) -> nn.Module:
            c = chans[0]
            if len(chans) > 2:
                sub, up_in = level(c, c, chans[1:], False), 2 * c
            else:
                sub, up_in = Convolution3d(c, chans[1], 1), c + chans[1]
            down = Convolution3d(cin, c, 2)
            up = Convolution3d(up_in, cout, 2, transposed=True, conv_only=top)
            return nn.Sequential(down, SkipConnection(sub), up)

        self.model = level(in_channels, out_channels, channels, True)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


NESTED_UNET_BLOCKS = ["model.0", "model.1.submodule.0", "model.1.submodule.1.submodule", "model.1.submodule.2"]
"""The encoder parts of the two levels, the bottleneck and the lower decoder part; the top decoder is a lone conv."""


def gpt2(attn_implementation: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    sizes = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 50, "n_positions": 64}
    # dropout 0.1 everywhere (the defaults): the recompute replays the RNG
    config = transformers.GPT2Config(**sizes, bos_token_id=0, eos_token_id=0, attn_implementation=attn_implementation)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()


# ------------------------------------------------------------------------------------------------------- helpers


def names(found: list[tuple[str, nn.Module]]) -> list[str]:
    return [name for name, _ in found]


def count_calls(module: nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def grads(model: nn.Module, loss: Callable[[nn.Module], Tensor]) -> dict[str, Tensor]:
    model.zero_grad(set_to_none=True)
    loss(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def plain_and_wrapped(build: Callable[[], nn.Module], **kwargs: object) -> tuple[nn.Module, nn.Module, list[str]]:
    """A model built under seed 0, a copy of it with activation checkpointing applied, and the blocks it wrapped."""
    torch.manual_seed(0)
    plain = build()
    wrapped = copy.deepcopy(plain)
    return plain, wrapped, apply_activation_checkpointing(wrapped, **kwargs)


def assert_same_grads(
    plain: nn.Module, wrapped: nn.Module, loss: Callable[[nn.Module], Tensor], state: bool = False
) -> None:
    """The same gradients bit for bit; with ``state``, the same state_dict too (BatchNorm statistics updated once)."""
    expected, actual = grads(plain, loss), grads(wrapped, loss)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=0, rtol=0, msg=name)
    for key, value in plain.state_dict().items() if state else ():
        torch.testing.assert_close(wrapped.state_dict()[key], value, atol=0, rtol=0, msg=key)


# ----------------------------------------------------------------------------------------------------- block choice


def test_swin_like_picks_the_swin_blocks_never_the_conv_sub_blocks() -> None:
    model = SwinUNetLike()
    assert len(names(find_repeated_blocks(model))) == 5  # the structural rule shared with compile: 5 conv sub-blocks
    chosen = names(select_blocks(model))
    assert chosen == [f"stages.{s}.blocks.{b}" for s in (0, 1) for b in (0, 1)]  # not the stages: finer, as many
    assert count_layers(model.stem[0]) < MIN_LAYERS <= count_layers(model.stages[0].blocks[0])


def test_unet_like_picks_encoder_and_decoder_stages() -> None:
    assert names(select_blocks(UNetLike())) == ["down.0", "down.1", "down.2", "up.0", "up.1"]


def test_nested_unet_picks_its_levels_encoder_and_decoder_parts_and_bottleneck() -> None:
    model = NestedUNet()
    assert all(count_layers(m) < MIN_LAYERS for _, m in find_repeated_blocks(model))  # no sibling group to pick
    assert names(select_blocks(model)) == NESTED_UNET_BLOCKS
    inner = [f"model.1.submodule.1.submodule.{part}" for part in ("0", "1.submodule", "2")]
    expected = ["model.0", "model.1.submodule.0", *inner, "model.1.submodule.2"]
    assert names(select_blocks(NestedUNet((4, 8, 16, 32)))) == expected


def test_nested_unet_recomputes_each_level_part_once_with_the_same_gradients() -> None:
    plain, wrapped, chosen = plain_and_wrapped(NestedUNet)
    assert chosen == NESTED_UNET_BLOCKS
    bottleneck, head = count_calls(wrapped.model[1].submodule[1].submodule[0]), count_calls(wrapped.model[2][0])
    x = torch.randn(2, 1, 8, 8, 8)
    assert_same_grads(plain, wrapped, lambda m: m(x).square().mean())
    assert (bottleneck[0], head[0]) == (2, 1)  # recomputed inside a checkpointed level part; the head only once


def test_monai_unet_and_attention_unet_levels() -> None:
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    plain = nets.UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(8, 16, 32), strides=(2, 2))
    assert names(find_checkpoint_blocks(plain)) == NESTED_UNET_BLOCKS
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped)
    x = torch.randn(2, 1, 8, 8, 8)
    assert_same_grads(plain, wrapped, lambda m: m(x).square().mean())
    residual = nets.UNet(3, 1, 2, channels=(4, 8, 16), strides=(2, 2), num_res_units=2)
    # The top up-convolution and its residual unit are more than a lone conv: "model.2" too.
    assert names(find_checkpoint_blocks(residual)) == [*NESTED_UNET_BLOCKS, "model.2"]
    attention = nets.AttentionUnet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2))
    chosen = names(find_checkpoint_blocks(attention))
    assert chosen[:2] == ["model.0", "model.1.attention"] and "model.1.submodule.1.submodule" in chosen


def test_levels_join_the_sibling_stages_of_a_hand_written_unet_without_nesting_them() -> None:
    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.nested, self.flat = NestedUNet(), UNetLike()

    chosen = names(select_blocks(Both()))
    assert chosen == [f"nested.{n}" for n in NESTED_UNET_BLOCKS] + [
        f"flat.{n}" for n in ("down.0", "down.1", "down.2", "up.0", "up.1")
    ]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2_picks_its_layers(attn: str) -> None:
    assert names(select_blocks(gpt2(attn))) == ["transformer.h.0", "transformer.h.1"]


def test_both_stacks_of_an_encoder_decoder_and_blocks_over_custom_stages() -> None:
    model = nn.Transformer(16, 2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32, batch_first=True)
    assert names(find_checkpoint_blocks(model)) == [
        f"{side}.layers.{i}" for side in ("encoder", "decoder") for i in (0, 1)
    ]
    assert names(find_checkpoint_blocks(nn.Sequential(Stage(8, 2), Stage(8, 2)))) == [
        f"{s}.blocks.{b}" for s in (0, 1) for b in (0, 1)
    ]
    assert names(find_checkpoint_blocks(ResNet(blocks_per_stage=2))) == names(find_repeated_blocks(ResNet(2)))


def test_only_tiny_repeated_sub_blocks_means_nothing_to_checkpoint() -> None:
    model = nn.Sequential(ConvNormAct(3, 4), ConvNormAct(4, 4), ConvNormAct(4, 4))
    assert find_checkpoint_blocks(model) == []
    assert apply_activation_checkpointing(model) == []


# ------------------------------------------------------------------------------- recompute, gradients, call shapes


def test_swin_like_recomputes_each_block_once_with_the_same_gradients() -> None:
    plain, wrapped, _ = plain_and_wrapped(SwinUNetLike)
    qkv_calls, stem_calls = count_calls(wrapped.stages[0].blocks[0].attn.qkv), count_calls(wrapped.stem[0][0])
    x = torch.randn(2, 3, 8, 8)
    assert_same_grads(plain, wrapped, lambda m: m(x).square().mean())
    assert (qkv_calls[0], stem_calls[0]) == (2, 1)  # forward + recompute inside a checkpointed block; once outside


def test_unet_like_recomputes_with_skip_arguments_and_batchnorm_updated_once() -> None:
    plain, wrapped, _ = plain_and_wrapped(UNetLike)
    calls = count_calls(wrapped.up[1].conv1)
    x = torch.randn(2, 1, 8, 8)
    assert_same_grads(plain, wrapped, lambda m: m(x).square().mean(), state=True)
    assert calls[0] == 2


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2_with_cache_writes_the_cache_once_and_matches_the_plain_gradients(attn: str) -> None:
    transformers = pytest.importorskip("transformers")
    plain = gpt2(attn)
    wrapped = copy.deepcopy(plain)
    assert apply_activation_checkpointing(wrapped) == ["transformer.h.0", "transformer.h.1"]
    calls = count_calls(wrapped.transformer.h[0].mlp.c_fc)
    ids = torch.randint(50, (2, 16))
    lengths = {}

    def loss(model: nn.Module) -> Tensor:
        torch.manual_seed(1)  # the same dropout masks in both models
        cache = transformers.DynamicCache(config=model.config)
        out = model(ids, labels=ids, use_cache=True, cache=cache)
        assert isinstance(out, transformers.modeling_outputs.ModelOutput)
        lengths[model] = cache
        return out.loss

    assert_same_grads(plain, wrapped, loss)
    assert calls[0] == 2
    assert lengths[wrapped].get_seq_length() == lengths[plain].get_seq_length() == 16  # after backward: not 32
    for layer, expected in zip(lengths[wrapped].layers, lengths[plain].layers):
        torch.testing.assert_close(layer.keys, expected.keys, atol=0, rtol=0)


@dataclass
class BlockOutput:
    hidden: Tensor
    attention: Tensor


class MaskedBlock(nn.Module):
    """Called with keyword arguments (a mask, a scale, a flag), returns a dataclass or a tuple."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm, self.mlp = nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))

    def forward(
        self, x: Tensor, *, attn_mask: Tensor | None = None, scale: float = 1.0, as_tuple: bool = False
    ) -> BlockOutput | tuple[Tensor, Tensor]:
        q, k, v = self.qkv(self.norm(x)).chunk(3, -1)
        scores = q @ k.transpose(-2, -1) * scale
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        att = scores.softmax(-1)
        h = x + self.proj(att @ v)
        h = h + self.mlp(h)
        return (h, att) if as_tuple else BlockOutput(h, att)


class MaskedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MaskedBlock() for _ in range(2))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        first = self.blocks[0](x, attn_mask=mask, scale=0.5)
        hidden, att = self.blocks[1](first.hidden, attn_mask=mask, as_tuple=True)
        return hidden.sum() + att.sum() + first.attention.square().sum()


def test_keyword_arguments_masks_and_dataclass_or_tuple_outputs() -> None:
    plain, wrapped, chosen = plain_and_wrapped(MaskedStack)
    assert chosen == ["blocks.0", "blocks.1"]
    calls = count_calls(wrapped.blocks[1].qkv)
    x, mask = torch.randn(2, 5, 8), torch.ones(5, 5, dtype=torch.bool).tril()
    assert_same_grads(plain, wrapped, lambda m: m(x, mask))
    assert calls[0] == 2


# ------------------------------------------------------------------------------------------------------ context_fn


def test_context_fn_for_selective_checkpointing_keeps_batchnorm_updated_once() -> None:
    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        save = op is torch.ops.aten.convolution.default
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    plain, wrapped, _ = plain_and_wrapped(UNetLike, context_fn=context_fn)
    convs = count_calls(wrapped.down[0].conv1)
    x = torch.randn(2, 1, 8, 8)
    assert_same_grads(plain, wrapped, lambda m: m(x).square().mean(), state=True)
    assert convs[0] == 2  # the module runs again; its convolution's output comes from what was saved


def test_context_fn_must_be_callable() -> None:
    with pytest.raises(TypeError, match="context_fn=3"):
        CheckpointedForward(nn.Linear(2, 2), context_fn=3)
