"""FlashAttentionCallback: what it swaps and reports, that training is the plain model's, and its bad inputs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_perf import FallbackWarning, NoEffectWarning
from lightning_perf.callbacks import FlashAttentionCallback
from lightning_perf.functional.attention import (
    SDPA,
    UNCHANGED,
    AttentionAdapter,
    FusedMultiheadAttention,
    FusedQKVAttention,
    FusedQKVSpec,
    SwappedAttention,
)
from tests._models import NanoGPTAttention, SequenceModule, TinyGPT, encoder, trainer


class GPTModule(SequenceModule):
    def __init__(self) -> None:
        super().__init__(TinyGPT(depth=2))
        self.data = torch.utils.data.TensorDataset(torch.randint(0, 11, (32, 8), generator=torch.Generator()))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch[0][:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[0][:, 1:].flatten())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # SGD, not Adam: the key bias gets a gradient that is zero up to rounding (softmax ignores it), which Adam
        # would turn into full-size steps of opposite signs in two runs that differ only by kernel.
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Spy(FlashAttentionCallback):
    """Records the attention module types while training runs."""

    seen: list[str]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.seen = sorted({type(m).__name__ for m in pl_module.modules() if isinstance(m, SwappedAttention)})


def test_fit_swaps_reports_and_restores(tmp_path: Path, caplog) -> None:
    model = SequenceModule(encoder(depth=2))
    callback = Spy()
    with caplog.at_level(logging.INFO):
        trainer(tmp_path, callbacks=[callback]).fit(model)
    assert callback.seen == ["FusedMultiheadAttention"]
    assert list(callback.decisions) == ["net.layers.0.self_attn", "net.layers.1.self_attn"]
    kernel, reason = callback.decisions["net.layers.0.self_attn"]
    assert kernel == SDPA and "flash-attn" in reason
    assert callback.swapped == list(callback.decisions)
    assert "FlashAttentionCallback: 2 of 2 attention modules swapped" in caplog.text
    assert all(type(layer.self_attn) is nn.MultiheadAttention for layer in model.net.layers)


def test_hand_written_attention_trains_like_the_plain_model(tmp_path: Path) -> None:
    results = []
    for callbacks in ([], [Spy()]):
        torch.manual_seed(0)
        model = GPTModule()
        trainer(tmp_path, callbacks=callbacks, max_steps=4).fit(model)
        results.append(model.state_dict())
    assert callbacks[0].seen == ["FusedQKVAttention"]
    for key in results[0]:
        torch.testing.assert_close(results[1][key], results[0][key], atol=1e-5, rtol=1e-4, msg=key)


def test_resume_equals_an_uninterrupted_run_and_checkpoints_are_plain(tmp_path: Path) -> None:
    def fit(max_epochs: int, ckpt: Path | None = None, save: Path | None = None) -> GPTModule:
        torch.manual_seed(0)
        model = GPTModule()
        run = trainer(tmp_path, callbacks=[FlashAttentionCallback()], max_steps=-1, max_epochs=max_epochs)
        run.fit(model, ckpt_path=ckpt)
        if save is not None:
            run.save_checkpoint(save)
        return model

    straight = fit(2)
    fit(1, save=tmp_path / "one.ckpt")
    resumed = fit(2, ckpt=tmp_path / "one.ckpt")
    for key, value in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, atol=0, rtol=0, msg=key)
    state = torch.load(tmp_path / "one.ckpt", weights_only=True)["state_dict"]
    plain = GPTModule()
    assert set(state) == set(plain.state_dict())
    plain.load_state_dict(state)


class NanoGPTAdapter(AttentionAdapter):
    def matches(self, module: nn.Module, name: str) -> bool:
        return isinstance(module, NanoGPTAttention)

    def swap(self, module: nn.Module, kernel: str) -> nn.Module:
        spec = FusedQKVSpec("c_attn", "c_proj", module.n_head, True, "qkv", "attn_dropout", "resid_dropout")
        return FusedQKVAttention.from_module(module, spec, kernel)


class WrongAdapter(NanoGPTAdapter):
    def swap(self, module: nn.Module, kernel: str) -> nn.Module:
        return FusedQKVAttention.from_module(module, FusedQKVSpec("c_attn", "c_proj", 2, causal=False), kernel)


def test_adapters_by_instance_and_class_path(tmp_path: Path) -> None:
    callback = Spy(adapters=["tests.callbacks.test_flash_attention.NanoGPTAdapter"])
    assert isinstance(callback.adapters[0], NanoGPTAdapter)
    trainer(tmp_path, callbacks=[callback], max_steps=1).fit(GPTModule())
    assert callback.seen == ["FusedQKVAttention"]


def test_a_failed_parity_check_keeps_the_original_and_warns(tmp_path: Path) -> None:
    callback = Spy(adapters=[WrongAdapter()])
    with pytest.warns(FallbackWarning, match="does not compute what the original does"), pytest.warns(NoEffectWarning):
        trainer(tmp_path, callbacks=[callback], max_steps=1).fit(GPTModule())
    assert callback.seen == []
    assert callback.decisions["net.blocks.0.attn"].kernel == UNCHANGED
    with pytest.raises(RuntimeError, match="does not compute"):
        trainer(tmp_path, callbacks=[FlashAttentionCallback(adapters=[WrongAdapter()], strict=True)]).fit(GPTModule())


def test_no_attention_warns(tmp_path: Path) -> None:
    with pytest.warns(NoEffectWarning, match="found no attention module in SequenceModule"):
        trainer(tmp_path, callbacks=[FlashAttentionCallback()]).fit(SequenceModule(nn.Linear(16, 16)))


@pytest.mark.parametrize(
    ("adapters", "match"),
    [
        (["tests.callbacks.test_flash_attention.NoSuchAdapter"], "cannot import it"),
        (["torch.nn.Linear"], "Expected AttentionAdapter instances or class paths"),
        ([3], "Expected AttentionAdapter"),
    ],
)
def test_bad_adapters_fail_at_construction(adapters: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FlashAttentionCallback(adapters=adapters)


def test_validate_and_predict_swap_too_and_bf16_mixed(tmp_path: Path) -> None:
    model = SequenceModule(encoder(depth=2))
    callback = FlashAttentionCallback()
    run = trainer(tmp_path, callbacks=[callback], precision="bf16-mixed")
    run.fit(model)
    run.validate(model, verbose=False)
    assert callback.swapped == ["net.layers.0.self_attn", "net.layers.1.self_attn"]
    assert not any(isinstance(m, FusedMultiheadAttention) for m in model.modules())
