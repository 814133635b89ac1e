"""SlidingWindowInferenceCallback and lightning_perf.functional.attention.sliding_window (issue 19, point 2)."""

from __future__ import annotations

import logging
import pickle
import signal
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_perf.callbacks import ChannelsLastCallback, SlidingWindowInferenceCallback
from lightning_perf.functional.attention.sliding_window import (
    SlidingWindowForward,
    apply_sliding_window,
    choose_sw_batch_size,
    needs_window,
    remove_sliding_window,
    sliding_window_patch,
    validate_sliding_window,
)
from tests._models import trainer

monai_inferers = pytest.importorskip("monai.inferers")
sliding_window_inference = monai_inferers.sliding_window_inference

ROI = {2: (8, 8), 3: (8, 8, 8)}
SHAPES = {2: (2, 1, 20, 13), 3: (2, 1, 13, 18, 11)}  # larger than the window in some dims, smaller in one (3D)


class TinySegNet(pl.LightningModule):
    """A fully convolutional 2D or 3D net whose ``predict_step``/``test_step`` call ``self(x)``."""

    def __init__(self, dims: int = 3, roi_size: Any = None) -> None:
        super().__init__()
        conv = nn.Conv3d if dims == 3 else nn.Conv2d
        norm = nn.BatchNorm3d if dims == 3 else nn.BatchNorm2d
        self.net = nn.Sequential(conv(1, 4, 3, padding=1), norm(4), nn.ReLU(), conv(4, 2, 1))
        if roi_size is not None:
            self.roi_size = roi_size
        self.seen: list[tuple[int, ...]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(tuple(x.shape))
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0]).float().square().mean()

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_mean", self(batch[0]).float().mean())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_mean", self(batch[0]).float().mean())

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    return trainer(None, callbacks=callbacks, **{"max_steps": -1, "limit_val_batches": 1.0, **kwargs})


def _volumes(dims: int, count: int = 2, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, *SHAPES[dims][1:], generator=g)
    return DataLoader(TensorDataset(x), batch_size=SHAPES[dims][0])


def _model(dims: int, seed: int = 0, **kwargs: Any) -> TinySegNet:
    torch.manual_seed(seed)
    model = TinySegNet(dims, **kwargs)
    with torch.no_grad():  # non-trivial running statistics, so eval mode matters
        model.net[1].running_mean.uniform_(-0.5, 0.5)
        model.net[1].running_var.uniform_(0.5, 2.0)
    return model


def _reference(model: TinySegNet, x: Tensor, dims: int, sw: int, mode: str, **kwargs: Any) -> Tensor:
    model.eval()
    with torch.no_grad():
        return sliding_window_inference(x, ROI[dims], sw, model.net, mode=mode, overlap=0.25, **kwargs)


# ------------------------------------------------------------------------------------------------ equality with MONAI


@pytest.mark.parametrize("dims", [2, 3])
@pytest.mark.parametrize("mode", ["constant", "gaussian"])
def test_predict_equals_monai(dims: int, mode: str) -> None:
    model, loader = _model(dims), _volumes(dims)
    callback = SlidingWindowInferenceCallback(ROI[dims], sw_batch_size=3, mode=mode)
    (prediction,) = _trainer([callback]).predict(model, dataloaders=loader)
    (x,) = next(iter(loader))
    expected = _reference(model, x, dims, 3, mode)
    assert prediction.shape == expected.shape == (x.shape[0], 2, *x.shape[2:])
    assert (prediction - expected).abs().max() < 1e-4
    # The network saw windows, never the whole input, and the forward is plain again after predict.
    assert all(shape[2:] == ROI[dims] for shape in model.seen)
    assert "forward" not in model.__dict__ and not callback.active


def test_test_and_validate_use_the_window_fit_does_not() -> None:
    model, loader = _model(3), _volumes(3)
    callback = SlidingWindowInferenceCallback(ROI[3], sw_batch_size=2)
    trainer = _trainer([callback], max_steps=1, limit_val_batches=1)
    trainer.fit(model, train_dataloaders=loader, val_dataloaders=loader)
    assert all(shape[2:] == SHAPES[3][2:] for shape in model.seen)  # fit and its validation: whole inputs
    model.seen.clear()
    trainer.test(model, dataloaders=loader, verbose=False)
    assert model.seen and all(shape[2:] == ROI[3] for shape in model.seen)
    model.seen.clear()
    trainer.validate(model, dataloaders=loader, verbose=False)
    assert model.seen and all(shape[2:] == ROI[3] for shape in model.seen)
    assert "forward" not in model.__dict__


def test_only_the_stages_asked_for() -> None:
    model, loader = _model(3), _volumes(3)
    callback = SlidingWindowInferenceCallback(ROI[3], stages=["test"])
    _trainer([callback]).predict(model, dataloaders=loader)
    assert all(shape[2:] == SHAPES[3][2:] for shape in model.seen)


def test_extra_forward_arguments_reach_every_window() -> None:
    net = nn.Conv2d(1, 1, 1)
    calls: list[float] = []

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: Tensor, scale: float = 1.0) -> Tensor:
            calls.append(scale)
            return self.net(x) * scale

    model = Scaled()
    settings = validate_sliding_window(roi_size=8, sw_batch_size=4, mode="constant")
    apply_sliding_window(model, settings)
    x = torch.randn(1, 1, 20, 20)
    with torch.no_grad():
        out = model(x, scale=2.0)
        expected = sliding_window_inference(x, 8, 4, lambda w: net(w) * 2.0, mode="constant")
    assert calls and set(calls) == {2.0}
    assert (out - expected).abs().max() < 1e-5
    assert remove_sliding_window(model) and not remove_sliding_window(model)


@pytest.mark.parametrize(
    ("shape", "windowed"),
    [
        ((1, 1, 8, 8, 8), False),  # exactly one window: the plain forward
        ((1, 1, 9, 8, 8), True),  # larger in one dimension
        ((1, 1, 4, 8, 8), True),  # smaller in one dimension: MONAI pads and crops back
        ((1, 1, 8, 8), False),  # another rank
    ],
)
def test_which_inputs_use_the_window(shape: tuple[int, ...], windowed: bool) -> None:
    assert needs_window(torch.zeros(shape), (8, 8, 8)) is windowed
    assert needs_window(torch.zeros(shape), 8) is (windowed if len(shape) == 5 else shape[2:] != (8, 8))


def test_inputs_smaller_than_the_window_are_padded_like_monai() -> None:
    model = _model(3)
    model.eval()
    x = torch.randn(1, 1, 5, 8, 8)
    settings = validate_sliding_window(roi_size=ROI[3], mode="gaussian", padding_mode="replicate")
    apply_sliding_window(model, settings)
    with torch.no_grad():
        out = model(x)
    remove_sliding_window(model)
    expected = _reference(model, x, 3, 1, "gaussian", padding_mode="replicate")
    assert out.shape == expected.shape == (1, 2, 5, 8, 8)
    assert (out - expected).abs().max() < 1e-4
    assert model.seen[0][2:] == ROI[3]  # the network saw the padded window
    apply_sliding_window(model, settings)
    x = torch.randn(2, 1, *ROI[3])
    with torch.no_grad():
        assert torch.equal(model(x), model.net(x))  # one window: the plain forward
    remove_sliding_window(model)


def test_roi_size_from_the_model() -> None:
    model, loader = _model(3, roi_size=ROI[3]), _volumes(3)
    callback = SlidingWindowInferenceCallback("model", sw_batch_size=2)
    (prediction,) = _trainer([callback]).predict(model, dataloaders=loader)
    (x,) = next(iter(loader))
    assert (prediction - _reference(model, x, 3, 2, "gaussian")).abs().max() < 1e-4

    with pytest.raises(
        ValueError, match=r"SlidingWindowInferenceCallback\(roi_size=.model.\).*TinySegNet declares no patch size"
    ):
        _trainer([SlidingWindowInferenceCallback("model")]).predict(_model(3), dataloaders=loader)


# ------------------------------------------------------------------------------------------------ sw_batch_size="auto"


def _fake_measure(times: dict[int, float]) -> Any:
    """A timer for ``choose_sw_batch_size``: each size takes ``times[size]`` seconds per call, with a +-5% drift
    between blocks that goes one way for the baseline and the other way for the candidate (noise of about 5%)."""

    def measure(baseline: Any, candidate: Any, *, iterations: int, warmup: int, device: Any) -> Any:
        drift = {0: ([1.0, 1.05], [0.95, 1.0]), 1: ([0.95, 1.0], [1.0, 1.05])}
        return tuple(
            [[times[_size_of(call)] * j for j in block] for block in drift[side]]
            for side, call in enumerate((baseline, candidate))
        )

    return measure


def _size_of(call: Any) -> int:
    return call.keywords["sw_batch_size"]  # a functools.partial of the sliding-window call


@pytest.mark.parametrize(
    ("times", "chosen"),
    [
        ({1: 1.0, 2: 0.6, 4: 0.4, 8: 0.39}, 4),  # 8 is inside the noise of 4: the smaller one stays
        ({1: 1.0, 2: 1.2, 4: 0.1, 8: 0.1}, 1),  # the search stops at the first size that is not faster
        ({1: 1.0, 2: 0.5, 4: 0.25, 8: 0.1}, 8),  # capped by the number of windows (8 here)
    ],
)
def test_auto_keeps_the_fastest_outside_the_noise(times: dict[int, float], chosen: int) -> None:
    net = nn.Conv3d(1, 1, 1)
    settings = validate_sliding_window(roi_size=(8, 8, 8), overlap=0.0, sw_batch_size="auto")
    x = torch.randn(1, 1, 16, 16, 16)  # 2 x 2 x 2 = 8 windows
    choice = choose_sw_batch_size(x, net, settings, measure=_fake_measure(times))
    assert choice.chosen == chosen
    assert choice.candidates == [1, 2, 4, 8]
    assert all(row.speedup_ci95 is not None for row in choice.comparisons)
    assert f"sw_batch_size={chosen} chosen" in choice.summary()


def test_auto_respects_the_memory_headroom(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_perf.functional.attention.sliding_window as sw

    x = torch.randn(1, 1, 32, 32, 32)  # 64 windows of 8^3
    monkeypatch.setattr(sw, "memory_headroom_bytes", lambda device: 10 * 2**20)
    monkeypatch.setattr(sw.MemoryProbe, "reset_peak", lambda self: False)  # no peak: the window-size estimate
    settings = validate_sliding_window(roi_size=8, overlap=0.0, sw_batch_size="auto")
    choice = choose_sw_batch_size(x, nn.Conv3d(1, 64, 1), settings, measure=_fake_measure({}))
    # One window: 2 KiB in, 64 channels x 32^3 x 4 B = 8 MiB of output; 0.8 x 10 MiB allows one window only.
    assert choice.memory_limit == 1 and choice.candidates == [1] and choice.chosen == 1
    assert "memory allows up to 1" in choice.summary()


def test_auto_picks_reports_once_and_equals_monai(caplog: pytest.LogCaptureFixture) -> None:
    model, loader = _model(3), _volumes(3, count=4)
    callback = SlidingWindowInferenceCallback(ROI[3], sw_batch_size="auto", overlap=0.5)
    assert callback.chosen_sw_batch_size is None
    with caplog.at_level(logging.INFO):
        predictions = _trainer([callback]).predict(model, dataloaders=loader)
    chosen = callback.chosen_sw_batch_size
    assert isinstance(chosen, int) and chosen in callback.choice.candidates
    reports = [r.getMessage() for r in caplog.records if "sw_batch_size='auto'" in r.getMessage()]
    assert len(reports) == 1 and f"sw_batch_size={chosen} chosen" in reports[0], reports
    model.eval()  # predict ran in eval mode; Lightning gave the model back in training mode
    for prediction, (x,) in zip(predictions, loader):
        with torch.no_grad():
            expected = sliding_window_inference(x, ROI[3], chosen, model.net, overlap=0.5, mode="gaussian")
        assert (prediction - expected).abs().max() < 1e-4
    # A second run reuses the choice without measuring again.
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _trainer([callback]).predict(model, dataloaders=loader)
    assert not [r for r in caplog.records if "sw_batch_size='auto'" in r.getMessage()]


# ------------------------------------------------------------------------------------------------ undone on every exit


class _Boom(RuntimeError):
    pass


@pytest.mark.parametrize("exception", [_Boom, KeyboardInterrupt])
def test_forward_restored_after_an_exception_in_predict(exception: type[BaseException]) -> None:
    model, loader = _model(3), _volumes(3, count=4)

    class FailSecond(pl.Callback):
        def on_predict_batch_start(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, *args: Any
        ) -> None:
            assert sliding_window_patch(model) is not None  # the window is on during predict
            if batch_idx == 1:
                raise exception("stop")

    callback = SlidingWindowInferenceCallback(ROI[3])
    trainer = _trainer([callback, FailSecond()])
    sigint = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit if exception is KeyboardInterrupt else _Boom):  # Lightning exits on Ctrl+C
            trainer.predict(model, dataloaders=loader)
    finally:
        signal.signal(signal.SIGINT, sigint)  # Lightning ignores SIGINT from a Ctrl+C on
    assert "forward" not in model.__dict__ and sliding_window_patch(model) is None and not callback.active
    # A second run behaves as the first.
    model.seen.clear()
    assert len(_trainer([callback]).predict(model, dataloaders=loader)) == 2
    assert all(shape[2:] == ROI[3] for shape in model.seen)


def test_other_forward_patches_survive() -> None:
    model = _model(3)

    def users_forward(x: Tensor) -> Tensor:
        return type(model).forward(model, x) + 1

    model.forward = users_forward  # an instance-level forward of the user's
    _trainer([SlidingWindowInferenceCallback(ROI[3])]).predict(model, dataloaders=_volumes(3))
    assert model.__dict__["forward"] is users_forward


def test_pickles_and_patch_is_not_stacked() -> None:
    model = _model(3)
    settings = validate_sliding_window(roi_size=ROI[3])
    assert isinstance(apply_sliding_window(model, settings), SlidingWindowForward)
    assert apply_sliding_window(model, settings) is None
    callback = SlidingWindowInferenceCallback(ROI[3], sw_batch_size="auto")
    clone = pickle.loads(pickle.dumps(callback))
    assert clone.settings == callback.settings
    remove_sliding_window(model)


# ------------------------------------------------------------------------------------------------ stacking


def test_stacks_with_channels_last_and_bf16_true() -> None:
    model, loader = _model(3), _volumes(3)
    callbacks = [ChannelsLastCallback(), SlidingWindowInferenceCallback(ROI[3], sw_batch_size=2, mode="gaussian")]
    (prediction,) = _trainer(callbacks, precision="bf16-true").predict(model, dataloaders=loader)
    assert prediction.dtype == torch.bfloat16
    (x,) = next(iter(loader))
    x = x.to(torch.bfloat16).to(memory_format=torch.channels_last_3d)
    model.eval()
    assert next(model.parameters()).dtype == torch.bfloat16  # bf16-true converted the model
    with torch.no_grad():
        expected = sliding_window_inference(x, ROI[3], 2, model.net, mode="gaussian")  # model is bf16 after predict
    assert (prediction.float() - expected.float()).abs().max() < 1e-4
    assert "forward" not in model.__dict__


@pytest.mark.slow
def test_stacks_with_compile_of_the_blocks() -> None:
    from lightning_perf.callbacks import CompileCallback

    model, loader = _model(3), _volumes(3)
    callbacks = [CompileCallback(backend="eager", regions=[nn.Sequential]), SlidingWindowInferenceCallback(ROI[3])]
    (prediction,) = _trainer(callbacks).predict(model, dataloaders=loader)
    (x,) = next(iter(loader))
    assert (prediction - _reference(model, x, 3, 1, "gaussian")).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        # (test_bad_inputs.py names every argument's bad values; these rows check the kind and the explanation)
        ({"roi_size": ()}, ValueError, r"roi_size=\(\)"),
        ({"roi_size": 0}, ValueError, r"roi_size=0.*positive integer"),
        ({"roi_size": 8.0}, ValueError, r"roi_size=8.0"),
        ({"roi_size": True}, ValueError, r"roi_size=True"),
        ({"roi_size": "patch"}, ValueError, r"roi_size='patch'.*'model'"),
        ({"roi_size": 8, "overlap": 1.0}, ValueError, r"overlap=1.0.*\[0, 1\)"),
        ({"roi_size": 8, "sw_batch_size": 0}, ValueError, r"sw_batch_size=0.*>= 1 or 'auto'"),
        ({"roi_size": 8, "sw_batch_size": "fast"}, ValueError, r"sw_batch_size='fast'"),
        ({"roi_size": 8, "sw_batch_size": 2.0}, ValueError, r"sw_batch_size=2.0"),
        ({"roi_size": 8, "mode": "linear"}, ValueError, r"mode='linear'.*'constant', 'gaussian'"),
        ({"roi_size": 8, "sigma_scale": 0}, ValueError, r"sigma_scale=0.*> 0"),
        ({"roi_size": 8, "sigma_scale": (0.1, -1)}, ValueError, r"sigma_scale=\(0.1, -1\)"),
        ({"roi_size": 8, "progress": "yes"}, TypeError, r"progress='yes'"),
        ({"roi_size": 8, "roi_weight_map": [1.0]}, TypeError, r"roi_weight_map=\[1.0\]"),
        ({"roi_size": 8, "roi_weight_map": -torch.ones(8, 8)}, ValueError, r"roi_weight_map=.*non-negative"),
        ({"roi_size": 8, "process_fn": 3}, TypeError, r"process_fn=3"),
        ({"roi_size": 8, "buffer_dim": 1.0}, TypeError, r"buffer_dim=1.0"),
        ({"roi_size": 8, "device": 3}, TypeError, r"device=3"),
        ({"roi_size": 8, "stages": ["fit"]}, ValueError, r"stages=\['fit'\].*'fit' is not one of them"),
        ({"roi_size": 8, "stages": []}, ValueError, r"stages=\[\].*non-empty list"),
        ({"roi_size": 8, "stages": 3}, ValueError, r"stages=3"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=rf"SlidingWindowInferenceCallback\({message}"):
        SlidingWindowInferenceCallback(**kwargs)


def test_buffered_mode_is_passed_through() -> None:
    net = nn.Conv3d(1, 2, 1)
    x = torch.randn(1, 1, 16, 16, 12)
    settings = validate_sliding_window(roi_size=8, sw_batch_size=2, mode="constant", buffer_steps=1, buffer_dim=0)
    apply_sliding_window(net, settings)
    with torch.no_grad():
        out = net(x)
    remove_sliding_window(net)
    with torch.no_grad():
        expected = sliding_window_inference(x, 8, 2, net, mode="constant", buffer_steps=1, buffer_dim=0)
    assert (out - expected).abs().max() < 1e-5
