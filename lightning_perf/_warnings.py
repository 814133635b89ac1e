"""Warning categories and the warn-once helper every callback uses to say why it did not apply."""

from __future__ import annotations

import warnings

from lightning.pytorch.utilities.rank_zero import rank_zero_only


class LightningPerfWarning(UserWarning):
    """Base class of every warning lightning_perf emits (tests turn these into errors unless expected)."""


class NoEffectWarning(LightningPerfWarning):
    """An optimization did not apply to this model or device; training goes on unchanged."""


class FallbackWarning(LightningPerfWarning):
    """An optimization failed at run time and fell back to the unoptimized path (``strict=False``)."""


class MeasurementWarning(LightningPerfWarning):
    """A measurement is less exact than asked for, or an observer found something the user should look at."""


_emitted: set[tuple[type[Warning], str]] = set()


def warn_once(message: str, category: type[Warning] = NoEffectWarning, stacklevel: int = 3) -> None:
    """Warn on rank zero, once per process for a given category and message."""
    key = (category, message)
    if key in _emitted:
        return
    _emitted.add(key)
    _rank_zero_warn(message, category, stacklevel)


@rank_zero_only
def _rank_zero_warn(message: str, category: type[Warning], stacklevel: int) -> None:
    warnings.warn(message, category, stacklevel=stacklevel + 1)


def reset_warn_once() -> None:
    """Forget which warnings were already emitted (tests call this between cases)."""
    _emitted.clear()
