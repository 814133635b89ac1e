"""The bench's recommendation: the winners' stack and the Trainer lines, from scripted results (no timing)."""

from __future__ import annotations

import yaml

from lightning_perf.benchmark.stack import choose_stack, is_winner, recommendation_lines, trainer_python, trainer_yaml
from lightning_perf.profiling.intervals import METHOD_SINGLE, METHOD_T, NO_CLEAR_DIFFERENCE, RatioEstimate


def est(ratio: float, low: float, high: float, verdict: str | None = None) -> RatioEstimate:
    if verdict is None:
        verdict = "faster" if low > 1 else "slower" if high < 1 else NO_CLEAR_DIFFERENCE
    return RatioEstimate(ratio, low, high, METHOD_T, verdict, 5)


SINGLES = {
    "channels_last": est(1.62, 1.51, 1.82),
    "fused_optimizer": est(1.10, 1.04, 1.16),
    "backend_flags": est(1.02, 0.95, 1.09),  # no clear difference: not a winner
    "bf16-mixed": est(0.50, 0.45, 0.55),  # slower
    "compile": est(2.08, 1.90, 2.20),
    "compile_reduce_overhead": est(1.50, 1.30, 1.70),  # a second compile: dropped
    "16-mixed": est(1.30, 1.20, 1.40),
}


def test_winners_are_faster_with_the_whole_interval_above_one() -> None:
    assert is_winner(est(1.1, 1.01, 1.2))
    assert not is_winner(est(1.1, 0.99, 1.2))
    assert not is_winner(RatioEstimate(1.5, 1.5, 1.5, METHOD_SINGLE, "one repeat: no interval", 1))
    assert not is_winner(None)
    # The evidence rule: faster over 2 repeats is not enough to change a Trainer; the output says what would be.
    two = RatioEstimate(2.01, 1.004, 4.36, METHOD_T, "faster", 2)
    assert not is_winner(two) and is_winner(RatioEstimate(2.01, 1.004, 4.36, METHOD_T, "faster", 3))
    lines = recommendation_lines(choose_stack({"fused_optimizer": two}), None, {"fused_optimizer": two})
    assert lines[0].startswith("Recommendation: none yet") and all(len(line) <= 80 for line in lines)
    assert "Not enough evidence: fused_optimizer measured 2.01x" in " ".join(lines)
    assert "run with --repeats 3" in " ".join(lines)


def test_the_stack_is_built_from_the_winners_best_first() -> None:
    stack = choose_stack(SINGLES)
    assert stack.names == ("16-mixed", "channels_last", "fused_optimizer", "compile")  # compile applies last
    assert stack.name == "16-mixed+channels_last+fused_optimizer+compile"
    assert dict(stack.dropped) == {"compile_reduce_overhead": "tried in place of compile, not on top of it"}
    assert choose_stack({"bf16-mixed": est(1.4, 1.3, 1.5), "16-mixed": est(1.3, 1.2, 1.4)}).dropped == (
        ("16-mixed", "sets Trainer(precision=...) as bf16-mixed does"),
    )
    assert choose_stack({"baseline": est(1.0, 1.0, 1.0), "a+b": est(2, 1.5, 3), "nope": est(2, 1.5, 3)}).names == ()


def test_python_and_yaml_lines_add_the_stack() -> None:
    python = "\n".join(trainer_python(["channels_last", "16-mixed", "compile_reduce_overhead"]))
    assert "from lightning_perf.callbacks import ChannelsLastCallback, CompileCallback" in python
    namespace: dict = {}
    exec(
        python.replace("from lightning_perf.callbacks import", "# "),
        {
            "Trainer": lambda **kw: kw,
            **{"ChannelsLastCallback": lambda: "cl", "CompileCallback": lambda **kw: ("compile", kw)},
        },
        namespace,
    )
    assert namespace["trainer"] == {
        "precision": "16-mixed",
        "callbacks": ["cl", ("compile", {"mode": "reduce-overhead"})],
    }
    section = yaml.safe_load("\n".join(trainer_yaml(["channels_last", "16-mixed", "compile_reduce_overhead"])))
    assert section == {
        "trainer": {
            "precision": "16-mixed",
            "callbacks": [
                {"class_path": "lightning_perf.callbacks.ChannelsLastCallback"},
                {"class_path": "lightning_perf.callbacks.CompileCallback", "init_args": {"mode": "reduce-overhead"}},
            ],
        }
    }


def test_the_recommendation_ends_with_the_measured_stack() -> None:
    stack = choose_stack({k: SINGLES[k] for k in ("channels_last", "fused_optimizer", "bf16-mixed")})
    lines = recommendation_lines(stack, est(1.75, 1.66, 1.84), SINGLES)
    text = "\n".join(lines)
    assert lines[0] == "Recommendation: channels_last+fused_optimizer: 1.75x [1.66-1.84] speed-up."
    assert "callbacks=[ChannelsLastCallback(), FusedOptimizerCallback()]" in text
    assert "    - class_path: lightning_perf.callbacks.FusedOptimizerCallback" in text
    assert text.index("Add to your Trainer") < text.index("--config file")
    assert all(len(line) <= 80 for line in lines)
    unsettled = recommendation_lines(stack, est(1.75, 1.4, 2.1), SINGLES, settled_note="unsettled after 3 repeats",
                                     config_file=True)  # fmt: skip
    assert "(unsettled after 3 repeats)" in " ".join(unsettled[:2])
    assert "\n".join(unsettled).index("--config file") < "\n".join(unsettled).index("Add to your Trainer")


def test_a_stack_slower_than_its_best_part_recommends_the_part() -> None:
    stack = choose_stack({k: SINGLES[k] for k in ("channels_last", "fused_optimizer")})
    lines = recommendation_lines(stack, est(1.30, 1.2, 1.4), SINGLES)
    assert lines[0].startswith("Recommendation: channels_last: 1.62x [1.51-1.82] speed-up")
    assert "below channels_last alone: use channels_last." in " ".join(" ".join(lines).split())
    assert not any("FusedOptimizerCallback" in line for line in lines)


def test_nothing_won() -> None:
    lines = recommendation_lines(choose_stack({"bf16-mixed": SINGLES["bf16-mixed"]}), None, SINGLES)
    assert lines == ["Recommendation: nothing measured faster than baseline here; keep your Trainer as it is."]


def test_long_lines_break_within_80_columns() -> None:
    names = ["channels_last", "fused_optimizer", "compile", "grad_checkpoint_budget50"]
    stack = choose_stack({n: est(1.2 + i / 10, 1.1, 1.9) for i, n in enumerate(names)})
    lines = recommendation_lines(stack, est(1.9, 1.7, 2.1), {}, settled_note="unsettled after 4 repeats (+-9%): about "
                                 "12 repeats (~3 min 20 s more) would settle it to +-5%")  # fmt: skip
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    code = "\n".join(line[4:] for line in lines if line.startswith("    "))
    compile(code.split("trainer:")[0], "<recommendation>", "exec")  # the Python part stays valid when broken
