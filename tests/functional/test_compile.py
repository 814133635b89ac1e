"""In-place and regional torch.compile: region choice, state_dict keys, fallback, counters.

Every test here uses a cheap backend (a counting one, ``eager`` or ``aot_eager``): they still run dynamo's graph
capture, guards, caches and counters, without inductor's cold compile.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_perf import FallbackWarning
from lightning_perf.functional.compile.regions import (
    CompileMonitor,
    compile_options,
    compile_regions,
    is_compiler_error,
    select_regions,
    top_level_blocks,
    validate_regions,
)
from tests._compiling import Block, CountingBackend, Tower, failing_backend


@pytest.fixture(autouse=True)
def _fresh_compiler_caches():
    """Torch caches compiled code per code object for the whole process; each test starts from empty caches."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Staged(nn.Module):
    """ResNet-like: stages as nn.Sequential of blocks of different widths inside an nn.Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.stages = nn.Sequential(nn.Sequential(Block(8), Block(8)), nn.Sequential(Block(8), Block(8), Block(8)))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


# ------------------------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "fastest"}, ValueError, r"mode='fastest'.*reduce-overhead"),
        ({"mode": 3}, ValueError, r"mode=3"),
        ({"fullgraph": "yes"}, TypeError, r"fullgraph='yes'.*True or False"),
        ({"dynamic": 1}, TypeError, r"dynamic=1.*True, False or None"),
        ({"backend": "no-such-backend"}, ValueError, r"backend='no-such-backend'.*inductor"),
        ({"backend": 3}, TypeError, r"backend=3"),
        ({"options": ["a"]}, TypeError, r"options=\['a'\]"),
        ({"mode": "max-autotune", "options": {"max_autotune": True}}, ValueError, r"mode or options, not both"),
    ],
)
def test_compile_options_reject_bad_arguments(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        compile_options(**kwargs, owner="Owner")


def test_compile_options_pass_everything_to_torch_compile() -> None:
    backend = CountingBackend()
    kwargs = compile_options(mode=None, fullgraph=True, dynamic=False, backend=backend, options=None)
    assert kwargs == {"fullgraph": True, "dynamic": False, "backend": backend, "mode": None, "options": None}
    assert compile_options(options={"max_autotune": True})["options"] == {"max_autotune": True}


@pytest.mark.parametrize(
    ("regions", "error", "match"),
    [
        ([], ValueError, r"regions=\[\]"),
        (3, TypeError, r"regions=3"),
        ([nn.Linear, 3], TypeError, r"item 3 is not an nn.Module class or class name"),
        ([dict], TypeError, r"item <class 'dict'> is not an nn.Module class"),
        ("all", ValueError, r"regions='all'\)` is not valid: 'all' is not a class name. Expected None .*'auto'"),
        ("auto+rest", ValueError, r"regions='auto\+rest'\)` is not valid"),  # removed: no measured gain
        (["layers"], ValueError, r"item 'layers' is not an nn.Module class or class name"),
        (["torch.nn.NoSuchLayer"], ValueError, r"regions=\['torch.nn.NoSuchLayer'\]\).*Cannot import"),
        (["torch.nn.functional.relu"], ValueError, r"not a subclass of torch.nn.Module"),
        ([""], ValueError, r"item '' is not"),
    ],
)
def test_validate_regions_rejects(regions, error, match) -> None:
    with pytest.raises(error, match=match):
        validate_regions(regions, "Owner")


def test_validate_regions_resolves_class_paths_and_keeps_names() -> None:
    assert validate_regions(None) is None
    assert validate_regions("auto") == "auto"
    resolved = validate_regions(["torch.nn.TransformerEncoderLayer", "Block", Block])
    assert resolved == (nn.TransformerEncoderLayer, "Block", Block)
    assert validate_regions(nn.Linear) == (nn.Linear,)


# ------------------------------------------------------------------------------------------------ choosing regions


def test_auto_finds_the_layers_of_a_transformer_like_model() -> None:
    model = Tower(depth=4)
    assert [name for name, _ in select_regions(model, "auto")] == [f"layers.{i}" for i in range(4)]


def test_auto_sees_through_nested_sequentials() -> None:
    names = [name for name, _ in select_regions(Staged(), "auto")]
    assert names == ["stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1", "stages.1.2"]


@pytest.mark.parametrize(
    ("workload", "expected"),
    [
        ("convnet", ["net.stages.0.0", "net.stages.1.0", "net.stages.2.0"]),  # one block per stage, across stages
        ("vit", ["net.blocks.0", "net.blocks.1"]),
        ("lm", ["net.blocks.0", "net.blocks.1"]),
        ("unet3d", ["net.encoders.0", "net.encoders.1", "net.encoders.2", "net.decoders.0", "net.decoders.1"]),
    ],
)
def test_auto_finds_the_blocks_of_every_reference_workload(workload: str, expected: list[str]) -> None:
    from lightning_perf.demos import make_workload

    model, _ = make_workload(workload, "tiny", seed=0)
    assert [name for name, _ in select_regions(model, "auto")] == expected


def test_select_regions_takes_outermost_matches_by_class_or_name() -> None:
    model = Tower(depth=2)
    assert [n for n, _ in select_regions(model, [Block])] == ["layers.0", "layers.1"]
    assert [n for n, _ in select_regions(model, ["Block"])] == ["layers.0", "layers.1"]
    # Linears inside the blocks are part of them; only the outer Linears are separate regions.
    assert [n for n, _ in select_regions(model, [Block, nn.Linear])] == ["embed", "layers.0", "layers.1", "head"]
    assert select_regions(model, None) == [("", model)]
    assert select_regions(model, [nn.Conv2d]) == []


def test_top_level_blocks_are_the_children_holding_parameters() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.ModuleList([nn.Linear(2, 2)]))
    assert [n for n, _ in top_level_blocks(model)] == ["0", "2.0"]


# ------------------------------------------------------------------------------------------------------- compiling


def test_in_place_compile_keeps_state_dict_keys_and_outputs_and_is_undone() -> None:
    torch.manual_seed(0)
    model, x = Tower(), torch.randn(3, 8)
    keys, expected = list(model.state_dict()), model(x)
    compiled = compile_regions(model, backend="eager")
    assert compiled.names == [""] and compiled.active == [""]
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    assert list(model.state_dict()) == keys  # no `_orig_mod.` prefix
    plain = Tower()
    plain.load_state_dict(model.state_dict())  # loads into a plain model, and the other way round
    model.load_state_dict(plain.state_dict())
    compiled.remove()
    assert compiled.active == [] and all(m._compiled_call_impl is None for m in model.modules())
    compiled.remove()  # idempotent


def test_identical_blocks_share_one_graph_without_recompiling() -> None:
    backend, model = CountingBackend(), Tower(depth=6)
    monitor = CompileMonitor()
    monitor.start()
    compiled = compile_regions(model, "auto", backend=backend)
    x = torch.randn(3, 8, requires_grad=True)
    model(x).sum().backward()
    model(x).sum().backward()
    stats = monitor.stop()
    assert len(compiled.names) == 6
    assert len(backend.graphs) == 1, "six identical blocks should reuse the first block's graph"
    assert stats.compilations == 1 and stats.recompiles == 0 and stats.unique_graphs == 1
    assert stats.compile_time_s > 0
    assert compiled.calls == 12
    compiled.remove()


def test_builtin_layers_are_really_compiled() -> None:
    # nn.Module.compile() of torch 2.13 captures nothing for torch.nn's own layers (pytorch/pytorch#150915).
    backend = CountingBackend()
    layers = nn.Sequential(*(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True) for _ in range(3)))
    compiled = compile_regions(layers, [nn.TransformerEncoderLayer], backend=backend)
    x = torch.randn(2, 5, 8, requires_grad=True)  # as every layer's input is then: one graph serves all
    out = layers(x)
    assert compiled.names == ["0", "1", "2"]
    assert len(backend.graphs) == 1
    compiled.remove()
    torch.testing.assert_close(out, layers(x))


def test_differently_shaped_blocks_do_not_hit_the_recompile_limit() -> None:
    backend = CountingBackend()
    blocks = [Block(width) for width in range(2, 14)]  # 12 configurations of one class: more than the limit of 8
    compiled = compile_regions(nn.ModuleList(blocks), [Block], backend=backend, dynamic=False)
    for block in blocks:
        block(torch.randn(3, block.fc1.in_features))
    assert len(backend.graphs) == len(blocks)
    compiled.remove()


def test_monitor_counts_recompilations_and_graph_breaks() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.fc(x)
            torch._dynamo.graph_break()
            return x * 2

    model, monitor = Broken(), CompileMonitor()
    monitor.start()
    compiled = compile_regions(model, backend=CountingBackend(), dynamic=False)
    model(torch.randn(2, 4))
    model(torch.randn(2, 4))  # cached
    model(torch.randn(3, 4))  # new static shape: recompiles
    live = monitor.stats
    stats = monitor.stop()
    assert stats == live
    assert stats.graph_breaks >= 1 and any("graph_break()" in reason for reason in stats.graph_break_reasons)
    assert stats.recompiles >= 1 and stats.compilations > stats.recompiles
    assert stats.unique_graphs >= 2
    model(torch.randn(4, 4))  # after stop(): not counted
    assert monitor.stop() == stats
    compiled.remove()


# -------------------------------------------------------------------------------------------------------- failures


def test_compiler_failure_falls_back_to_eager_once_with_the_cause() -> None:
    torch.manual_seed(0)
    model, x = Tower(depth=3), torch.randn(2, 8)
    expected = model(x)
    compiled = compile_regions(model, "auto", backend=failing_backend)
    with pytest.warns(FallbackWarning, match=r"Block: the 3 compiled module\(s\).*simulated compiler crash"):
        out = model(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert compiled.active == []  # all three blocks, not only the one that failed
    assert "simulated compiler crash" in compiled.failures["Block"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x)  # plain now: no second attempt, no second warning


def test_strict_raises_the_compiler_error() -> None:
    model = Tower(depth=2)
    compiled = compile_regions(model, "auto", backend=failing_backend, strict=True)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="simulated compiler crash") as info:
        model(torch.randn(2, 8))
    assert is_compiler_error(info.value)
    compiled.remove()


def test_fullgraph_graph_break_is_a_compiler_failure() -> None:
    class Breaks(nn.Module):  # a class of its own: torch would reuse another class's cached graphs
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + 1
            torch._dynamo.graph_break()
            return x * 2

    model = Breaks()
    compiled = compile_regions(model, backend="eager", fullgraph=True)
    with pytest.warns(FallbackWarning, match=r"Breaks.*Unsupported"):
        out = model(torch.zeros(2))
    assert out.tolist() == [2.0, 2.0] and compiled.active == []


def test_an_error_of_the_model_propagates_unchanged() -> None:
    class Buggy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 1:
                raise ValueError("a real bug in the model")
            return x

    model = Buggy()
    compiled = compile_regions(model, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FallbackWarning
        with pytest.raises(ValueError, match="a real bug in the model"):
            model(torch.zeros(2))
    assert compiled.active == [""]  # still compiled: the model is at fault, not the compiler
    compiled.remove()


def test_a_shape_error_is_the_models_own_not_dynamos() -> None:
    # Dynamo wraps this in TorchRuntimeError while tracing; the eager re-run raises what eager PyTorch raises.
    model = nn.Sequential(Block(4))
    compiled = compile_regions(model, [Block], backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
            model(torch.randn(2, 5))
    assert type(info.value) is RuntimeError and not is_compiler_error(info.value)
    assert compiled.active == ["0"]
    compiled.remove()
