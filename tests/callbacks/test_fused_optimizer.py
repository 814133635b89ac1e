"""FusedOptimizerCallback in a Trainer: switched in place, schedule intact, resume, reports and no-effect warning."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_perf import NoEffectWarning
from lightning_perf.callbacks import FusedOptimizerCallback
from lightning_perf.demos import make_workload
from tests._models import trainer


def _trainer(tmp_path: Path, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    defaults = {"max_steps": -1, "limit_train_batches": 2, "limit_val_batches": 0}
    return trainer(tmp_path, callbacks=callbacks, **{**defaults, **kwargs})


class Probe(pl.Callback):
    """Records, at every training step, which implementation each optimizer's groups ask for."""

    def __init__(self) -> None:
        self.flags: list[list[tuple[Any, Any]]] = []
        self.optimizer_ids: set[int] = set()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.flags.append([(g.get("fused"), g.get("foreach")) for o in trainer.optimizers for g in o.param_groups])
        self.optimizer_ids |= {id(o) for o in trainer.optimizers}


def test_convnet_adamw_steps_fused_with_its_schedule_intact(tmp_path: Path, caplog) -> None:
    probe = Probe()
    model, data = make_workload("convnet", "tiny")
    trainer = _trainer(tmp_path, [FusedOptimizerCallback(), probe], max_epochs=3)
    with caplog.at_level(logging.INFO):
        trainer.fit(model, datamodule=data)

    assert probe.flags and all(step == [(True, None)] for step in probe.flags)
    (optimizer,) = trainer.optimizers
    assert probe.optimizer_ids == {id(optimizer)}  # switched in place, never replaced
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.optimizer is optimizer
    plain_model, plain_data = make_workload("convnet", "tiny")
    plain = _trainer(tmp_path / "plain", [], max_epochs=3)
    plain.fit(plain_model, datamodule=plain_data)
    plain_scheduler = plain.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == plain_scheduler.last_epoch > 0  # it stepped, as often as without the callback
    assert scheduler.get_last_lr() == plain_scheduler.get_last_lr()
    assert optimizer.param_groups[0]["lr"] == plain.optimizers[0].param_groups[0]["lr"]
    state = next(iter(optimizer.state.values()))
    assert state["step"].dtype == torch.float32 and float(state["step"]) == 6
    assert "FusedOptimizerCallback: optimizer 0 (AdamW) -> fused." in caplog.text
    assert not optimizer._optimizer_load_state_dict_post_hooks  # removed at teardown


class Regression(pl.LightningModule):
    """A deterministic model without BatchNorm (Adam would amplify rounding noise in near-zero gradients)."""

    def __init__(self, optimizer: str = "adamw", foreach: bool | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.optimizer = optimizer
        self.foreach = foreach
        self.automatic_optimization = optimizer != "two"

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if not self.automatic_optimization:  # two optimizers: step the first by hand
            first = self.optimizers()[0]  # type: ignore[index]
            first.zero_grad()
            self.manual_backward(loss)
            first.step()
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=0.1)
        if self.optimizer == "two":
            return [
                torch.optim.AdamW(self.net[0].parameters(), lr=1e-2),
                torch.optim.LBFGS(self.net[2].parameters(), lr=0.1),
            ]
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, foreach=self.foreach)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)), batch_size=4)


def _fit(tmp_path: Path, name: str, callbacks: list[pl.Callback], epochs: int, ckpt: Path | None = None) -> Regression:
    model = Regression()
    trainer = _trainer(tmp_path / name, callbacks, max_epochs=epochs)
    trainer.fit(model, ckpt_path=ckpt)
    if ckpt is None:
        trainer.save_checkpoint(tmp_path / f"{name}.ckpt")
    return model


@pytest.mark.parametrize("first_with_callback", [False, True], ids=["plain-checkpoint", "fused-checkpoint"])
def test_resumed_run_steps_fused_and_matches(tmp_path: Path, first_with_callback: bool) -> None:
    """Lightning loads optimizer state after `on_fit_start`, replacing the param groups' flags with the checkpoint's;
    the post-load hook switches them back, so the resumed epochs step fused and match an uninterrupted run."""
    straight = _fit(tmp_path, "straight", [], epochs=4)
    _fit(tmp_path, "first", [FusedOptimizerCallback()] if first_with_callback else [], epochs=2)
    probe = Probe()
    resumed = _fit(tmp_path, "resumed", [FusedOptimizerCallback(), probe], 4, ckpt=tmp_path / "first.ckpt")
    assert probe.flags and all(step == [(True, None)] for step in probe.flags)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_a_checkpoint_written_with_the_callback_resumes_without_it(tmp_path: Path) -> None:
    straight = _fit(tmp_path, "straight", [], epochs=4)
    _fit(tmp_path, "first", [FusedOptimizerCallback()], epochs=2)
    resumed = _fit(tmp_path, "resumed", [], 4, ckpt=tmp_path / "first.ckpt")
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_no_supported_optimizer_warns_with_the_reason(tmp_path: Path) -> None:
    model = Regression("lbfgs")
    with pytest.warns(
        NoEffectWarning, match=r"changed nothing: optimizer 0 \(LBFGS\) left as it is: LBFGS has neither"
    ):
        _trainer(tmp_path, [FusedOptimizerCallback()], max_steps=1).fit(model)


def test_explicit_for_loop_is_respected(tmp_path: Path) -> None:
    probe = Probe()
    with pytest.warns(NoEffectWarning, match=r"asked for the for-loop implementation \(foreach=False\)"):
        _trainer(tmp_path, [FusedOptimizerCallback(), probe], max_steps=1).fit(Regression(foreach=False))
    assert probe.flags == [[(None, False)]]


def test_reports_what_changed_and_what_was_skipped(tmp_path: Path, caplog) -> None:
    probe = Probe()
    with caplog.at_level(logging.INFO):
        _trainer(tmp_path, [FusedOptimizerCallback(mode="foreach"), probe], max_steps=1).fit(Regression("two"))
    assert (
        "FusedOptimizerCallback: optimizer 0 (AdamW) -> foreach; optimizer 1 (LBFGS) left as it is: LBFGS has neither"
        in caplog.text
    )
    assert probe.flags[0][0] == (None, True)


@pytest.mark.parametrize("bad", ["fast", None])
def test_mode_validation(bad: Any) -> None:
    with pytest.raises(ValueError, match=rf"FusedOptimizerCallback\(mode={bad!r}\)"):
        FusedOptimizerCallback(mode=bad)


@pytest.mark.gpu
def test_cuda_fused_with_16_mixed_and_gradient_clipping(tmp_path: Path) -> None:
    """The switch leaves `_step_supports_amp_scaling` unset, so GradScaler unscales as usual and clipping works."""
    probe = Probe()
    model, data = make_workload("convnet", "tiny")
    trainer = _trainer(
        tmp_path, [FusedOptimizerCallback(), probe], accelerator="gpu", precision="16-mixed", gradient_clip_val=1.0
    )
    trainer.fit(model, datamodule=data)
    assert all(step == [(True, None)] for step in probe.flags)
    state = next(iter(trainer.optimizers[0].state.values()))
    assert state["step"].device.type == "cuda"
    assert torch.isfinite(torch.as_tensor(float(trainer.callback_metrics["train_loss"])))
