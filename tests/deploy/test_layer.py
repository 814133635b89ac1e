"""The deploy layer needs no Lightning; old import paths still work with a DeprecationWarning naming the new one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._probes import Probes

LIGHTNING_FREE = [
    "lightning_perf.deploy",
    "lightning_perf.deploy.quantize",
    "lightning_perf.profiling.latency",
    "lightning_perf.cli.export",
]
_FUNCTIONAL = "import sys, lightning_perf.functional, lightning_perf.functional.qat; " + (
    "print('lightning_perf.deploy' in sys.modules)"
)


def _loaded_after(statement: str) -> str:
    return (
        f"import sys; {statement}; "
        "print(','.join(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))"
    )


@pytest.fixture(scope="module")
def probes() -> Iterator[Probes]:
    started = Probes()
    started.start({module: _loaded_after(f"import {module}") for module in LIGHTNING_FREE})
    started.start({"functional": _FUNCTIONAL})
    yield started
    started.close()


def _stdout(probes: Probes, key: str) -> str:
    out = probes.result(key)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("module", LIGHTNING_FREE)
def test_importing_loads_no_lightning(probes: Probes, module: str) -> None:
    assert [m for m in _stdout(probes, module).strip().split(",") if m] == []


def test_functional_does_not_pull_the_deploy_layer(probes: Probes) -> None:
    assert _stdout(probes, "functional").strip() == "False"


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("lightning_perf.functional", "export_model", "lightning_perf.deploy.export"),
        ("lightning_perf.functional", "ExportReport", "lightning_perf.deploy.export"),
        ("lightning_perf.functional", "export_quantized", "lightning_perf.deploy.quantize.save"),
        ("lightning_perf.functional.export", "export_model", "lightning_perf.deploy.export"),
        ("lightning_perf.functional.export", "split_inputs", "lightning_perf.deploy.inputs"),
        ("lightning_perf.functional.export", "validate_options", "lightning_perf.deploy.backend"),
        ("lightning_perf.functional.export", "LatencyRow", "lightning_perf.profiling.latency"),
        ("lightning_perf.functional.qat", "convert", "lightning_perf.deploy.quantize.convert"),
        ("lightning_perf.functional.qat", "export_quantized", "lightning_perf.deploy.quantize.save"),
        ("lightning_perf.functional.qat", "compare_models", "lightning_perf.deploy.validate"),
    ],
)
def test_moved_names_warn_and_resolve_to_the_new_object(old: str, name: str, new: str) -> None:
    import importlib

    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=f"{old}.{name} moved to {new}"):
        found = getattr(module, name)
    target = importlib.import_module(new)
    assert found is getattr(target, "add_parser" if name.startswith("add_") else name)


def test_unknown_names_are_still_attribute_errors() -> None:
    from lightning_perf.functional import export, qat

    with pytest.raises(AttributeError):
        _ = export.no_such_name
    with pytest.raises(AttributeError):
        _ = qat.no_such_name
