"""`import lightning_perf` stays cheap, and a missing optional dependency names the extra that installs it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from lightning_perf import _imports
from tests._probes import Probes

HEAVY = ("torchao", "onnx", "onnxscript", "onnxruntime", "tensorrt", "torch_tensorrt", "flash_attn", "matplotlib")

_PROBE = """
import json, sys
before = set(sys.modules)
import {target}
print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))
"""


@pytest.fixture(scope="module")
def probes() -> Iterator[Probes]:
    started = Probes()
    started.start({f"modules: {t}": _PROBE.format(target=t) for t in ("lightning.pytorch", *_TARGETS)})
    started.start({f"order: {order}": _order_probe(order) for order in _ORDERS})
    started.start({"no lightning": _NO_LIGHTNING_PROBE})
    yield started
    started.close()


def _top_level_modules_after(probes: Probes, target: str) -> set[str]:
    out = probes.result(f"modules: {target}")
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


_TARGETS = ("lightning_perf", "lightning_perf.callbacks, lightning_perf.strategies")


@pytest.mark.parametrize("target", _TARGETS)
def test_import_pulls_no_optional_dependency(probes: Probes, target: str) -> None:
    # Lightning itself imports matplotlib when it is installed; we may not add anything on top of what it loads.
    lightning_only = _top_level_modules_after(probes, "lightning.pytorch")
    ours = _top_level_modules_after(probes, target)
    added = sorted(m for m in HEAVY if m in ours and m not in lightning_only)
    assert not added, f"`import {target}` imported optional dependencies: {added}"
    assert not {"torchao", "onnx", "onnxruntime", "tensorrt", "torch_tensorrt", "flash_attn"} & ours


def test_require_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_imports, "is_available", lambda module: False)
    with pytest.raises(ModuleNotFoundError, match=r"lightning-perf\[qat\]") as info:
        _imports.require("torchao", purpose="QATCallback(backend='torchao')")
    assert "QATCallback(backend='torchao') needs `torchao`" in str(info.value)
    assert info.value.name == "torchao"


def test_available_package_is_imported() -> None:
    assert _imports.is_available("matplotlib")
    assert _imports.require("matplotlib").__name__ == "matplotlib"


def test_unknown_optional_dependency_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        _imports.is_available("not_a_dependency")


def test_local_folder_does_not_pass_for_the_package(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A folder named like the package but without installed metadata must not count as the package.
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    _imports.is_available.cache_clear()
    try:
        assert not _imports.is_available("flash_attn")
    finally:
        _imports.is_available.cache_clear()


_ORDERS = {
    "strategies, then Lightning": "import lightning_perf.strategies\nimport lightning.pytorch as pl\n",
    "Lightning, then callbacks": "import lightning.pytorch as pl\nimport lightning_perf, lightning_perf.callbacks\n",
    "callbacks, then Lightning": "from lightning_perf.callbacks import QATCallback\nimport lightning.pytorch as pl\n",
}


def _order_probe(order: str) -> str:
    # Importing the strategies or the callbacks registers the name, before or after Lightning, with no import hook.
    return _ORDERS[order] + (
        "import sys\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'ddp_powersgd' in StrategyRegistry\n"
        "assert not any(type(f).__module__.startswith('lightning_perf') for f in sys.meta_path)\n"
        "trainer = pl.Trainer(strategy='ddp_powersgd', accelerator='cpu', devices=1, logger=False)\n"
        "print(type(trainer.strategy).__name__)\n"
    )


@pytest.mark.parametrize("order", sorted(_ORDERS))
def test_strategy_name_registered_in_any_import_order(probes: Probes, order: str) -> None:
    out = probes.result(f"order: {order}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "PowerSGDDDPStrategy"


_NO_LIGHTNING_PROBE = (
    "import sys, lightning_perf\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'lightning'))"
)


def test_import_lightning_perf_loads_no_lightning(probes: Probes) -> None:
    out = probes.result("no lightning")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
