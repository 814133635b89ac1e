"""The deploy layer needs no Lightning, and the functional layer does not pull it in."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._probes import Probes

LIGHTNING_FREE = [
    f"lightning_perf.{m}" for m in ("deploy", "deploy.quantize.recipes", "profiling.latency", "cli.export")
]
_FUNCTIONAL = "import sys, lightning_perf.functional, lightning_perf.functional.quantization.qat; " + (
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
