"""``--help`` of the command and of every sub-command answers without importing torch or Lightning."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "lightning", "pytorch_lightning")


@pytest.mark.parametrize(
    "command",
    [[], ["bench"], ["autotune"], ["export"], ["compare"]],
    ids=["top", "bench", "autotune", "export", "compare"],
)
def test_help_imports_neither_torch_nor_lightning(command: list[str]) -> None:
    argv = [sys.executable, "-X", "importtime", "-m", "lightning_perf", *command, "--help"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: lightning-perf" in proc.stdout
    # importtime writes one line per module: "import time: self | cumulative | <indent>name"
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    heavy = sorted(name for name in imported if name.split(".")[0] in HEAVY)
    assert not heavy, f"`lightning-perf {' '.join(command)} --help` imported {heavy[:10]}"
