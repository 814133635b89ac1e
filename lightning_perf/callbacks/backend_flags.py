"""Set cuDNN autotuning, TF32, float32 matmul precision and SDPA kernels for a run, and put them back after it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_perf._validation import check_choice, check_optional_bool
from lightning_perf._warnings import NoEffectWarning, warn_once
from lightning_perf.callbacks._undo import UndoOnExit
from lightning_perf.functional.backend_flags import (
    FLOAT32_MATMUL_PRECISIONS,
    BackendFlags,
    Float32MatmulPrecision,
    SdpaBackend,
    apply,
    fastest_flags,
    no_effect_reasons,
    recommended_flags,
    recommended_note,
    restore,
    validate_sdpa_backends,
    without,
)

_PRESETS = ("recommended", "fastest")


class BackendFlagsCallback(UndoOnExit):
    """Set process-global backend flags for the duration of each ``fit``/``validate``/``test``/``predict``.

    The flags are applied in ``setup`` and restored exactly in ``teardown`` (and in ``on_exception``: Lightning does
    not call ``teardown`` when a run fails), so a later Trainer in the same process finds the settings it had before.
    With no argument it applies the settings recommended for the device it runs on (``preset="recommended"``) and
    says which in one info line: on CUDA with TF32 (Ampere and newer) cuDNN autotuning, TF32 matmuls and convolutions
    and float32 matmul precision ``"high"``; on older GPUs cuDNN autotuning; on a CPU nothing (no setting speeds up
    float32 training there without changing its numerics; the line says what the CPU could opt into).
    With arguments, ``None`` leaves a setting alone. A setting that cannot change anything on the Trainer's device
    (TF32 on a CPU or a pre-Ampere GPU, cuDNN autotuning off CUDA, ``float32_matmul_precision="high"`` on a CPU) is not
    applied and says so once with a :class:`~lightning_perf.NoEffectWarning`.

    ``Trainer(benchmark=...)`` sets ``torch.backends.cudnn.benchmark`` when the Trainer is built and never puts it
    back; this callback's ``cudnn_benchmark`` wins during the run and, at teardown, the value the Trainer had set is
    what comes back.

    Args:
        cudnn_benchmark: ``torch.backends.cudnn.benchmark``: autotune convolution algorithms per input shape (CUDA;
            a win when input shapes repeat, a loss when they keep changing).
        tf32: TF32 tensor cores for float32 matmuls and cuDNN convolutions (Ampere and newer GPUs; about 10 bits of
            mantissa instead of 23).
        float32_matmul_precision: ``torch.set_float32_matmul_precision``. ``"high"``: TF32 matmuls on CUDA.
            ``"medium"``: also bf16-based float32 matmuls in oneDNN on CPUs with bf16 support (avx512_bf16, AMX).
        sdpa_backends: enable exactly these kernels of ``scaled_dot_product_attention``, any of ``"flash"``,
            ``"efficient"``, ``"math"``, ``"cudnn"`` (CPUs have ``flash`` and ``math``).
        preset: ``"recommended"`` (the default when no argument is given): see above. ``"fastest"``: the settings
            that make float32 training fastest on the Trainer's device, chosen at ``setup`` (CUDA: ``cudnn_benchmark``
            and ``tf32`` where supported; CPU: ``float32_matmul_precision="medium"`` where the CPU has bf16 support).
            Explicit arguments override a preset.

    Raises:
        ValueError: if a setting is not a valid value, or ``tf32`` contradicts ``float32_matmul_precision``.
        TypeError: if ``cudnn_benchmark`` or ``tf32`` is not True, False or None, or ``sdpa_backends`` is not a list
            of names.

    Example::

        trainer = Trainer(callbacks=[BackendFlagsCallback()])  # the recommended settings for the device
        trainer = Trainer(callbacks=[BackendFlagsCallback(cudnn_benchmark=True, tf32=True)])
    """

    def __init__(
        self,
        cudnn_benchmark: bool | None = None,
        tf32: bool | None = None,
        float32_matmul_precision: Float32MatmulPrecision | None = None,
        sdpa_backends: Sequence[SdpaBackend] | None = None,
        preset: Literal["recommended", "fastest"] | None = None,
    ) -> None:
        name = type(self).__name__
        check_optional_bool(name, "cudnn_benchmark", cudnn_benchmark)
        check_optional_bool(name, "tf32", tf32)
        if float32_matmul_precision is not None:
            check_choice(name, "float32_matmul_precision", float32_matmul_precision, FLOAT32_MATMUL_PRECISIONS)
        if preset is not None:
            check_choice(name, "preset", preset, _PRESETS)
        if (
            tf32 is not None
            and float32_matmul_precision is not None
            and tf32 != (float32_matmul_precision != "highest")
        ):
            raise ValueError(
                f"`{name}(tf32={tf32!r}, float32_matmul_precision={float32_matmul_precision!r})` contradict each "
                "other: 'highest' turns TF32 matmuls off, 'high' and 'medium' turn them on."
            )
        chosen = (cudnn_benchmark, tf32, float32_matmul_precision, sdpa_backends, preset)
        if all(value is None for value in chosen):
            preset = "recommended"
        # Validated here so a contradiction fails when the Trainer is configured, not at setup.
        self.flags = BackendFlags(
            cudnn_benchmark=cudnn_benchmark,
            matmul_tf32=tf32,
            cudnn_tf32=tf32,
            float32_matmul_precision=float32_matmul_precision,
            sdpa_backends=None if sdpa_backends is None else validate_sdpa_backends(sdpa_backends, name),
        )
        self.preset = preset
        self._previous: BackendFlags | None = None
        self._told_nothing = False

    def flags_for(self, device: torch.device) -> BackendFlags:
        """What this callback sets on ``device``: the preset's choice, overridden by the explicit settings."""
        if self.preset is None:
            return self.flags
        explicit = self.flags.requested()
        base = recommended_flags(device) if self.preset == "recommended" else fastest_flags(device)
        if explicit.get("float32_matmul_precision") is not None and base.matmul_tf32 is not None:
            base = without(base, ["matmul_tf32"])  # an explicit precision decides matmul TF32 by itself
        if explicit.get("matmul_tf32") is not None and base.float32_matmul_precision is not None:
            base = without(base, ["float32_matmul_precision"])  # and an explicit tf32 decides the precision
        return replace(base, **explicit)  # type: ignore[arg-type]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        flags = self.flags_for(device)
        name = type(self).__name__
        reasons = no_effect_reasons(flags, device)
        if flags.cudnn_benchmark and torch.are_deterministic_algorithms_enabled():
            reasons["cudnn_benchmark"] = (
                "deterministic algorithms are on (Trainer(deterministic=True)); it defeats them"
            )
        for field, reason in reasons.items():
            warn_once(f"`{name}`: {field} is left alone: {reason}.", NoEffectWarning)
        flags = without(flags, reasons)
        if not flags.requested():
            if self.preset == "recommended" and not reasons:
                if not self._told_nothing:
                    rank_zero_info(f"{name}: nothing set on {device.type}: {recommended_note(device)}.")
                    self._told_nothing = True
            elif self.preset is not None and not reasons:
                warn_once(f"`{name}(preset={self.preset!r})`: no backend setting speeds up {device}.", NoEffectWarning)
            return
        self._previous = apply(flags)
        which = f"the settings recommended for {_device_name(device)}: " if self.preset == "recommended" else ""
        rank_zero_info(f"{name}: set {which}{_describe(flags)} for this {stage} run; restored at teardown.")

    def _undo(self, pl_module: pl.LightningModule | None = None) -> None:
        if self._previous is not None:
            restore(self._previous)
            self._previous = None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return f"{device.type} ({torch.cuda.get_device_name(device)})"
    return device.type


def _describe(flags: BackendFlags) -> str:
    parts = []
    for key, value in flags.requested().items():
        shown = sorted(value) if isinstance(value, frozenset) else value
        parts.append(f"{key}={shown!r}")
    return ", ".join(parts)
