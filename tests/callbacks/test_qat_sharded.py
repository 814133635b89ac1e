"""QATCallback under sharded training (FSDP2): it refuses at setup, naming the strategy, and changes nothing."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_perf import NoEffectWarning
from lightning_perf.callbacks import QATCallback
from lightning_perf.functional.quantization import qat
from lightning_perf.functional.sharding import is_fsdp_module
from tests.callbacks._sharded import ShardsItself, one_process_group  # noqa: F401  (a fixture)


def _trainer(strategy: str) -> Any:
    if strategy == "ModelParallelStrategy":
        return SimpleNamespace(strategy=ModelParallelStrategy(), is_global_zero=True, callbacks=[])
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize(
    ("mode", "strategy"),
    [("qat", "SingleDeviceStrategy"), ("dynamic", "SingleDeviceStrategy"), ("ptq", "ModelParallelStrategy")],
)
def test_refuses_a_sharded_model(mode: str, strategy: str) -> None:
    """Under ModelParallelStrategy it refuses in ``setup``; a model sharded by its own ``configure_model`` (here under
    the plain strategy) once that has run. Either way: one warning naming the strategy and what to do instead, the
    model left as it is, nothing at the end of the fit and nothing left on the module."""
    callback = QATCallback(backend="eager" if mode == "dynamic" else None, mode=mode, benchmark=False)
    model, trainer = ShardsItself(), _trainer(strategy)
    with pytest.warns(NoEffectWarning, match=rf"QATCallback\(mode='{mode}'\) does nothing under {strategy}: .*DTensor"):
        callback.setup(trainer, model, "fit")
        model.configure_model()
    assert is_fsdp_module(model.net) and not qat.is_prepared(model.net)
    assert "on_load_checkpoint" not in model.__dict__ and "configure_model" not in model.__dict__
    callback.on_train_epoch_start(trainer, model)
    callback.on_fit_end(trainer, model)
    assert callback.report is None
    callback.teardown(trainer, model, "fit")
    assert not qat.is_prepared(model.net)
