"""FlashAttentionCallback: what it swaps and reports, that training is the plain model's, and its bad inputs."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_perf import FallbackWarning, NoEffectWarning
from lightning_perf.callbacks import FlashAttentionCallback
from lightning_perf.functional.attention.swap import (
    SDPA,
    UNCHANGED,
    AttentionAdapter,
    FusedMultiheadAttention,
    FusedQKVAttention,
    FusedQKVSpec,
    SwappedAttention,
)
from tests._models import (
    BranchesOnTraining,
    EncoderWithDropout,
    FusedQKVTransformer,
    NanoGPTAttention,
    SequenceModule,
    TinyGPT,
    encoder,
    trainer,
)
from tests.callbacks._interrupt import fit_interrupted, fit_losses, plain_model_signature


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


# Resume equal to an uninterrupted run and plain checkpoint keys: the registry's generic tests (tests/test_generic.py)
# for FlashAttentionCallback on the vit and lm workloads' hand-written attention.


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


class NeedsArguments(AttentionAdapter):
    def __init__(self, heads: int) -> None:
        self.heads = heads


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"adapters": ["tests.callbacks.test_flash_attention.NoSuchAdapter"]}, ValueError, "cannot import it"),
        ({"adapters": ["no_such_package.Adapter"]}, ValueError, r"no_such_package.Adapter.*cannot import it"),
        ({"adapters": ["torch.nn.Linear"]}, ValueError, "Expected AttentionAdapter instances or class paths"),
        ({"adapters": [3]}, ValueError, r"adapters=\[3\]\)` is not valid. Expected AttentionAdapter"),
        ({"adapters": [""]}, ValueError, r"adapters=\[''\]\)` is not valid. Expected AttentionAdapter"),
        ({"adapters": ["MyAdapter"]}, ValueError, r"'MyAdapter'.*Expected AttentionAdapter instances or class paths"),
        ({"adapters": [AttentionAdapter]}, ValueError, r"Expected AttentionAdapter instances"),
        ({"adapters": [f"{__name__}.NeedsArguments"]}, ValueError, "cannot be built without arguments"),
        ({"adapters": None}, TypeError, r"adapters=None\)` is not valid. Expected a list of AttentionAdapter"),
        ({"adapters": 3}, TypeError, r"adapters=3\)` is not valid. Expected a list"),
        ({"adapters": {"a": 1}}, TypeError, r"adapters=\{'a': 1\}\)` is not valid. Expected a list"),
        ({"filter_fn": "layers"}, TypeError, r"filter_fn='layers'\)` is not valid. Expected None or a function"),
        ({"filter_fn": 3}, TypeError, r"filter_fn=3\)` is not valid. Expected None or a function"),
        ({"parity_check": "false"}, TypeError, r"parity_check='false'\)` is not valid. Expected True or False"),
        ({"parity_check": 1}, TypeError, r"parity_check=1\)` is not valid. Expected True or False"),
        ({"parity_check": None}, TypeError, r"parity_check=None\)` is not valid. Expected True or False"),
        ({"strict": "yes"}, TypeError, r"strict='yes'\)` is not valid. Expected True or False"),
        ({"strict": 0}, TypeError, r"strict=0\)` is not valid. Expected True or False"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as info:
        FlashAttentionCallback(**kwargs)
    assert "FlashAttentionCallback(" in str(info.value)


# ---------------------------------------------------------------------------------------- training mode, exceptions


class FlagsModule(SequenceModule):
    """Records, inside training_step and validation_step, the modes of every module and of the swapped ones."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.train_flags: list[tuple[bool, list[bool]]] = []
        self.val_flags: list[tuple[bool, list[bool]]] = []
        self.training_forwards_differ: list[bool] = []

    def _flags(self) -> tuple[bool, list[bool]]:
        swapped = [m.training for m in self.modules() if isinstance(m, SwappedAttention)]
        return all(m.training for m in self.modules()) if self.training else any(
            m.training for m in self.modules()
        ), swapped

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.train_flags.append(self._flags())
        with torch.no_grad():
            self.training_forwards_differ.append(not torch.equal(self(batch[0]), self(batch[0])))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.val_flags.append(self._flags())
        super().validation_step(batch, batch_idx)


NETS = {
    "fused-qkv": lambda p: FusedQKVTransformer(dropout=p),
    "mha-in-encoder-layer": lambda p: EncoderWithDropout(dropout=p),
    "branches-on-training": lambda p: nn.Sequential(FusedQKVTransformer(dropout=p), BranchesOnTraining()),
}


@pytest.mark.parametrize("net", sorted(NETS))
def test_swapped_modules_train_in_training_and_evaluate_in_validation(tmp_path: Path, net: str) -> None:
    torch.manual_seed(0)
    model = FlagsModule(NETS[net](0.2))
    callback = FlashAttentionCallback()
    trainer(tmp_path, callbacks=[callback], max_steps=4, val_check_interval=2, num_sanity_val_steps=1).fit(model)
    assert len(callback.swapped) == 2
    assert len(model.train_flags) == 4 and len(model.val_flags) == 3  # sanity check, then after steps 2 and 4
    for every_module_training, swapped in model.train_flags:
        assert every_module_training and swapped == [True, True]
    for any_module_training, swapped in model.val_flags:
        assert not any_module_training and swapped == [False, False]
    assert all(model.training_forwards_differ), "two training-mode forwards were equal: dropout never ran"


@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("net", sorted(NETS))
def test_per_step_losses_match_the_plain_model(tmp_path: Path, net: str, p: float) -> None:
    # With dropout too: on the CPU the fused kernel draws the eager code's dropout masks from the same RNG state.
    losses = []
    for callback in (None, FlashAttentionCallback()):
        torch.manual_seed(0)
        model = SequenceModule(NETS[net](p))
        losses.append(fit_losses(tmp_path, model, callback, steps=4))
    assert losses[1] == pytest.approx(losses[0], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("error", [RuntimeError("boom at step 3"), KeyboardInterrupt()], ids=["RuntimeError", "Ctrl+C"])
def test_a_failed_or_interrupted_fit_leaves_the_plain_model(tmp_path: Path, error: BaseException) -> None:
    torch.manual_seed(0)
    model = SequenceModule(FusedQKVTransformer(dropout=0.2))
    initial = copy.deepcopy(model.state_dict())
    plain = plain_model_signature(model)
    callback = Spy()
    first = fit_interrupted(tmp_path, model, callback, error)
    assert len(first) == 3 and callback.seen == ["FusedQKVAttention"]
    assert not any(isinstance(m, SwappedAttention) for m in model.modules())
    assert plain_model_signature(model) == plain
    model.load_state_dict(initial)
    second = fit_losses(tmp_path, model, FlashAttentionCallback())
    assert second == pytest.approx(first, rel=1e-6, abs=1e-7)
    assert plain_model_signature(model) == plain


def test_validate_and_predict_swap_too_and_bf16_mixed(tmp_path: Path) -> None:
    model = SequenceModule(encoder(depth=2))
    callback = FlashAttentionCallback(time_first_batch=False)  # the swap itself, whichever kernel is faster here
    run = trainer(tmp_path, callbacks=[callback], precision="bf16-mixed")
    run.fit(model)
    run.validate(model, verbose=False)
    assert callback.swapped == ["net.layers.0.self_attn", "net.layers.1.self_attn"]
    assert not any(isinstance(m, FusedMultiheadAttention) for m in model.modules())


class Kinds(FlashAttentionCallback):
    """Records the class of the first block's attention module at each training batch's start."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.seen = [*getattr(self, "seen", []), type(pl_module.net.blocks[0].attn).__name__]


@pytest.mark.parametrize("own_faster", [True, False], ids=["own-faster", "swap-faster"])
def test_on_a_cpu_in_bf16_the_first_batch_decides_between_the_swap_and_the_original(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_faster: bool
) -> None:
    """The timing is scripted (its figures are the machine's); what is checked is the mechanism: one timing per kind of
    module on the first training batch's real call, the originals back where they were at least 5% faster, the
    decision's reason with both times, state_dict keys and teardown as with any swap."""
    calls: list[tuple[tuple[int, ...], object]] = []

    def scripted(original: nn.Module, swapped: nn.Module, args: tuple, kwargs: dict, **options: object) -> tuple:
        calls.append((tuple(args[0].shape), options["compute_dtype"]))
        assert original.training and isinstance(swapped, SwappedAttention) and not kwargs
        return (1.0, 2.0) if own_faster else (2.0, 1.0)

    monkeypatch.setattr("lightning_perf.callbacks.flash_attention.time_against_original", scripted)
    model = GPTModule()
    keys = set(model.state_dict())
    callback = Kinds()
    trainer(tmp_path, callbacks=[callback], precision="bf16-mixed", max_steps=3).fit(model)
    assert calls == [((8, 7, 16), torch.bfloat16)]  # one kind of module (2 blocks), the first batch's (B, T, dim)
    names = ["net.blocks.0.attn", "net.blocks.1.attn"]
    assert [callback.decisions[n].action for n in names] == ["kept" if own_faster else "swapped"] * 2
    times = "own 1.00 ms, swapped 2.00 ms" if own_faster else "own 2.00 ms, swapped 1.00 ms"
    assert times in callback.decisions[names[0]].reason
    assert callback.swapped == ([] if own_faster else names)
    kept = "NanoGPTAttention" if own_faster else "FusedQKVAttention"
    assert callback.seen == ["FusedQKVAttention", kept, kept]  # the first batch runs swapped either way
    assert not any(isinstance(m, SwappedAttention) for m in model.modules())  # teardown: the originals, as always
    assert set(model.state_dict()) == keys


def test_the_timing_leaves_no_gradient_and_the_rng_as_it_was() -> None:
    from lightning_perf.functional.attention.swap import swap_attention, time_against_original

    model = TinyGPT(depth=1).train()
    result = swap_attention(model, device="cpu", compute_dtype=torch.bfloat16)
    ((original, swapped),) = result.replaced.values()
    x = torch.randn(2, 5, 16)
    state = torch.get_rng_state()
    own, fused = time_against_original(original, swapped, (x,), {}, compute_dtype=torch.bfloat16, repeats=2)
    assert own > 0 and fused > 0
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("own_faster", [True, False], ids=["own-faster", "swap-faster"])
def test_a_loaded_first_batch_decision_runs_the_same_code_from_the_first_batch_without_timing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_faster: bool
) -> None:
    """A later repeat of a bench (or a resumed fit) loads the first run's decision: no timing, the same modules on
    the same code from its first batch on, and its record says whose timings decided."""
    calls: list[int] = []

    def scripted(*args: object, **options: object) -> tuple:
        calls.append(1)
        return (1.0, 2.0) if own_faster else (2.0, 1.0)

    monkeypatch.setattr("lightning_perf.callbacks.flash_attention.time_against_original", scripted)
    first = FlashAttentionCallback()
    trainer(tmp_path, callbacks=[first], precision="bf16-mixed", max_steps=2).fit(GPTModule())
    names = ["net.blocks.0.attn", "net.blocks.1.attn"]
    timing = {"modules": names, "own_ms": 1.0 if own_faster else 2.0, "swapped_ms": 2.0 if own_faster else 1.0,
              "kept_own": own_faster}  # fmt: skip
    assert first.first_batch == {"timings": [timing]} and first.state_dict() == {"first_batch": first.first_batch}
    later = Kinds()
    later.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as it travels between processes
    trainer(tmp_path, callbacks=[later], precision="bf16-mixed", max_steps=3).fit(GPTModule())
    assert calls == [1]  # timed once, by the first run
    kept = "NanoGPTAttention" if own_faster else "FusedQKVAttention"
    assert later.seen == [kept] * 3  # the decided code from the first batch on
    assert [later.decisions[n].action for n in names] == [d.action for d in map(first.decisions.get, names)]
    assert "an earlier run's first training batch" in later.decisions[names[0]].reason
    assert later.first_batch == {"timings": [timing], "replayed": True}
