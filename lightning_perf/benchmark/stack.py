"""The bench's answer: the stack of the configurations that won, and the lines that put it in the user's Trainer.

After the single configurations, :func:`choose_stack` takes every one whose speed-up is *faster* (its whole 95%
interval above 1), keeps the best of those that cannot run together (two compiles, two precisions, the same callback
twice), and names the stack (``channels_last+fused_optimizer``); the runner measures it against baseline in the same
run, interleaved. :func:`recommendation_lines` then ends the output with the stacked speed-up, its interval, and what
to add: Python for a Trainer built in code (:func:`trainer_python`), YAML for a LightningCLI ``--config`` file
(:func:`trainer_yaml`). Pure: it reads the optimization list, never a process or a clock.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning_perf.optimizations as optimizations
from lightning_perf.optimizations import BASELINE, Optimization
from lightning_perf.profiling.intervals import RatioEstimate

__all__ = [
    "MIN_EVIDENCE_REPEATS",
    "Stack",
    "callbacks_of",
    "choose_stack",
    "evidence_line",
    "is_winner",
    "looks_faster",
    "recommendation_lines",
    "recommended_names",
    "trainer_python",
    "trainer_yaml",
    "wanting_evidence",
]

Lookup = Callable[[str], Optimization]
CallbackSpec = tuple[str, Mapping[str, Any]]


MIN_EVIDENCE_REPEATS = 3
"""Repeats (fresh processes per side) a speed-up needs before it may change a user's Trainer: with two, a bootstrap
interval is little more than the span of two numbers, and one lucky process pair decides."""


def looks_faster(estimate: RatioEstimate | None) -> bool:
    """Whether the whole 95% interval lies above 1 (the verdict *faster*), whatever the number of repeats."""
    return estimate is not None and estimate.has_interval and estimate.low > 1.0 and estimate.verdict == "faster"


def is_winner(estimate: RatioEstimate | None) -> bool:
    """Whether a speed-up won: *faster* (the whole 95% interval above 1) over at least :data:`MIN_EVIDENCE_REPEATS`
    repeats."""
    return looks_faster(estimate) and estimate.n >= MIN_EVIDENCE_REPEATS  # type: ignore[union-attr]


def wanting_evidence(estimates: Mapping[str, RatioEstimate | None]) -> list[str]:
    """The single configurations that measured faster from too few repeats to win (best first)."""
    names = [n for n, e in estimates.items() if "+" not in n and looks_faster(e) and not is_winner(e)]
    return sorted(names, key=lambda n: -estimates[n].ratio)  # type: ignore[union-attr]


def evidence_line(name: str, estimate: RatioEstimate) -> str:
    """Why a configuration that measured faster is not recommended, and what would settle it."""
    return (
        f"Not enough evidence: {name} measured {estimate.format()} from {estimate.n} repeat(s); a recommendation "
        f"needs {MIN_EVIDENCE_REPEATS}: run with --repeats {MIN_EVIDENCE_REPEATS} or a longer --time-budget."
    )


def callbacks_of(optimization: Optimization) -> list[CallbackSpec]:
    """The callbacks an optimization adds, as ``(class path, keyword arguments)``, in order."""
    own = [(optimization.callback, optimization.callback_kwargs)] if optimization.callback is not None else []
    return [(path, dict(kwargs)) for path, kwargs in [*own, *optimization.with_callbacks]]  # fp8 brings a second


@dataclass(frozen=True)
class Stack:
    """The winners that run together.

    Attributes:
        names: the configurations stacked, in the order their callbacks apply (the optimization list's
            ``tuner_order``: compilation last, after the transforms it should see).
        dropped: ``(name, why)`` for a winner left out of the stack (it cannot run with a better one).
    """

    names: tuple[str, ...]
    dropped: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        """The stack as a bench configuration name (``a+b``), or ``""`` when nothing won."""
        return "+".join(self.names)


def _conflict(a: Optimization, b: Optimization) -> str | None:
    """Why ``a`` and ``b`` cannot run in one Trainer, or None."""
    if a.replaces == b.name or b.replaces == a.name or (a.replaces is not None and a.replaces == b.replaces):
        return f"tried in place of {b.name}, not on top of it"
    for key, value in a.trainer_kwargs.items():
        if key in b.trainer_kwargs and b.trainer_kwargs[key] != value:
            return f"sets Trainer({key}=...) as {b.name} does"
    shared = {path for path, _ in callbacks_of(a)} & {path for path, _ in callbacks_of(b)}
    if shared:
        return f"adds {sorted(shared)[0].rsplit('.', 1)[-1]} as {b.name} does"
    return None


def choose_stack(estimates: Mapping[str, RatioEstimate | None], lookup: Lookup = optimizations.get) -> Stack:
    """The stack of the winners among ``estimates`` (configuration -> its speed-up against baseline).

    Only single registered configurations count (a stack measured in the same run, or an unknown name, is passed
    over); the winners are taken best speed-up first, and one that cannot run with an earlier pick is dropped with
    the reason. The stack lists them in the order they apply.
    """
    winners = []
    for name, estimate in estimates.items():
        if name == BASELINE or "+" in name or not is_winner(estimate):
            continue
        try:
            winners.append((estimate.ratio, name, lookup(name)))  # type: ignore[union-attr]
        except KeyError:
            continue
    winners.sort(key=lambda item: -item[0])
    chosen: list[Optimization] = []
    dropped = []
    for _, name, optimization in winners:
        why = next((w for other in chosen if (w := _conflict(optimization, other)) is not None), None)
        if why is None:
            chosen.append(optimization)
        else:
            dropped.append((name, why))
    # Applied in the tuner's order (compile after the transforms it should see), registration order among equals.
    position = {name: i for i, name in enumerate(optimizations.names())}
    stages = optimizations.TUNER_STAGES  # the precision first, then the transforms
    chosen.sort(key=lambda o: (o.tuner_stage == stages[-1] or o.tuner_stage is None, o.tuner_order,
                               position.get(o.name, len(position))))  # fmt: skip
    return Stack(tuple(o.name for o in chosen), tuple(dropped))


def _call(path: str, kwargs: Mapping[str, Any]) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return f"{path.rsplit('.', 1)[-1]}({args})"


def _merged_trainer_kwargs(chosen: Iterable[Optimization]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for optimization in chosen:
        merged.update(optimization.trainer_kwargs)
    return merged


def trainer_python(names: Sequence[str], lookup: Lookup = optimizations.get, width: int = 80) -> list[str]:
    """The lines that add the optimizations ``names`` to a Trainer built in Python (imports, then the Trainer)."""
    chosen = [lookup(n) for n in names]
    specs = [spec for o in chosen for spec in callbacks_of(o)]
    by_module: dict[str, list[str]] = {}
    for path, _ in specs:
        module, _, cls = path.rpartition(".")
        if cls not in by_module.setdefault(module, []):
            by_module[module].append(cls)
    lines = []
    for module, classes in by_module.items():
        line = f"from {module} import {', '.join(classes)}"
        lines += [line] if len(line) <= width else [f"from {module} import (", *(f"    {c}," for c in classes), ")"]
    lines += [""] if lines else []
    args = [f"{k}={v!r}" for k, v in _merged_trainer_kwargs(chosen).items()]
    calls = [_call(path, kwargs) for path, kwargs in specs]
    if calls:
        args.append(f"callbacks=[{', '.join(calls)}]")
    one_line = f"trainer = Trainer({', '.join(args)})"
    if len(one_line) <= width:
        return [*lines, one_line]
    body = [f"    {a}," for a in args[:-1]] if calls else [f"    {a}," for a in args]
    if calls:
        callbacks = f"    callbacks=[{', '.join(calls)}],"
        body += (
            [callbacks] if len(callbacks) <= width else ["    callbacks=[", *(f"        {c}," for c in calls), "    ],"]
        )
    return [*lines, "trainer = Trainer(", *body, ")"]


_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


def _yaml_value(value: Any) -> str:
    if isinstance(value, str):
        plain = _PLAIN.match(value) and value.lower() not in ("true", "false", "null", "yes", "no", "on", "off")
        return value if plain else json.dumps(value)
    return json.dumps(value)


def trainer_yaml(names: Sequence[str], lookup: Lookup = optimizations.get) -> list[str]:
    """The ``trainer:`` section of a LightningCLI ``--config`` file that adds the optimizations ``names``."""
    chosen = [lookup(n) for n in names]
    lines = ["trainer:"]
    lines += [f"  {k}: {_yaml_value(v)}" for k, v in _merged_trainer_kwargs(chosen).items()]
    specs = [spec for o in chosen for spec in callbacks_of(o)]
    if specs:
        lines.append("  callbacks:")
        for path, kwargs in specs:
            lines.append(f"    - class_path: {path}")
            if kwargs:
                lines.append("      init_args:")
                lines += [f"        {k}: {_yaml_value(v)}" for k, v in kwargs.items()]
    return lines


def recommended_names(
    stack: Stack, stack_estimate: RatioEstimate | None, singles: Mapping[str, RatioEstimate | None]
) -> tuple[str, ...]:
    """What the recommendation puts in the Trainer: the stack, or its best single part where the stack measured
    below that part alone; ``()`` when nothing won."""
    if len(stack.names) <= 1:
        return stack.names
    best = max(stack.names, key=lambda n: e.ratio if (e := singles.get(n)) is not None else 0.0)
    best_single = singles.get(best)
    if stack_estimate is not None and best_single is not None and stack_estimate.ratio < best_single.ratio:
        return (best,)
    return stack.names


def recommendation_lines(
    stack: Stack,
    stack_estimate: RatioEstimate | None,
    singles: Mapping[str, RatioEstimate | None],
    *,
    settled_note: str = "",
    config_file: bool = False,
    lookup: Lookup = optimizations.get,
    width: int = 80,
) -> list[str]:
    """The end of the bench's output: what to add to the Trainer, and how much faster it made this run.

    Args:
        stack: the winners (:func:`choose_stack`).
        stack_estimate: the stack's speed-up measured against baseline (None for a single winner: its own row is the
            figure, or when the stack could not be measured).
        singles: each single configuration's speed-up.
        settled_note: ``""`` when the figure settled, else why not (``"unsettled after 3 repeats: ..."``).
        config_file: the user trains from a LightningCLI file: the YAML comes first, else the Python.
        lookup: the optimization list.
        width: the longest line (prose is wrapped, code lines are broken where Python and YAML allow).
    """
    short = [evidence_line(n, singles[n]) for n in wanting_evidence(singles)]  # type: ignore[arg-type]
    if not stack.names and not short:
        return ["Recommendation: nothing measured faster than baseline here; keep your Trainer as it is."]
    if not stack.names:
        head = "Recommendation: none yet; keep your Trainer as it is until a run settles what follows."
        return [part for line in [head, *short] for part in textwrap.wrap(line, width, subsequent_indent="  ")]
    names = recommended_names(stack, stack_estimate, singles)
    figure = stack_estimate if len(names) > 1 else singles.get(names[0])
    lines = []
    if len(names) < len(stack.names):
        lines.append(
            f"The stack {stack.name} measured {stack_estimate.format()}, below {names[0]} alone: use {names[0]}."  # type: ignore[union-attr]
        )
    what = "+".join(names)
    if figure is None:
        head = f"Recommendation: {what} (the stack could not be measured: see the table)."
    else:
        head = f"Recommendation: {what}: {figure.format()} speed-up"
        head += f" ({settled_note})." if settled_note else "."
    lines.insert(0, head)
    lines += [f"Left out of the stack: {name} ({why})." for name, why in stack.dropped] + short
    prose = [part for line in lines for part in textwrap.wrap(line, width, subsequent_indent="  ")]
    code = trainer_python(names, lookup, width=width - 4)
    python = ["Add to your Trainer:", *(f"    {line}".rstrip() for line in code)]
    yaml = ["Or in your LightningCLI --config file:", *(f"    {line}" for line in trainer_yaml(names, lookup))]
    return prose + (yaml + python if config_file else python + yaml)
