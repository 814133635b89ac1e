"""QATCallback as a thin adapter over recipe objects: the registry, refusals at construction, a full disk at the end of
fit, dynamic int8 of a LightningModule with several children, Hugging Face outputs, and QAT of a CUDA model."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchao  # noqa: F401  (the `test` extra installs it: a missing install fails here, not skips)
from torch import nn
from torch.nn import functional as F

from lightning_perf import FallbackWarning
from lightning_perf.callbacks import QATCallback
from lightning_perf.demos import make_workload
from lightning_perf.deploy.quantize import dynamic, recipes, save
from lightning_perf.deploy.quantize.quantizer import (
    DynamicInt8Recipe,
    QuantizeOptions,
    StaticPTQRecipe,
    TorchaoQATRecipe,
    X86QATRecipe,
    quantizer_for,
)
from lightning_perf.functional.quantization import qat
from tests.callbacks._quiet import quiet_trainer

QUICK = {"benchmark": False, "validation_batches": 1}


def _trainer(root: Path, callbacks: list[Any], **overrides: Any) -> pl.Trainer:
    settings: dict[str, Any] = {"max_steps": 3, "limit_val_batches": 2, "limit_predict_batches": 2, **overrides}
    return quiet_trainer(root, callbacks, **settings)


# ------------------------------------------------------------------------------------------------ the registry


def test_each_mode_is_a_recipe_carried_out_by_the_quantizer_registered_for_its_type() -> None:
    made = {
        (mode, backend): recipes.recipe_for(mode, backend, None, "QATCallback")
        for mode, backend in (("qat", None), ("qat", "torchao"), ("ptq", "x86"), ("dynamic", None))
    }
    assert [type(r) for r in made.values()] == [X86QATRecipe, TorchaoQATRecipe, StaticPTQRecipe, DynamicInt8Recipe]
    assert made["dynamic", None].backend == "auto"
    quantizers = {type(quantizer_for(r, QuantizeOptions())).__name__ for r in made.values()}
    assert quantizers == {"QATQuantizer", "StaticPTQQuantizer", "DynamicInt8Quantizer"}
    with pytest.raises(TypeError, match="No quantizer is registered for str"):
        quantizer_for("x86", QuantizeOptions())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"export": False, "onnx": True}, r"QATCallback\(export=False, onnx=True\)` is not valid"),
        ({"validation_batches": 0}, r"QATCallback\(validation_batches=0\)` is not valid.*int >= 1"),
        ({"mode": "dynamic", "validation_batches": 0}, r"validation_batches=0"),
    ],
)
def test_options_that_would_do_nothing_are_refused_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        QATCallback(**kwargs)


# ------------------------------------------------------------------------------------------------- a full disk


class MLP(pl.LightningModule):
    """One child holding a small classifier on a separable problem."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        x = torch.randn(128, 32, generator=torch.Generator().manual_seed(0))
        self.data = torch.utils.data.TensorDataset(x, x[:, :4].argmax(-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def _loader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data, batch_size=32)

    train_dataloader = val_dataloader = _loader


class _FullDisk:
    """A file whose every write fails as on a full disk."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.close()

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_writing_the_int8_model_ends_the_fit_normally(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before the fix torch's zip writer wrote to the file itself; its destructor threw again after the failed write
    # and the process aborted ("terminate called after throwing an instance of 'c10::Error'"), taking pytest with it.
    real_open = open

    def full_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(path, mode, *args, **kwargs)
        return _FullDisk(handle) if "w" in mode else handle

    monkeypatch.setattr(save, "open", full_open, raising=False)
    model = MLP()
    plain_keys = set(model.state_dict())
    callback = QATCallback(backend="torchao", dirpath=tmp_path / "out", **QUICK)
    with pytest.warns(FallbackWarning, match=r"saving: OSError: \[Errno 28\] No space left on device"):
        _trainer(tmp_path, [callback]).fit(model)
    assert callback.report is not None and not callback.report.ok and callback.report.artifact is None
    assert not (tmp_path / "out" / "model_int8").exists()  # a failed write never takes the good set's name
    assert json.loads((tmp_path / "out" / "model_int8.failed" / "model_int8.json").read_text())["ok"] is False
    assert type(model.net[0]) is nn.Linear and set(model.state_dict()) == plain_keys


# ------------------------------------------------------------------------ dynamic int8 of a multi-child module

SEEN: list[str] = []


class TokenMixer(pl.LightningModule):
    """An embedding, a stack of MLP blocks and a head as separate children (no single child holds the network)."""

    def __init__(self, width: int = 32, vocab: int = 16, depth: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(depth))  # fmt: skip
        self.out = nn.Linear(width, vocab)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (128, 8), generator=g)
        self.data = torch.utils.data.TensorDataset(tokens, (tokens * 3 + 1) % vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        SEEN.append(type(self.out).__module__)
        x = self.emb(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        return F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)

    def _loader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data, batch_size=32)

    train_dataloader = val_dataloader = predict_dataloader = _loader


@pytest.fixture
def _fresh_choices() -> None:
    dynamic.clear_cache()


def test_dynamic_quantizes_a_module_whose_layers_sit_in_several_children(tmp_path: Path, _fresh_choices: None) -> None:
    model = TokenMixer()
    callback = QATCallback(mode="dynamic", backend="eager", dirpath=tmp_path / "out", **QUICK)
    trainer = _trainer(tmp_path, [callback], max_steps=20)
    trainer.fit(model)
    report = json.loads((tmp_path / "out" / "model_int8" / "model_int8.json").read_text())
    assert report["ok"] and report["metadata"]["submodule"] is None
    assert report["validation"]["top1_agreement"] >= 0.95 and report["int8_bytes"] < report["float_bytes"]
    SEEN.clear()
    trainer.predict(model)
    assert len(SEEN) >= 2 and all(".quantized.dynamic." in kind for kind in SEEN[-2:])  # int8 stood in for forward
    assert "forward" not in model.__dict__ and type(model.out) is nn.Linear  # the float model is back
    SEEN.clear()
    model(torch.zeros(1, 8, dtype=torch.long))
    assert SEEN == ["torch.nn.modules.linear"]


def test_dynamic_choice_is_logged_once_and_remembered_by_the_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _fresh_choices: None
) -> None:
    """The first predict times the candidates and logs the choice with its figures and rule; a new callback (as in a
    new process: the choice lives in the cache file) builds the chosen back-end only and times nothing."""
    import lightning_perf.callbacks.qat as qat_callback
    from tests.deploy.test_quantize_dynamic import _row

    timed: list[str] = []
    rows = {"eager": _row(1.5, 1.4, 1.6), "onnxruntime": _row(1.55, 1.45, 1.65)}  # within noise: eager is kept
    monkeypatch.setattr(dynamic, "dynamic_candidates", lambda flags=None: (["eager", "onnxruntime"], {}))
    monkeypatch.setattr(dynamic, "_build", lambda name, module, *_: dynamic.quantize_dynamic_eager(module))
    monkeypatch.setattr(dynamic, "eager_latency", lambda *a, name, **k: timed.append(name) or [rows[name]])
    lines: list[str] = []
    monkeypatch.setattr(qat_callback, "rank_zero_info", lines.append)
    model = TokenMixer()
    for _ in range(2):
        trainer = _trainer(tmp_path, [QATCallback(mode="dynamic", dirpath=tmp_path / "out", **QUICK)])
        SEEN.clear()
        trainer.predict(model)
        assert any(".quantized.dynamic." in kind for kind in SEEN)  # the int8 copy ran
    assert timed == ["eager", "onnxruntime"]  # the first run only
    first, second = lines
    assert "chose 'eager'" in first and "1.55x [1.45-1.65]" in first and "within noise" in first
    assert "from the cache" in second and "chose 'eager'" in second and "1.50x [1.40-1.60]" in second


def test_nothing_at_the_end_of_a_fit_fails_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _fresh_choices: None
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("int8 exploded")

    monkeypatch.setattr(recipes, "export_dynamic", broken)
    callback = QATCallback(mode="dynamic", backend="eager", dirpath=tmp_path / "out", **QUICK)
    with pytest.warns(FallbackWarning, match="int8 exploded.*checkpoints are unchanged"):
        _trainer(tmp_path, [callback]).fit(TokenMixer())
    assert callback.report is None
    strict = QATCallback(mode="dynamic", backend="eager", strict=True, dirpath=tmp_path / "out", **QUICK)
    with pytest.raises(qat.QuantizationError, match="int8 exploded"):
        _trainer(tmp_path, [strict]).fit(TokenMixer())


# -------------------------------------------------------------------------------- Hugging Face model outputs


class TinyGPT2(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
        self.model = transformers.GPT2LMHeadModel(config)
        self.data = torch.utils.data.TensorDataset(
            torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))
        )

    def forward(self, ids: torch.Tensor) -> Any:
        return self.model(ids)  # a CausalLMOutputWithCrossAttentions, with a DynamicCache unless the cache is off

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch[0]).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[0][:, 1:].flatten())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def _loader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data, batch_size=8)

    train_dataloader = val_dataloader = _loader


def test_torchao_qat_of_a_hugging_face_model_validates_and_exports_its_model_output(tmp_path: Path) -> None:
    model = TinyGPT2()
    callback = QATCallback(backend="torchao", dirpath=tmp_path / "out", **QUICK)
    _trainer(tmp_path, [callback], max_steps=2).fit(model)
    assert callback.report is not None and callback.report.ok, callback.report and callback.report.problems
    assert callback.report.validation.cosine > 0.99 and callback.report.artifact.is_file()
    assert model.model.config.use_cache is True  # the cache was off for the export only
    program = torch.export.load(callback.report.artifact).module()
    assert program(torch.randint(0, 64, (3, 16)))["logits"].shape == (3, 16, 64)


# ------------------------------------------------------------------------------------------------ CUDA models


@pytest.mark.gpu
def test_x86_qat_fine_tunes_a_cuda_model_and_ends_with_a_cpu_int8_model(tmp_path: Path) -> None:
    model, data = make_workload("convnet", "tiny", seed=0)
    callback = QATCallback(dirpath=tmp_path / "out", validation_batches=2, benchmark_batch_sizes=(8,))
    seen: list[int] = []

    class CountFakeQuant(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            fake = [m for m in pl_module.net.modules() if "FakeQuant" in type(m).__name__]
            seen.append(sum(next(m.buffers()).is_cuda for m in fake))

    model.cuda()  # already on the GPU when the callback prepares it (as in a second fit)
    _trainer(tmp_path, [callback, CountFakeQuant()], accelerator="cuda").fit(model, datamodule=data)
    assert seen and all(n > 0 for n in seen)  # fake quantization trained on the GPU
    report = callback.report
    assert report is not None and report.ok and report.artifact.is_file() and report.latency
    assert report.latency[0].speedup > 0 and next(model.net.parameters()).is_cuda and not qat.is_prepared(model.net)
    program = torch.export.load(report.artifact).module()
    assert program(torch.randn(2, 3, 32, 32)).shape[0] == 2  # the int8 model runs on the CPU
