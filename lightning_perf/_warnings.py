"""Warning categories and the warn-once helper every callback uses to say why it did not apply."""

from __future__ import annotations

import os
import sys
import warnings


class LightningPerfWarning(UserWarning):
    """Base class of every warning lightning_perf emits (tests turn these into errors unless expected)."""


class NoEffectWarning(LightningPerfWarning):
    """An optimization did not apply to this model or device; training goes on unchanged."""


class PartialEffectWarning(LightningPerfWarning):
    """An optimization applied to part of what it acts on (FSDP2-sharded weights keep their layout, say)."""


class FallbackWarning(LightningPerfWarning):
    """An optimization failed at run time and fell back to the unoptimized path (``strict=False``)."""


class MeasurementWarning(LightningPerfWarning):
    """A measurement is less exact than asked for, or an observer found something the user should look at."""


_emitted: set[tuple[type[Warning], str]] = set()


def warn_once(message: str, category: type[Warning] = NoEffectWarning, stacklevel: int = 2) -> None:
    """Warn on rank zero, once per process for a given category and message."""
    key = (category, message)
    if key in _emitted:
        return
    _emitted.add(key)
    if global_rank() == 0:
        warnings.warn(message, category, stacklevel=stacklevel)


def global_rank() -> int:
    """This process's rank: from the process group once it exists, else from the launcher's environment.

    Plain torch, so the functional and measurement layers can warn on rank zero without importing Lightning.
    """
    # torch is imported only if it already is: `import lightning_perf` (and the CLI's `--help`) must not pay for it,
    # and without torch loaded there can be no process group to ask.
    if "torch.distributed" in sys.modules:
        dist = sys.modules["torch.distributed"]
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if (value := os.environ.get(key)) is not None:
            return int(value)
    return 0


def reset_warn_once() -> None:
    """Forget which warnings were already emitted (tests call this between cases)."""
    _emitted.clear()
