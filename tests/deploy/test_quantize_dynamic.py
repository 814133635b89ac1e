"""Dynamic int8 (lightning_perf.deploy.quantize.dynamic, save.export_dynamic): back-ends, the parity filter, the
measured choice and its cache, and the artifact set with its report."""

from __future__ import annotations

import copy
import io
import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_perf import FallbackWarning, MeasurementWarning
from lightning_perf.deploy.onnx import equal_thread_options
from lightning_perf.deploy.quantize import dynamic, dynamic_cache
from lightning_perf.deploy.quantize.dynamic import (
    OnnxRuntimeModule,
    dynamic_candidates,
    has_int8_dot_product,
    quantize_dynamic,
    quantize_dynamic_eager,
    quantize_dynamic_onnxruntime,
)
from lightning_perf.deploy.quantize.save import export_dynamic
from lightning_perf.functional.quantization.qat import QuantizationError
from lightning_perf.profiling.latency import LatencyRow


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def _input(batch: int = 32) -> torch.Tensor:
    return torch.randn(batch, 16, generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    dynamic.clear_cache()


def test_eager_backend_quantizes_linear_layers_of_a_copy() -> None:
    model, x = _mlp(), _input()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantized = quantize_dynamic_eager(model)
    assert "DynamicQuantizedLinear" in {type(m).__name__ for m in quantized.modules()} or any(
        type(m).__module__.startswith("torch.ao.nn.quantized.dynamic") for m in quantized.modules()
    )
    assert all(type(m) is not nn.Linear for m in quantized.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the float model is untouched
    assert type(model[0]) is nn.Linear
    with torch.no_grad():
        cosine = nn.functional.cosine_similarity(model(x).flatten(), quantized(x).flatten(), dim=0)
    assert cosine > 0.99


def test_eager_backend_refuses_a_model_without_linear_layers() -> None:
    with pytest.raises(QuantizationError, match=r"no nn\.Linear"):
        quantize_dynamic_eager(nn.Sequential(nn.Conv2d(1, 2, 3)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "x86"}, r"quantize_dynamic\(backend='x86'\)` is not valid. Expected one of 'auto', 'eager'"),
        ({"min_cosine": 1.5}, r"min_cosine=1.5"),
        ({"min_agreement": float("nan")}, r"min_agreement=nan"),
        ({"min_agreement": True}, r"min_agreement=True"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        quantize_dynamic(_mlp(), _input(), **kwargs)


def test_candidates_follow_the_cpu_capabilities() -> None:
    avx2 = {"avx2": True, "avx512_vnni": False, "amx_int8": False}
    offered, skipped = dynamic_candidates(avx2)
    assert "torchao" not in offered and "VNNI" in skipped["torchao"]
    assert offered[0] == "eager"
    offered, skipped = dynamic_candidates({**avx2, "avx512_vnni": True})
    assert "torchao" in offered
    assert has_int8_dot_product({"amx_int8": True}) and not has_int8_dot_product(None)


def test_explicit_backend_that_disagrees_with_fp32_raises() -> None:
    with pytest.raises(QuantizationError, match="disagrees with fp32"):
        quantize_dynamic(_mlp(), _input(), "eager", min_cosine=1.0)


def test_auto_drops_wrong_candidates_and_caches_its_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    class Wrong(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.zeros(x.shape[0], 4)

    builds: list[str] = []

    def build(name: str, module: nn.Module, example: tuple, *_: object) -> nn.Module:
        builds.append(name)
        return Wrong() if name == "wrong" else quantize_dynamic_eager(module)

    monkeypatch.setattr(dynamic, "dynamic_candidates", lambda flags=None: (["wrong", "eager"], {"torchao": "no"}))
    monkeypatch.setattr(dynamic, "_build", build)
    model, x = _mlp(), _input()
    first = quantize_dynamic(model, x, iterations=2, warmup=0)
    wrong, eager = first.candidates
    assert wrong.problem is not None and "disagrees with fp32" in wrong.problem and wrong.latency is None
    assert eager.problem is None and eager.latency is not None and eager.latency.speedup_verdict
    assert first.backend in (None, "eager")  # eager only when its interval says faster; never the wrong one
    assert (first.module is None) == (first.backend is None)
    assert "torchao: not tried (no)" in first.describe()
    second = quantize_dynamic(model, x, iterations=2, warmup=0)
    assert second.cached and second.backend == first.backend
    assert builds == ["wrong", "eager"] + (["eager"] if first.backend else [])


def test_onnxruntime_backend_runs_any_batch_and_copies() -> None:
    model, x = _mlp(), _input()
    quantized = quantize_dynamic_onnxruntime(model, x[:4])
    assert isinstance(quantized, OnnxRuntimeModule)
    with torch.no_grad():
        out = quantized(x)
        ref = model(x)
    assert out.shape == ref.shape
    assert nn.functional.cosine_similarity(ref.flatten(), out.flatten(), dim=0) > 0.99
    for clone in (copy.deepcopy(quantized), pickle.loads(pickle.dumps(quantized))):
        assert torch.equal(clone(x), out)


def test_export_writes_the_set_with_its_report(tmp_path: Path) -> None:
    model, x = _mlp(), _input()
    labels = model(x).argmax(-1)
    choice = quantize_dynamic(model, x, "eager")
    options = {"dirpath": tmp_path, "filename": "mlp_int8", "batch_sizes": (8,), "latency_iterations": 2}
    report = export_dynamic(model, choice, example_inputs=x, validation_data=[(x, labels)], latency_warmup=0, **options)
    assert report.ok and report.artifact == tmp_path / "mlp_int8" / "mlp_int8.pt"
    data = json.loads((tmp_path / "mlp_int8" / "mlp_int8.json").read_text())
    assert data["backend"] == "eager" and data["mode"] == "dynamic"
    assert data["int8_bytes"] < data["float_bytes"]
    assert data["validation"]["top1_agreement"] >= 0.95 and data["validation"]["accuracy_gap_pp"] is not None
    (row,) = data["latency"]
    assert row["batch_size"] == 8 and row["speedup_verdict"] and "speedup_ci95" in row
    # The saved int8 weights load with weights_only=True into the eager back-end's structure.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notice
        fresh = torch.ao.quantization.quantize_dynamic(_mlp(5), {nn.Linear}, dtype=torch.qint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage deprecation inside torch.load of packed weights
        state = torch.load(io.BytesIO(report.artifact.read_bytes()), weights_only=True)
    fresh.load_state_dict(state)
    assert torch.equal(fresh(x), choice.module(x))


def test_a_failed_export_keeps_the_good_set(tmp_path: Path) -> None:
    model, x = _mlp(), _input()
    good = export_dynamic(
        model, quantize_dynamic(model, x, "eager"), example_inputs=x, dirpath=tmp_path, benchmark=False
    )
    before = (tmp_path / "model_int8" / "model_int8.pt").read_bytes()
    no_choice = dynamic.DynamicQuantization(None, None, "auto")
    with pytest.warns(FallbackWarning, match="not exported"):
        failed = export_dynamic(model, no_choice, example_inputs=x, dirpath=tmp_path, benchmark=False)
    assert good.ok and not failed.ok
    assert (tmp_path / "model_int8" / "model_int8.pt").read_bytes() == before
    assert json.loads((tmp_path / "model_int8.failed" / "model_int8.json").read_text())["ok"] is False
    with pytest.raises(QuantizationError, match="not exported"):
        export_dynamic(model, no_choice, example_inputs=x, dirpath=tmp_path, benchmark=False, strict=True)


def _row(speedup: float, low: float, high: float, verdict: str = "faster") -> LatencyRow:
    return LatencyRow(32, "float", "int8", 1e-3, 1e-3, 1e-3 / speedup, 1e-3 / speedup, speedup, 1.0, 1.0, 2,
                      speedup_ci95=[low, high], speedup_verdict=verdict)  # fmt: skip


@pytest.mark.parametrize(
    ("eager", "onnxruntime", "kept"),
    [
        ((1.45, 1.35, 1.55), (1.50, 1.40, 1.60), "eager"),  # overlapping intervals: within noise, the simplest
        ((1.20, 1.10, 1.30), (1.50, 1.40, 1.60), "onnxruntime"),  # apart: the fastest
        ((1.00, 0.90, 1.10, "no clear difference"), (0.50, 0.45, 0.55, "slower"), None),  # none faster: float
    ],
)
def test_choice_follows_the_stated_tie_rule(eager: tuple, onnxruntime: tuple, kept: str | None) -> None:
    candidates = [dynamic.DynamicCandidate("onnxruntime", latency=_row(*onnxruntime))]
    candidates.append(dynamic.DynamicCandidate("eager", latency=_row(*eager)))
    best = dynamic.choose(candidates)
    assert (best and best.backend) == kept
    assert "within noise, the simplest is kept" in dynamic.TIE_RULE


class _Scripted:
    """Stands in for the timing and the builds: which back-ends were timed and built, and scripted figures."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.timed: list[str] = []
        self.built: list[str] = []
        rows = {"eager": _row(1.2, 1.1, 1.3), "onnxruntime": _row(2.0, 1.9, 2.1)}
        monkeypatch.setattr(dynamic, "dynamic_candidates", lambda flags=None: (["eager", "onnxruntime"], {}))
        monkeypatch.setattr(dynamic, "_build", lambda name, module, *_: self.built.append(name) or module)
        monkeypatch.setattr(dynamic, "eager_latency", lambda *a, name, **k: self.timed.append(name) or [rows[name]])


def test_the_choice_is_cached_on_disk_per_model_and_input_shape(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    script, cache = _Scripted(monkeypatch), tmp_path / "choices.json"
    first = quantize_dynamic(_mlp(), _input(), cache_path=cache)
    assert first.backend == "onnxruntime" and not first.cached and script.timed == ["eager", "onnxruntime"]
    data = json.loads(cache.read_text())
    assert data["schema"] == 1
    (entries,) = data["entries"].values()
    (entry,) = entries.values()
    assert entry["backend"] == "onnxruntime" and [f["speedup_ci95"] for f in entry["measured"]] == [
        [1.1, 1.3],
        [1.9, 2.1],
    ]
    # A new process reads only the file: the cached back-end is built, nothing is timed.
    script.timed.clear(), script.built.clear()
    second = quantize_dynamic(_mlp(seed=3), _input(), cache_path=cache)  # other weights, same structure
    assert second.cached and second.backend == "onnxruntime" and script.timed == [] and script.built == ["onnxruntime"]
    text = second.describe()
    assert "from the cache" in text and "2.00x [1.90-2.10]" in text and "1.20x [1.10-1.30]" in text
    assert "rule: " in text and f"{torch.get_num_threads()} threads" in text
    assert second.to_dict()["measured"] == entry["measured"]
    # Another input shape, another model, or refresh=True measure again.
    for model, x, refresh in ((_mlp(), _input(8), False), (nn.Sequential(nn.Linear(16, 4)), _input(), False),
                              (_mlp(), _input(), True)):  # fmt: skip
        script.timed.clear()
        again = quantize_dynamic(model, x, cache_path=cache, refresh=refresh)
        assert not again.cached and script.timed == ["eager", "onnxruntime"]


def test_an_invalid_cache_file_warns_and_measures_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script, cache = _Scripted(monkeypatch), tmp_path / "choices.json"
    for text in ("{not json", json.dumps({"schema": 0, "entries": {}})):
        cache.write_text(text)
        with pytest.warns(MeasurementWarning, match="dynamic int8 cache"):
            result = quantize_dynamic(_mlp(), _input(), cache_path=cache)
        assert not result.cached and json.loads(cache.read_text())["schema"] == 1
    assert script.timed == ["eager", "onnxruntime"] * 2


def test_onnxruntime_sessions_run_at_torch_s_thread_count() -> None:
    ort = pytest.importorskip("onnxruntime")
    options = equal_thread_options(ort)
    assert options.intra_op_num_threads == torch.get_num_threads() and options.inter_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert equal_thread_options(ort, 3).intra_op_num_threads == 3


# ------------------------------------------------------------------------------------- the int8 ONNX model kept


def _key(**changed: str) -> dict[str, str]:
    return {"machine": "cpu=x", "model": "m", "options": "per_channel=True", "weights": "w1", **changed}


def test_int8_onnx_file_round_trip_and_refusals(tmp_path: Path) -> None:
    key, payload = _key(), b"\x08\x01onnx bytes"
    file = dynamic_cache.int8_onnx_file(tmp_path, key)
    assert dynamic_cache.read_int8_onnx(file, key) is None  # nothing kept yet: a miss, said nowhere
    dynamic_cache.write_int8_onnx(file, key, payload)
    assert dynamic_cache.read_int8_onnx(file, key) == payload
    assert dynamic_cache.int8_onnx_file(tmp_path, _key(weights="w2")) == file  # new weights replace the old ones
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dynamic_cache.read_int8_onnx(file, _key(weights="w2")) is None  # other weights: a plain miss
    data = file.read_bytes()
    header_end = data.index(b"\n", len(dynamic_cache._ONNX_MAGIC))
    foreign = data[:header_end].replace(b"cpu=x", b"cpu=y") + data[header_end:]
    for content, problem in (
        (data[:-3], "truncated or altered"),
        (data[:-1] + b"X", "do not match the hash"),
        (foreign, "written for another machine ('cpu=y')"),
        (b"PK\x03\x04 something else", "not a file this cache writes"),
        (dynamic_cache._ONNX_MAGIC + b"{not json\n" + payload, "not a file this cache writes"),
    ):
        file.write_bytes(content)
        with pytest.warns(MeasurementWarning, match="dynamic int8 ONNX cache") as record:
            assert dynamic_cache.read_int8_onnx(file, key) is None
        assert len(record) == 1 and problem in str(record[0].message)


def test_weights_key_follows_every_weight_and_buffer() -> None:
    linear, norm = nn.Linear(4, 4), nn.BatchNorm1d(4)
    model = nn.Sequential(linear, norm)
    first = dynamic_cache.weights_key(model)
    assert dynamic_cache.weights_key(copy.deepcopy(model)) == first
    with torch.no_grad():
        linear.weight[0, 0] += 1e-6
    assert dynamic_cache.weights_key(model) != first
    assert norm.running_mean is not None
    norm.running_mean.add_(1)  # a buffer counts as a weight
    assert len({first, dynamic_cache.weights_key(model), dynamic_cache.weights_key(model.to(torch.bfloat16))}) == 3


def test_onnxruntime_int8_model_is_converted_once_per_weights(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A second call with the same weights (a new process reads the same files) loads the kept int8 model: no export,
    no quantization; other weights or refresh=True convert again, an altered file is refused with one warning."""
    pytest.importorskip("onnxruntime")
    conversions: list[int] = []
    convert = dynamic._int8_onnx_bytes

    def counted(*args: Any) -> bytes:
        conversions.append(1)
        return convert(*args)

    monkeypatch.setattr(dynamic, "_int8_onnx_bytes", counted)
    cache, x = tmp_path / "choices.json", _input()
    first = quantize_dynamic(_mlp(), x, "onnxruntime", cache_path=cache)
    (kept,) = dynamic.onnx_cache_dir(cache).iterdir()
    again = quantize_dynamic(_mlp(), x, "onnxruntime", cache_path=cache)  # equal weights, another module object
    assert len(conversions) == 1 and again.backend == "onnxruntime"
    assert isinstance(again.module, OnnxRuntimeModule) and isinstance(first.module, OnnxRuntimeModule)
    assert again.module.onnx_bytes == first.module.onnx_bytes and torch.equal(again.module(x), first.module(x))
    quantize_dynamic(_mlp(seed=3), x, "onnxruntime", cache_path=cache)
    quantize_dynamic(_mlp(seed=3), x, "onnxruntime", cache_path=cache, refresh=True)
    assert len(conversions) == 3
    kept.write_bytes(kept.read_bytes()[:-1])
    with pytest.warns(MeasurementWarning, match="truncated or altered"):
        quantize_dynamic(_mlp(seed=3), x, "onnxruntime", cache_path=cache)
    assert len(conversions) == 4 and [p.name for p in dynamic.onnx_cache_dir(cache).iterdir()] == [kept.name]
    quantize_dynamic(_mlp(seed=3), x, "onnxruntime", cache_path=cache)  # the rebuilt file is good again
    assert len(conversions) == 4
    dynamic.clear_cache(cache)
    assert not cache.exists() and not dynamic.onnx_cache_dir(cache).exists()


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 64)


class MeanPooled(_Tokens):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).mean(1)


class MaxPooled(_Tokens):
    """MeanPooled with another forward: the same name, modules and weights (as a file edited between two runs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).amax(1)


MaxPooled.__name__, MaxPooled.__qualname__ = MeanPooled.__name__, MeanPooled.__qualname__


def _tokens() -> torch.Tensor:
    return torch.randn(32, 8, 16, generator=torch.Generator().manual_seed(1))


def test_the_model_key_follows_the_code_not_only_names_shapes_and_weights() -> None:
    x = _tokens()
    mean, other_mean, max_ = MeanPooled(), MeanPooled(), MaxPooled()
    assert dynamic_cache.weights_key(mean) == dynamic_cache.weights_key(max_)
    assert dynamic.model_key(mean, [x]) == dynamic.model_key(other_mean, [x])
    assert dynamic.model_key(mean, [x]) != dynamic.model_key(max_, [x])


def test_a_changed_forward_misses_the_int8_cache_and_a_stale_file_is_rebuilt_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("onnxruntime")
    conversions: list[int] = []
    convert = dynamic._int8_onnx_bytes
    monkeypatch.setattr(dynamic, "_int8_onnx_bytes", lambda *args: conversions.append(1) or convert(*args))
    cache, x = tmp_path / "choices.json", _tokens()
    quantize_dynamic(MeanPooled(), x, "onnxruntime", cache_path=cache)
    changed = quantize_dynamic(MaxPooled(), x, "onnxruntime", cache_path=cache)
    assert len(conversions) == 2 and len(list(dynamic.onnx_cache_dir(cache).iterdir())) == 2
    assert torch.allclose(changed.module(x), MaxPooled()(x), atol=0.1)  # its own int8 model, not the mean's
    # A key that cannot see the change (as the old key could not): the file it loads disagrees, and is rebuilt once.
    dynamic.clear_cache(cache)
    monkeypatch.setattr(dynamic, "code_key", lambda module: "the same")
    quantize_dynamic(MeanPooled(), x, "onnxruntime", cache_path=cache)
    with pytest.warns(MeasurementWarning, match="disagrees with the float module.*converting again"):
        rebuilt = quantize_dynamic(MaxPooled(), x, "onnxruntime", cache_path=cache)
    assert len(conversions) == 4 and rebuilt.backend == "onnxruntime"
    assert torch.allclose(rebuilt.module(x), MaxPooled()(x), atol=0.1)
    again = quantize_dynamic(MaxPooled(), x, "onnxruntime", cache_path=cache)  # the rebuilt file serves as it is
    assert len(conversions) == 4 and again.module.onnx_bytes == rebuilt.module.onnx_bytes
