"""The example project's training entry point, a plain ``LightningCLI``.

From the repository root::

    python examples/own_model/train.py fit --config examples/own_model/cli.yaml

``lightning-perf bench --config examples/own_model/cli.yaml`` reads the same file and builds the same model, data
module and trainer settings.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

if __package__ in (None, ""):  # run as a script: the YAML names classes as `examples.own_model.model.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    LightningCLI(save_config_callback=None)  # no config.yaml copied into the working directory


if __name__ == "__main__":
    main()
