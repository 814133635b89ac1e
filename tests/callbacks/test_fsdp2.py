"""Every callback of this owner under FSDP2 (``ModelParallelStrategy``, ``fully_shard`` in ``configure_model``).

One 2-process launch (gloo, CPU) of ``_fsdp2_mechanisms.py`` trains a self-sharding LM and a self-sharding conv net
plainly and under each callback; the tests below read rank 0's report: the loss equals the plain run's, the transform
was seen at work (blocks recomputed, SDPA called, fused optimizer stepping, channels-last convolution outputs,
per-block compilation inside the wrappers) and everything is undone at teardown and when the fit fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# FlashAttention, FusedOptimizer and Compile are seen at work in "stack"; every registry setting's loss under FSDP2 is
# also checked by tests/test_generic.py::test_fsdp2_two_processes (MemoryProfiler, Bottleneck, BackendFlags there).
SCENARIOS = "plain,grad_checkpoint,grad_checkpoint_budget,plain_conv,channels_last_window,stack,stack_failing"

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Runs every scenario in one 2-process launch and returns rank 0's report (about 30-60 s on 2 cores)."""
    root = tmp_path_factory.mktemp("fsdp2")
    result = root / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "tests" / "callbacks" / "_fsdp2_mechanisms.py"),
            SCENARIOS,
            str(result),
            str(root),
        ],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(result.read_text())  # type: ignore[no-any-return]


def _same_training(report: dict[str, Any], name: str, plain: str = "plain", rel: float = 1e-6) -> dict[str, Any]:
    run, base = report[name], report[plain]
    assert "error" not in run, run.get("traceback", run.get("error"))
    assert len(run["losses"]) == len(base["losses"]) == 4
    assert run["losses"] == pytest.approx(base["losses"], rel=rel)
    assert run["grad_checksum"] == pytest.approx(base["grad_checksum"], rel=rel)
    return run


def _undone(run: dict[str, Any]) -> None:
    assert run["after"]["forward_patches"] == 0
    assert run["after"]["compiled"] == 0
    assert run["after"]["swapped_attention"] == 0
    assert run["after"]["sharded_params"] > 0  # still the user's sharded model
    assert run["optimizer_after"] == {"fused": None, "foreach": None}


def test_plain_runs_are_sharded_and_eager(report: dict[str, Any]) -> None:
    plain = report["plain"]
    assert "error" not in plain, plain.get("traceback")
    assert plain["during"]["block_forward_calls_per_step"] == 1
    assert plain["after"]["sharded_params"] > 0
    assert report["plain_conv"]["during"]["conv_output_channels_last"] == [False]


def test_grad_checkpoint_recomputes_inside_the_sharded_blocks(report: dict[str, Any]) -> None:
    run = _same_training(report, "grad_checkpoint")
    assert run["wrapped"] == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]  # the FSDP blocks, not the root
    assert run["during"]["block_forward_calls_per_step"] == 2  # forward, and the recompute in backward
    _undone(run)


def test_grad_checkpoint_memory_budget_checkpoints_every_block_under_fsdp2(report: dict[str, Any]) -> None:
    run = _same_training(report, "grad_checkpoint_budget")
    assert run["wrapped"] == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    assert run["during"]["block_forward_calls_per_step"] == 2
    _undone(run)


def test_channels_last_runs_the_convolutions_channels_last_and_the_window_predicts_through_monai(
    report: dict[str, Any],
) -> None:
    run = _same_training(report, "channels_last_window", plain="plain_conv", rel=1e-5)
    assert run["during"]["conv_output_channels_last"] == [True]
    assert run["predict_shape"] == [2, 3, 16, 16]
    assert run["predict_matches_monai"] is True
    _undone(run)


def test_stacked_callbacks_train_as_plain_with_compile_inside_the_wrappers(report: dict[str, Any]) -> None:
    """Attention swap, checkpointing, compile (regions=None) and the fused optimizer together: the one compiled fit."""
    run = _same_training(report, "stack", rel=1e-5)  # eager gradients (first step) and losses
    assert run["during"]["fused"] is True  # AdamW steps fused over the DTensor shards
    # Each block's hand-written attention was swapped (checked on stand-in weights) and calls the fused kernel.
    assert run["swapped"] == [f"model.blocks.{i}.attn" for i in range(3)]
    assert all("sharded by FSDP2" in reason for _, reason in run["decisions"].values())
    assert run["during"]["attention_classes"] == ["FusedQKVAttention"] * 3
    assert run["during"]["sdpa_calls"] == 3  # one fused kernel call per block and forward
    # regions=None under FSDP2: each fully_shard-ed block, in its forward (never the root or the LightningModule),
    # around the checkpointed forward; the three identical blocks share one graph.
    assert run["compiled"] == run["wrapped"] == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    assert run["compile_report"]["unique_graphs"] >= 1  # (the SDPA-counting probe adds graph breaks of its own)
    _undone(run)


def test_a_failing_fit_is_undone(report: dict[str, Any]) -> None:
    run = report["stack_failing"]
    assert run["error"] == "RuntimeError: planned failure"
    assert run["during"]["fused"] is True  # applied before the failure
    _undone(run)
