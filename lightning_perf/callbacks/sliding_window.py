"""Sliding-window inference for predict, test and validate runs on inputs larger than the network's patch (MONAI)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_perf._validation import check_str_sequence
from lightning_perf.callbacks._undo import UndoOnExit
from lightning_perf.functional.attention.sliding_window import (
    SLIDING_WINDOW_STAGES,
    SwBatchSizeChoice,
    apply_sliding_window,
    remove_sliding_window,
    require_monai,
    sliding_window_patch,
    validate_sliding_window,
)

_OWNER = "SlidingWindowInferenceCallback"


class SlidingWindowInferenceCallback(UndoOnExit):
    """Run ``predict`` / ``test`` / ``validate`` through MONAI's ``sliding_window_inference``, step methods as written.

    A network trained on patches (``roi_size``) predicts whole volumes window by window: for the trainer entry points
    in ``stages`` the LightningModule's ``forward`` is patched in place (class, submodules and ``state_dict`` keys
    unchanged) so that ``self(x)`` in ``predict_step`` / ``test_step`` / ``validation_step`` runs MONAI's function
    with the plain forward as the predictor. The output equals ``monai.inferers.sliding_window_inference`` called with
    the same settings. The patch goes on in ``setup`` and comes off at the end of the run, in ``teardown`` and in
    ``on_exception``; ``fit`` (its validation loop included) is never touched, so training is unchanged.

    Which inputs use the window: an input of shape ``(N, C, *roi_size)`` is one window and goes to the plain forward;
    any other tensor of rank ``2 + len(roi_size)`` goes to MONAI (larger: covered by overlapping windows; smaller in
    some dimension: padded to ``roi_size`` with ``padding_mode``/``cval`` and cropped back, as MONAI does); anything
    else (another rank, a non-tensor first argument) goes to the plain forward. Extra ``forward`` arguments are passed
    to every window's call.

    ``sw_batch_size="auto"``: on the first input that needs the window, sizes 1, 2, 4, 8, ... (at most the number of
    windows, and only those whose memory estimate fits in the free memory: the CUDA allocator's and driver's on GPU,
    the system's available memory on CPU) are timed against the best so far, paired and interleaved; a larger size is
    kept only when it is faster with its whole 95% interval above 1 (a difference inside the noise keeps the smaller
    one). The choice and its timings are logged once on rank zero and kept in :attr:`chosen_sw_batch_size` /
    :attr:`choice`; later runs reuse it.

    Stacking: ``ChannelsLastCallback`` (windows are slices of the channels-last input), bf16 / 16-bit precision (MONAI
    blends in the input's dtype, as when called directly) and ``CompileCallback``: the window loop itself is excluded
    from compilation, so compile the network's blocks (``CompileCallback(regions="auto")`` or the block classes); with
    the default ``regions=None`` the LightningModule's forward, which now is the window loop, runs eagerly.

    Args:
        roi_size: the window's spatial size: an int (every spatial dimension), one int per spatial dimension, or
            ``"model"``: the LightningModule's ``roi_size`` attribute, else its ``hparams["roi_size"]``.
        sw_batch_size: windows per forward call, an int >= 1 or ``"auto"``.
        overlap: overlap of neighbouring windows, in ``[0, 1)`` (one per spatial dimension or one for all).
        mode: blending of overlapping windows, ``"gaussian"`` (less weight at the window edges) or ``"constant"``.
        sigma_scale: the Gaussian's standard deviation as a fraction of the window side (> 0).
        padding_mode: padding of inputs smaller than the window: ``"constant"``, ``"reflect"``, ``"replicate"``,
            ``"circular"``.
        cval: the value of ``"constant"`` padding.
        sw_device: device of the windows (default: the input's).
        device: device of the stitched output (default: the input's; ``"cpu"`` keeps a large output off the GPU).
        progress: show MONAI's progress bar per volume.
        roi_weight_map: a precomputed non-negative weight map of the window's shape.
        process_fn: ``process_fn(outputs, window, importance_map) -> (outputs, importance_map)`` per window.
        buffer_steps: windows along ``buffer_dim`` buffered on ``sw_device`` before writing to ``device`` (MONAI 1.3+;
            only the first output is kept then).
        buffer_dim: the spatial dimension of the buffers (``-1``: the last).
        stages: the trainer entry points that use the window, among ``"predict"``, ``"test"`` and ``"validate"``.

    Attributes:
        chosen_sw_batch_size: the size ``"auto"`` chose (``None`` before it measured; the fixed size otherwise).
        choice: what ``"auto"`` measured
        (:class:`~lightning_perf.functional.attention.sliding_window.SwBatchSizeChoice`).

    Raises:
        ValueError: at construction, for an empty, zero, negative or non-integer ``roi_size``, an ``overlap``
            outside ``[0, 1)``, a ``sw_batch_size`` below 1 or other than ``"auto"``, an unknown ``mode``,
            ``padding_mode`` or stage, a ``sigma_scale`` <= 0; at setup, for ``roi_size="model"`` on a model that
            declares none.
        TypeError: at construction, for arguments of the wrong type.
        ModuleNotFoundError: at setup, when MONAI is not installed (``pip install 'lightning-perf[monai]'``).

    Example::

        from lightning_perf.callbacks import SlidingWindowInferenceCallback

        trainer = Trainer(callbacks=[SlidingWindowInferenceCallback(roi_size=(32, 32, 32), sw_batch_size=4)])
        volumes = trainer.predict(model, dataloaders=whole_volumes)  # each predicted in 32^3 windows
    """

    def __init__(
        self,
        roi_size: int | Sequence[int] | str,
        sw_batch_size: int | str = 1,
        overlap: float | Sequence[float] = 0.25,
        mode: str = "gaussian",
        sigma_scale: float | Sequence[float] = 0.125,
        padding_mode: str = "constant",
        cval: float = 0.0,
        sw_device: torch.device | str | None = None,
        device: torch.device | str | None = None,
        progress: bool = False,
        roi_weight_map: torch.Tensor | None = None,
        process_fn: Callable[..., Any] | None = None,
        buffer_steps: int | None = None,
        buffer_dim: int = -1,
        stages: str | Iterable[str] = SLIDING_WINDOW_STAGES,
    ) -> None:
        # Every argument but `stages` is a field of SlidingWindowSettings (first statement: locals() holds only them).
        fields = {name: value for name, value in locals().items() if name not in ("self", "stages")}
        self.settings = validate_sliding_window(_OWNER, **fields)
        self.stages = check_str_sequence(_OWNER, "stages", stages, SLIDING_WINDOW_STAGES)
        self.choice: SwBatchSizeChoice | None = None
        self._patched: pl.LightningModule | None = None

    @property
    def chosen_sw_batch_size(self) -> int | None:
        if isinstance(self.settings.sw_batch_size, int):
            return self.settings.sw_batch_size
        return self.choice.chosen if self.choice is not None else None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage not in self.stages:
            return
        require_monai()
        self._undo()
        patch = apply_sliding_window(pl_module, self.settings, on_choice=self._report, choice=self.choice, owner=_OWNER)
        if patch is not None:
            self._patched = pl_module
            roi = patch.settings.roi_size
            size = self.chosen_sw_batch_size or "auto"
            where = f"{getattr(stage, 'value', stage)} runs {type(pl_module).__name__}.forward in {roi} windows"
            rank_zero_info(
                f"{_OWNER}: {where} (sw_batch_size={size}, overlap={self.settings.overlap}, "
                f"mode={self.settings.mode!r})."
            )

    def _report(self, choice: SwBatchSizeChoice) -> None:
        self.choice = choice
        rank_zero_info(f"{_OWNER}(sw_batch_size='auto'): {choice.summary()}.")

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._undo()

    on_test_end = on_predict_end

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn is not None and trainer.state.fn.value == "validate":
            self._undo()  # not fit's validation loop: fit never has the patch

    def _undo(self, pl_module: pl.LightningModule | None = None) -> None:
        if self._patched is not None:
            remove_sliding_window(self._patched)
            self._patched = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_patched"] = None  # the live patch stays with this process's model
        return state

    @property
    def active(self) -> bool:
        """Whether a LightningModule's forward currently runs through the window."""
        return self._patched is not None and sliding_window_patch(self._patched) is not None
