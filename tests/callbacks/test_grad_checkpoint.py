"""GradCheckpointCallback: what it wraps and reports, when it refuses, and that training is the plain model's."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn

from lightning_perf import NoEffectWarning
from lightning_perf.callbacks import GradCheckpointCallback
from lightning_perf.functional.checkpoint.apply import CheckpointedForward, checkpointed_modules
from lightning_perf.functional.compile.budget import CompilerBudgetForward
from lightning_perf.functional.surgery import find_forward_patch
from tests._models import SequenceModule, encoder, trainer
from tests.callbacks._interrupt import fit_interrupted, fit_losses, plain_model_signature


class Spy(GradCheckpointCallback):
    """Records which blocks are checkpointed while training runs."""

    seen: list[str]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.seen = checkpointed_modules(pl_module)


def test_fit_checkpoints_the_layers_reports_them_and_unwraps_after(tmp_path: Path, caplog) -> None:
    model = SequenceModule(encoder(depth=3))
    callback = Spy()
    with caplog.at_level(logging.INFO):
        trainer(tmp_path, callbacks=[callback]).fit(model)
    assert callback.wrapped == callback.seen == ["net.layers.0", "net.layers.1", "net.layers.2"]
    assert "activation checkpointing on 3 of 3 blocks (TransformerEncoderLayer): net.layers.0" in caplog.text
    assert checkpointed_modules(model) == []  # the model is the user's again after fit


def test_training_equals_the_plain_model(tmp_path: Path) -> None:
    results = []
    for callbacks in ([], [GradCheckpointCallback("torch.nn.TransformerEncoderLayer")]):
        torch.manual_seed(0)
        model = SequenceModule(encoder(depth=2, dropout=0.1))
        trainer(tmp_path, callbacks=callbacks, max_steps=4).fit(model)
        results.append(model.state_dict())
    for key in results[0]:
        torch.testing.assert_close(results[1][key], results[0][key], atol=0, rtol=0, msg=key)


# Resume equal to an uninterrupted run, checkpoint keys, loading without the callback: the registry's generic tests
# (tests/test_generic.py) for each GradCheckpointCallback entry, the memory budget's included.


def test_layers_built_in_configure_model_are_found(tmp_path: Path) -> None:
    class Deferred(SequenceModule):
        def __init__(self) -> None:
            super().__init__(nn.Identity())

        def configure_model(self) -> None:
            if isinstance(self.net, nn.Identity):
                self.net = encoder(depth=2)

    callback = Spy()
    trainer(tmp_path, callbacks=[callback]).fit(Deferred())
    assert callback.seen == ["net.layers.0", "net.layers.1"]


def test_every_n_and_fit_twice(tmp_path: Path) -> None:
    model = SequenceModule(encoder(depth=4))
    callback = Spy(every_n=2)
    for _ in range(2):
        trainer(tmp_path, callbacks=[callback]).fit(model)
        assert callback.seen == ["net.layers.0", "net.layers.2"]
        assert all(find_forward_patch(m, CheckpointedForward) is None for m in model.modules())


def test_already_checkpointed_blocks_are_reported_and_left_to_their_owner(tmp_path: Path, caplog) -> None:
    from lightning_perf.functional.checkpoint.apply import apply_activation_checkpointing

    model = SequenceModule(encoder(depth=2))
    apply_activation_checkpointing(model, filter_fn=lambda m, n: n == "net.layers.0")
    callback = GradCheckpointCallback()
    with caplog.at_level(logging.INFO):
        trainer(tmp_path, callbacks=[callback]).fit(model)
    assert callback.wrapped == ["net.layers.1"]
    assert "already checkpointed before: net.layers.0" in caplog.text
    assert checkpointed_modules(model) == ["net.layers.0"]


def test_nothing_to_checkpoint_warns(tmp_path: Path) -> None:
    model = SequenceModule(nn.Linear(16, 16))
    with pytest.warns(NoEffectWarning, match=r"GradCheckpointCallback\(modules='auto'\) found no repeated blocks"):
        trainer(tmp_path, callbacks=[GradCheckpointCallback()]).fit(model)
    with pytest.warns(NoEffectWarning, match="filter_fn='nothing'.*matched nothing"):

        def nothing(module: nn.Module, name: str) -> bool:
            return False

        trainer(tmp_path, callbacks=[GradCheckpointCallback(filter_fn=nothing)]).fit(SequenceModule())


def test_unknown_class_name_fails_at_setup(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'TransformerEncoderLayr' \\(did you mean 'TransformerEncoderLayer'"):
        trainer(tmp_path, callbacks=[GradCheckpointCallback("TransformerEncoderLayr")]).fit(SequenceModule())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"modules": "torch.nn.NoSuchLayer"}, ValueError, "Cannot import the module class 'torch.nn.NoSuchLayer'"),
        ({"modules": "torch.nn.functional.relu"}, ValueError, r"modules='torch.nn.functional.relu'.*not a subclass"),
        ({"modules": 3}, TypeError, r"`GradCheckpointCallback\(modules=3\)` is not valid.*`modules` got 3"),
        ({"modules": None}, TypeError, r"modules=None.*Expected 'auto'"),
        ({"modules": ""}, TypeError, r"modules=''.*Expected 'auto'"),
        ({"modules": []}, ValueError, r"modules=\[\]\)` is not valid.*`modules` is empty"),
        ({"modules": [nn.Linear, 3.5]}, TypeError, r"`modules` got 3.5"),
        ({"modules": "Block", "filter_fn": lambda m, n: True}, ValueError, "either `modules` or `filter_fn`"),
        ({"filter_fn": "layers"}, TypeError, r"filter_fn='layers'.*not valid.*Expected None or a function"),
        ({"filter_fn": 3}, TypeError, r"filter_fn=3.*not valid"),
        ({"fraction": 0.0}, ValueError, r"GradCheckpointCallback\(fraction=0.0\).*> 0 and <= 1"),
        ({"fraction": 1.5}, ValueError, r"fraction=1.5.*> 0 and <= 1"),
        ({"fraction": float("nan")}, ValueError, r"fraction=nan.*> 0 and <= 1"),
        ({"fraction": float("inf")}, ValueError, r"fraction=inf.*> 0 and <= 1"),
        ({"fraction": "0.5"}, ValueError, r"fraction='0.5'.*Expected a finite number"),
        ({"fraction": True}, ValueError, r"fraction=True.*Expected a finite number"),
        ({"every_n": -1}, ValueError, r"GradCheckpointCallback\(every_n=-1\).*integer >= 1"),
        ({"every_n": 0}, ValueError, r"every_n=0.*integer >= 1"),
        ({"every_n": 1.5}, ValueError, r"every_n=1.5.*Expected an integer"),
        ({"every_n": True}, ValueError, r"every_n=True.*Expected an integer"),
        ({"every_n": 2, "fraction": 0.5}, ValueError, r"every_n=2, fraction=0.5.*not both"),
        ({"preserve_rng_state": "false"}, TypeError, r"preserve_rng_state='false'.*Expected True or False"),
        ({"preserve_rng_state": None}, TypeError, r"preserve_rng_state=None.*Expected True or False"),
        ({"preserve_rng_state": 0}, TypeError, r"preserve_rng_state=0.*Expected True or False"),
        ({"modules": "nonexistent"}, ValueError, r"modules='nonexistent'.*neither 'auto' nor the name of an nn.Module"),
        ({"modules": ["Block", "autoo"]}, ValueError, r"'autoo' is neither 'auto'"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as info:
        GradCheckpointCallback(**kwargs)
    assert "GradCheckpointCallback" in str(info.value)


@pytest.mark.parametrize("error", [RuntimeError("boom at step 3"), KeyboardInterrupt()], ids=["RuntimeError", "Ctrl+C"])
def test_a_failed_or_interrupted_fit_leaves_the_plain_model(tmp_path: Path, error: BaseException) -> None:
    torch.manual_seed(0)
    model = SequenceModule(encoder(depth=3, dropout=0.1))
    initial = copy.deepcopy(model.state_dict())
    plain = plain_model_signature(model)
    callback = Spy()
    first = fit_interrupted(tmp_path, model, callback, error)
    assert len(first) == 3 and callback.seen == ["net.layers.0", "net.layers.1", "net.layers.2"]
    assert checkpointed_modules(model) == []
    assert plain_model_signature(model) == plain
    # The same model, from the same weights and seed, trains as in the first fit: nothing was left stacked on it.
    model.load_state_dict(initial)
    second = fit_losses(tmp_path, model, GradCheckpointCallback())
    assert second == pytest.approx(first, rel=1e-6, abs=1e-7)
    assert plain_model_signature(model) == plain


def test_a_class_name_the_model_lacks_fails_at_setup_naming_modules() -> None:
    callback = GradCheckpointCallback(modules="NoSuchBlock")  # could be a class not imported yet: checked at setup
    model = SequenceModule(encoder(depth=2))
    with pytest.raises(ValueError, match=r"GradCheckpointCallback\(modules='NoSuchBlock'\).*'NoSuchBlock'"):
        callback._apply(model)
    assert checkpointed_modules(model) == []


def test_fsdp_warns_with_the_advice_and_leaves_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeTrainer:
        strategy = FSDPStrategy()

    model = SequenceModule(encoder(depth=2))
    with pytest.warns(NoEffectWarning, match=r"under FSDP.*activation_checkpointing_policy"):
        GradCheckpointCallback().setup(FakeTrainer(), model, "fit")  # type: ignore[arg-type]
    assert checkpointed_modules(model) == []


def test_bf16_mixed_precision(tmp_path: Path) -> None:
    model = SequenceModule(encoder(depth=2))
    callback = Spy()
    trainer(tmp_path, callbacks=[callback], precision="bf16-mixed").fit(model)
    assert callback.seen == ["net.layers.0", "net.layers.1"]


# ----------------------------------------------------------------------------------------------- memory_budget


def prenorm_encoder(depth: int = 4, dim: int = 32, dropout: float = 0.0) -> nn.Module:
    layer = nn.TransformerEncoderLayer(dim, 2, 4 * dim, dropout=dropout, batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)


def budget_model(dropout: float = 0.0) -> SequenceModule:
    return SequenceModule(prenorm_encoder(dropout=dropout), dim=32, seq=32, samples=32)


def test_memory_budget_plans_applies_measures_reports_once_and_unwraps(tmp_path: Path, caplog) -> None:
    model = budget_model()
    callback = Spy(memory_budget=0.5)
    with caplog.at_level(logging.INFO):
        trainer(tmp_path, callbacks=[callback], max_steps=4).fit(model)
    plan = callback.plan
    assert plan is not None and plan.checkpointed and callback.wrapped == plan.regions
    assert callback.seen == callback.wrapped  # checkpointed while training
    assert plan.expected_bytes <= 0.5 * plan.baseline_bytes
    assert plan.measured_ratio is not None and plan.measured_ratio <= 0.5 * 1.15  # allocator, first checkpointed step
    assert caplog.text.count("GradCheckpointCallback: memory_budget=0.5: checkpointing in") == 1
    assert "measured:" in caplog.text
    assert checkpointed_modules(model) == []


def test_memory_budget_profiles_the_second_warm_step(tmp_path: Path) -> None:
    class Profiled(GradCheckpointCallback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
            state = self._budget_state
            if state is not None and state.recorder is not None and state.recorder.active:
                self.profiled_at = batch_idx

    callback = Profiled(memory_budget=0.5)
    trainer(tmp_path, callbacks=[callback], max_steps=1).fit(budget_model())
    assert callback.plan is None and not hasattr(callback, "profiled_at")  # one step: the warm-up alone
    trainer(tmp_path, callbacks=[callback], max_steps=3).fit(budget_model())
    assert callback.profiled_at == 1 and callback.plan is not None and callback.plan.checkpointed


def test_memory_budget_trains_as_the_plain_model(tmp_path: Path) -> None:
    results = []
    for callbacks in ([], [GradCheckpointCallback(memory_budget=0.3)]):
        torch.manual_seed(0)
        model = budget_model(dropout=0.1)
        trainer(tmp_path, callbacks=callbacks, max_steps=4).fit(model)
        results.append(model.state_dict())
    for key in results[0]:
        torch.testing.assert_close(results[1][key], results[0][key], msg=key)


def test_memory_budget_fit_twice(tmp_path: Path) -> None:
    model = budget_model()
    callback = Spy(memory_budget=0.5)
    for _ in range(2):
        trainer(tmp_path, callbacks=[callback], max_steps=3).fit(model)
        assert callback.seen and checkpointed_modules(model) == []


def test_memory_budget_one_checkpoints_nothing_and_says_so(tmp_path: Path, caplog) -> None:
    model = budget_model()
    callback = Spy(memory_budget=1.0)
    with caplog.at_level(logging.INFO):
        trainer(tmp_path, callbacks=[callback]).fit(model)
    assert callback.seen == [] and callback.plan is None
    assert caplog.text.count("memory_budget=1.0): no activation checkpointing") == 1


@pytest.mark.parametrize("error", [RuntimeError("boom at step 3"), KeyboardInterrupt()], ids=["RuntimeError", "Ctrl+C"])
def test_memory_budget_undone_on_a_failed_fit(tmp_path: Path, error: BaseException) -> None:
    model = budget_model()
    plain = plain_model_signature(model)
    callback = Spy(memory_budget=0.5)
    fit_interrupted(tmp_path, model, callback, error)
    assert callback.seen and checkpointed_modules(model) == []
    assert plain_model_signature(model) == plain


def test_memory_budget_under_compile_sets_the_compiler_budget_and_restores_it(tmp_path: Path) -> None:
    from torch._functorch import config

    from lightning_perf.callbacks import CompileCallback

    class Seen(GradCheckpointCallback):
        budget_seen: float | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
            self.budget_seen = config.activation_memory_budget

    before = config.activation_memory_budget
    callback = Seen(memory_budget=0.5)

    class Stop(RuntimeError):
        pass

    class FailAtStart(pl.Callback):
        def on_train_batch_start(self, *args: object) -> None:
            raise Stop("no need to compile: the setting is what is tested")

    model = budget_model()
    with pytest.raises(Stop):
        trainer(tmp_path, callbacks=[CompileCallback(), callback, FailAtStart()]).fit(model)
    assert callback.budget_seen == 0.5 and callback.plan is None
    assert config.activation_memory_budget == before
    assert all(find_forward_patch(m, CompilerBudgetForward) is None for m in model.modules())


class CompiledMLP(SequenceModule):
    """A tiny model whose compiled graph has pointwise work to recompute: a budget changes what it saves."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        block = [nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128), nn.LayerNorm(128)]
        blocks = [nn.Sequential(*copy.deepcopy(block)) for _ in range(2)]
        super().__init__(nn.Sequential(*blocks), dim=128, seq=16, samples=24)


def compiled_fit(tmp_path: Path, budget: float, backend: str) -> GradCheckpointCallback:
    from lightning_perf.callbacks import CompileCallback

    callback = GradCheckpointCallback(memory_budget=budget)
    compile_callback = CompileCallback(backend=backend)
    trainer(tmp_path, callbacks=[compile_callback, callback], max_steps=3, limit_val_batches=0).fit(CompiledMLP())
    return callback


def test_a_second_compiled_fit_with_another_budget_compiles_again_and_keeps_less(tmp_path: Path) -> None:
    """The issue: dynamo reused the graph compiled under the first fit's budget. Now the budget is in its guards."""
    import warnings

    backend = "aot_eager_decomp_partition"  # AOTAutograd's min-cut partitioner (the budget's knapsack), no inductor
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = compiled_fit(tmp_path, 0.99, backend)
        second = compiled_fit(tmp_path, 0.05, backend)
    assert not [str(w.message) for w in caught if "GradCheckpointCallback" in str(w.message)]
    assert first.compiled_kept_bytes is not None and second.compiled_kept_bytes is not None
    assert second.compiled_kept_bytes < 0.8 * first.compiled_kept_bytes


def test_a_compiled_budget_without_effect_warns_once(tmp_path: Path) -> None:
    # backend="eager": dynamo traces, AOTAutograd never runs, so no partitioner reads the budget.
    with pytest.warns(NoEffectWarning, match=r"memory_budget=0.5\) on a compiled model: no graph was compiled") as seen:
        compiled_fit(tmp_path, 0.5, "eager")
    assert sum("no graph was compiled" in str(w.message) for w in seen) == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"memory_budget": 0}, ValueError, r"memory_budget=0\).*> 0 and <= 1"),
        ({"memory_budget": -0.5}, ValueError, r"memory_budget=-0.5\).*> 0 and <= 1"),
        ({"memory_budget": 1.5}, ValueError, r"memory_budget=1.5\).*> 0 and <= 1"),
        ({"memory_budget": float("nan")}, ValueError, r"memory_budget=nan\).*> 0 and <= 1"),
        ({"memory_budget": float("inf")}, ValueError, r"memory_budget=inf\).*> 0 and <= 1"),
        ({"memory_budget": True}, ValueError, r"memory_budget=True\).*Expected a finite number"),
        ({"memory_budget": "0.5"}, ValueError, r"memory_budget='0.5'\).*Expected a finite number"),
        ({"memory_budget": 0.5, "every_n": 2}, ValueError, r"memory_budget=0.5, every_n=2.*not both"),
        ({"memory_budget": 0.5, "fraction": 0.5}, ValueError, r"fraction=0.5\)`: give `memory_budget`.*not both"),
    ],
)
def test_bad_memory_budgets_fail_at_construction(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as info:
        GradCheckpointCallback(**kwargs)
    assert "GradCheckpointCallback" in str(info.value)
