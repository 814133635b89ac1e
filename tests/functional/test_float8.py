"""Float8 training, functional layer: eligibility, the measured shape filter and its cache, convert and undo.

torchao's conversion runs on CPU modules; ``emulate=True`` computes the float8 products in high precision, so the
converted model trains here too. The timings are scripted (a timer returning chosen blocks): exact, never flaky.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_perf._warnings import MeasurementWarning
from lightning_perf.functional.quantization import float8 as f8
from lightning_perf.functional.quantization.float8 import (
    FASTER,
    NOT_FASTER,
    LinearShape,
    convert_to_float8,
    float8_unsupported_reason,
    is_sm_at_least_89,
    linear_rows,
    output_layer_names,
    plan_float8,
    sharded_linears,
)

pytest.importorskip("torchao")

pytestmark = pytest.mark.filterwarnings("ignore:.*is an Enum subclass:UserWarning")  # torchao's import on torch 2.13


class Tiny(nn.Module):
    """Two eligible layers, one too narrow (dimension 24), an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32, bias=False)
        self.narrow = nn.Linear(32, 24)
        self.head = nn.Linear(24, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.narrow(self.down(torch.relu(self.up(x)))))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.proj = nn.Linear(32, 32)
        self.lm_head = nn.Linear(32, 64, bias=False)
        self.lm_head.weight = self.embed.weight
        self.after = nn.Linear(32, 32)  # registered last, yet not the output: skip_last skips it as well


def _timer(winning: set[tuple[int, int]], calls: list[LinearShape] | None = None) -> f8.ShapeTimer:
    """Scripted timings: shapes in ``winning`` run 1.5x faster in float8, the others 1.25x slower."""

    def timer(shape: LinearShape) -> tuple[list[list[float]], list[list[float]]]:
        if calls is not None:
            calls.append(shape)
        base = [[1.0, 1.01, 0.99]] * 6
        factor = 1 / 1.5 if (shape.in_features, shape.out_features) in winning else 1.25
        return base, [[t * factor * (1 + 0.001 * i) for t in block] for i, block in enumerate(base)]

    return timer


# ------------------------------------------------------------------------------------------------ hardware gates


def test_gates_on_cpu() -> None:
    assert not is_sm_at_least_89("cpu")
    reason = float8_unsupported_reason("cpu")
    assert reason is not None and "compute capability 8.9" in reason and "'cpu'" in reason


def test_gate_names_the_gpu_and_its_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f8, "cuda_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(f8, "is_sm_at_least_89", lambda device=None: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    reason = float8_unsupported_reason("cuda")
    assert reason is not None and "NVIDIA A100-SXM4-80GB" in reason and "8.0" in reason and "8.9" in reason


# --------------------------------------------------------------------------------------------------- eligibility


def test_dimensions_and_output_layer() -> None:
    plan = plan_float8(Tiny(), filter="all")
    assert plan.names == ["up", "down"]
    assert "divisible by 16" in plan.decisions["narrow"].reason
    assert not plan.decisions["head"].convert
    assert plan_float8(Tiny(), filter="all", skip_last=False).names == ["up", "down"]  # head is 24x16 anyway


def test_skip_last_skips_the_last_and_tied_heads() -> None:
    model = Tied()
    assert output_layer_names(model) == {"lm_head", "after"}
    assert plan_float8(model, filter="all").names == ["proj"]
    assert plan_float8(model, filter="all", skip_last=False).names == ["proj", "lm_head", "after"]


def test_layers_whose_forward_is_not_linear_are_skipped() -> None:
    class LoRA(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    model = nn.Sequential(nn.MultiheadAttention(32, 2), LoRA(32, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    plan = plan_float8(model, filter="all")
    assert plan.names == ["2"]
    assert "MultiheadAttention" in plan.decisions["0.out_proj"].reason
    assert "own forward" in plan.decisions["1"].reason


def test_a_filter_function_overrides_every_rule() -> None:
    seen: list[str] = []

    def only_narrow_and_head(module: nn.Module, fqn: str) -> bool:
        seen.append(fqn)
        return fqn in ("narrow", "head")

    plan = plan_float8(Tiny(), filter=only_narrow_and_head)
    assert plan.names == ["narrow", "head"]
    assert seen == ["up", "down", "narrow", "head"]
    assert plan.decisions["up"].reason == "left out by filter_fn"


def test_bad_filter_and_missing_timer() -> None:
    with pytest.raises(ValueError, match="filter='fast'"):
        plan_float8(Tiny(), filter="fast")
    with pytest.raises(ValueError, match="needs a `timer`"):
        plan_float8(Tiny(), filter="auto")


# -------------------------------------------------------------------------------------- measured filter and cache


def test_auto_keeps_winning_shapes_drops_losing_ones_and_caches(tmp_path: Path) -> None:
    cache = tmp_path / "float8_shapes.json"
    calls: list[LinearShape] = []
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(32, 16))
    plan = plan_float8(model, timer=_timer({(64, 64)}, calls), rows=4096, cache_path=cache, cache_key="gpu=test")
    assert plan.names == ["0", "1"]
    assert plan.decisions["0"].reason == FASTER and plan.decisions["2"].reason == NOT_FASTER
    assert sorted(calls) == [LinearShape(4096, 64, 32, True), LinearShape(4096, 64, 64, True)]  # once per shape
    estimate = plan.decisions["0"].estimate
    assert estimate is not None and estimate.low > 1.0 and estimate.ratio == pytest.approx(1.5, rel=0.01)
    lost = plan.decisions["2"].estimate
    assert lost is not None and lost.high < 1.0 and lost.verdict == "slower"
    assert [line.split(":")[0] for line in plan.shape_lines()] == ["4096x64x32+bias", "4096x64x64+bias"]

    stored = json.loads(cache.read_text())
    assert stored["schema"] == 1 and set(stored["entries"]["gpu=test"]) == {"4096x64x64+bias", "4096x64x32+bias"}

    calls.clear()
    again = plan_float8(model, timer=_timer(set(), calls), rows=4096, cache_path=cache, cache_key="gpu=test")
    assert calls == [] and again.names == ["0", "1"]  # the cached figures decide, not the (now losing) timer
    assert all(d.cached for d in again.decisions.values() if d.estimate is not None)
    assert "(cached)" in again.shape_lines()[0]

    other = plan_float8(model, timer=_timer(set(), calls), rows=4096, cache_path=cache, cache_key="gpu=other")
    assert len(calls) == 2 and other.names == []  # another GPU model measures anew
    assert set(json.loads(cache.read_text())["entries"]) == {"gpu=test", "gpu=other"}

    calls.clear()
    plan_float8(model, timer=_timer(set(), calls), rows=4096, cache_path=cache, cache_key="gpu=test", refresh=True)
    assert len(calls) == 2


def test_a_shape_inside_its_noise_stays_in_bf16(tmp_path: Path) -> None:
    def noisy(shape: LinearShape) -> tuple[list[list[float]], list[list[float]]]:
        return [[1.0]] * 6, [[0.8], [1.25], [0.8], [1.25], [0.8], [1.25]]

    plan = plan_float8(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16)), timer=noisy, cache_path=tmp_path / "c")
    assert plan.names == [] and plan.decisions["0"].reason == NOT_FASTER


def test_a_corrupt_cache_warns_and_is_rewritten(tmp_path: Path) -> None:
    cache = tmp_path / "float8_shapes.json"
    cache.write_text("{not json")
    with pytest.warns(MeasurementWarning, match="not valid"):
        plan = plan_float8(
            nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16)), timer=_timer({(32, 32)}), cache_path=cache
        )
    assert plan.names == ["0"] and json.loads(cache.read_text())["schema"] == 1


def test_time_linear_shape_returns_paired_blocks_and_restores_dynamo() -> None:
    import torch._dynamo.config as dynamo_config

    limit = dynamo_config.recompile_limit
    with f8._dynamo_room(compiled=True):
        assert dynamo_config.recompile_limit > limit
    assert dynamo_config.recompile_limit == limit
    shape = LinearShape(64, 32, 32, True)
    base, fp8 = f8.time_linear_shape(shape, device="cpu", compiled=False, emulate=True, iterations=2, repeats=2)
    assert len(base) == len(fp8) == 4 and all(len(b) == 1 and b[0] > 0 for b in base + fp8)


def test_linear_rows_from_a_shape_only_forward() -> None:
    from lightning_perf.demos import make_workload

    model, _ = make_workload("lm", "tiny", seed=0)
    rows = linear_rows(model, torch.randint(0, 64, (4, 32)))
    assert rows and set(rows.values()) == {4 * 32}
    assert all(not n.startswith("_") for n in rows) and "net.head" in rows


# ------------------------------------------------------------------------------------------------ convert and undo


def test_convert_keeps_keys_dtypes_and_parameters_then_undo_keeps_the_training() -> None:
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    model = Tiny()
    model.down.eval()  # a submodule's mode is carried over to its float8 layer and back
    params = dict(model.named_parameters())
    keys = {k: v.dtype for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # built before: stays valid (same Parameters)

    conversion = convert_to_float8(model, plan_float8(model, filter="all"), emulate=True)
    assert conversion.names == ["up", "down"]
    assert isinstance(model.up, Float8Linear) and isinstance(model.down, Float8Linear)
    assert type(model.narrow) is nn.Linear and not model.down.training and model.up.training
    assert {k: v.dtype for k, v in model.state_dict().items()} == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    Tiny().load_state_dict(model.state_dict())  # a checkpoint taken now loads into the plain model

    before = model.up.weight.detach().clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(8, 32)).float().square().mean()
    loss.backward()
    optimizer.step()
    trained = model.up.weight.detach().clone()
    assert not torch.equal(trained, before) and model.up.weight.grad is not None

    conversion.undo(model)
    assert type(model.up) is nn.Linear and type(model.down) is nn.Linear and not model.down.training
    assert torch.equal(model.up.weight, trained) and model.up.weight is params["up.weight"]
    assert {k: v.dtype for k, v in model.state_dict().items()} == keys
    conversion.undo(model)  # idempotent


def test_undo_puts_back_inductors_code_generation() -> None:
    from torch._inductor.codegen.triton import TritonOverrides
    from torchao.float8 import _inductor_patch

    if _inductor_patch._PATCHED:
        pytest.skip("torchao's inductor patch was applied outside lightning_perf in this process")
    original = TritonOverrides.__dict__["minimum"]
    model = Tiny()
    conversion = convert_to_float8(model, ["up"], emulate=True)
    assert TritonOverrides.__dict__["minimum"] is not original  # torchao's workaround for triton-lang/triton#11111
    conversion.undo(model)
    assert TritonOverrides.__dict__["minimum"] is original and not _inductor_patch._PATCHED


def test_a_shared_layer_is_converted_and_restored_everywhere() -> None:
    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    conversion = convert_to_float8(model, ["0"], emulate=True)
    assert type(model[0]).__name__ == "Float8Linear" and type(model[2]).__name__ == "Float8Linear"
    conversion.undo(model)
    assert model[0] is shared and model[2] is shared


def test_float8_all_gather_weight_is_unwrapped_on_undo() -> None:
    model = Tiny()
    weight = model.up.weight
    conversion = convert_to_float8(model, ["up"], emulate=True, fsdp_float8_all_gather=True)
    assert type(model.up.weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    conversion.undo(model)
    assert type(model.up) is nn.Linear and model.up.weight is weight


def test_convert_refuses_bad_names_and_recipes() -> None:
    with pytest.raises(ValueError, match=r"not nn\.Linear layers"):
        convert_to_float8(Tiny(), ["up", "nope"], emulate=True)
    with pytest.raises(ValueError, match="recipe='int8'"):
        convert_to_float8(Tiny(), ["up"], recipe="int8")
    with pytest.raises(ValueError, match="tensorwise"):
        convert_to_float8(Tiny(), ["up"], recipe="rowwise", fsdp_float8_all_gather=True)


def test_rowwise_recipe_converts_and_trains() -> None:
    model = Tiny()
    conversion = convert_to_float8(model, ["up", "down"], recipe="rowwise", emulate=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 32)).float().sum().backward()
    assert model.up.weight.grad is not None
    conversion.undo(model)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_sharded_layers_are_refused_and_convert_then_shard_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    if dist.is_initialized():  # left by an in-process DDP fit of another test file (the same `pytest -n 2` worker)
        dist.destroy_process_group()
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = Tiny()
        fully_shard(model.up)
        fully_shard(model)
        assert sharded_linears(model) == ["up", "down", "narrow", "head"]
        with pytest.raises(ValueError, match="before `fully_shard`"):
            convert_to_float8(model, ["up"], emulate=True)
        # torchao's order, convert then shard, trains (weights all-gathered in bf16, or in float8).
        for all_gather in (False, True):
            model = Tiny()
            convert_to_float8(model, ["up", "down"], emulate=True, fsdp_float8_all_gather=all_gather)
            for module in (model.up, model.down, model):
                fully_shard(module)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(torch.randn(8, 32)).float().sum().backward()
            assert type(model.up).__name__ == "FSDPFloat8Linear" and model.up.weight.grad is not None
    finally:
        dist.destroy_process_group()
    assert sharded_linears(Tiny()) == []


# ----------------------------------------------------------------------------------------------------------- GPU


def _needs_sm89() -> None:
    if not is_sm_at_least_89("cuda"):
        pytest.skip("float8 needs a GPU of compute capability 8.9+")


@pytest.mark.gpu
def test_auto_filter_on_the_gpu_decides_from_real_timings_and_drops_64(tmp_path: Path) -> None:
    _needs_sm89()
    model = nn.Sequential(nn.Linear(4096, 4096, bias=False), nn.Linear(64, 64, bias=False), nn.Linear(64, 16))

    def timer(shape: LinearShape) -> tuple[list[list[float]], list[list[float]]]:
        return f8.time_linear_shape(shape, device="cuda", iterations=10)

    plan = plan_float8(model, timer=timer, rows=8192, cache_path=tmp_path / "c.json", cache_key=f8.machine_key("cuda"))
    print("\n".join(plan.shape_lines()))
    big, small = plan.decisions["0"], plan.decisions["1"]
    assert big.estimate is not None and small.estimate is not None, plan.shape_lines()
    # The mechanism on real CUDA timings: a lone 64x64 product is all casting overhead (0.65x on an H200) and stays
    # in bf16; float8's gain grows with the product; each decision follows its own interval. Whether 4096^2 clears
    # "faster" depends on the GPU and on what else runs on it (1.11x [0.89-1.37] beside three other test workers on
    # an H200, 2026-11-27): a figure for the bench, not for this test.
    assert not small.convert and small.estimate.high < 1.0, plan.shape_lines()
    assert big.estimate.ratio > small.estimate.ratio, plan.shape_lines()
    assert big.convert == (big.estimate.low > 1.0), plan.shape_lines()
    assert os.path.exists(tmp_path / "c.json")
