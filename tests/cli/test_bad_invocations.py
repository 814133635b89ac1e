"""Every bad invocation of ``bench`` and ``autotune`` exits 2 with one line on stderr naming the option and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_perf.cli import main

MISSING = str(Path(__file__).parent / "no-such-dir" / "x.json")
NET, DATA = "tests.tuning._user_models:SmallConvNet", "tests.tuning._user_models:PlainDataModule"

BENCH = [
    (["--workload", "mnist"], "--workload", "mnist"),
    (["--configs", "baseline,warp_drive"], "--configs", "warp_drive"),
    (["--configs", "channels_last+warp"], "--configs", "warp"),
    (["--configs", " , "], "--configs", "' , '"),
    (["--preset", "huge"], "--preset", "huge"),
    (["--steps", "0"], "--steps", "'0'"),
    (["--steps", "ten"], "--steps", "'ten'"),
    (["--warmup-steps", "-1"], "--warmup-steps", "'-1'"),
    (["--repeats", "0"], "--repeats", "'0'"),
    (["--batch-size", "1.5"], "--batch-size", "'1.5'"),
    (["--predict-batches", "-3"], "--predict-batches", "'-3'"),
    (["--num-workers", "x"], "--num-workers", "'x'"),
    (["--device", "tpu"], "--device", "tpu"),
    (["--precision", "8-true"], "--precision", "8-true"),
    (["--config", "baseline"], "--config", "baseline"),  # no abbreviation of --configs
    (["--output", str(Path(__file__).parent)], "--output", str(Path(__file__).parent)),
    (["--configs", "bf16-mixed+16-mixed", "--list"], None, None),  # --list ignores --configs: exit 0
    (["--configs", "baseline,,compile"], "--configs", "'baseline,,compile'"),  # an empty name is refused
    (["--configs", "chanels_last"], "--configs", "did you mean 'channels_last'?"),  # a suggestion, not 22 names
    (["--workload", "convnt"], "--workload", "did you mean 'convnet'?"),
    (["--preset", "defualt"], "--preset", "did you mean 'default'?"),
    (["--output", "/proc/forbidden/x.json"], "--output", "'/proc/forbidden/x.json'"),  # refused before any run
    (["--device", "cuda:7"], "--device", "cuda:7"),  # no such device here
]

AUTOTUNE = [
    ([], "--workload", None),  # one of --workload / --model is required
    (["--workload", "mnist"], "--workload", "mnist"),
    (["--workload", "convnet", "--model", "a.b:C"], "--model", "--workload"),  # argparse names both options
    (["--model", "not a spec", "--datamodule", "a:B"], "--model", "not a spec"),
    (["--model", NET], "--model", NET),
    (["--model", "no_such_pkg.models:Net", "--datamodule", DATA], "--model", "no_such_pkg.models:Net"),
    (["--model", "tests.tuning._user_models:Nope", "--datamodule", DATA], "--model", "tests.tuning._user_models:Nope"),
    (["--model", NET, "--datamodule", NET], "--datamodule", NET),
    (["--model", NET, "--datamodule", DATA, "--model-args", '{"depth": 4}'], "--model-args", "depth"),
    (["--workload", "convnet", "--model-args", "{bad json"], "--model-args", "{bad json"),
    (["--workload", "convnet", "--model-args", "[1, 2]"], "--model-args", "[1, 2]"),
    (["--workload", "convnet", "--datamodule", "a:B"], "--datamodule", "a:B"),
    (["--workload", "convnet", "--steps", "2"], "--steps", "'2'"),
    (["--workload", "convnet", "--warmup-steps", "0"], "--warmup-steps", "'0'"),
    (["--workload", "convnet", "--time-budget", "0"], "--time-budget", "'0'"),
    (["--workload", "convnet", "--time-budget", "nan"], "--time-budget", "'nan'"),
    (["--workload", "convnet", "--min-gain", "-0.1"], "--min-gain", "'-0.1'"),
    (["--workload", "convnet", "--precisions", "fp4"], "--precisions", "fp4"),
    (["--workload", "convnet", "--optimizations", "warp"], "--optimizations", "warp"),
    (["--workload", "convnet", "--optimizations", "bf16-mixed"], "--optimizations", "bf16-mixed"),
    (["--workload", "convnet", "--max-batch-size", "0"], "--max-batch-size", "'0'"),
    (["--workload", "convnet", "--max-num-workers", "-1"], "--max-num-workers", "'-1'"),
    (["--workload", "convnet", "--device", "gpu"], "--device", "gpu"),
    (["--workload", "convnet", "--preset", "huge"], "--preset", "huge"),
    (["--workload", "convnet", "--no-batch-size", "--max-batch-size", "8"], "--max-batch-size", "8"),
    (["--workload", "convnet", "--time", "5"], "--time", "5"),  # no abbreviation of --time-budget
    (["--workload", "convnet", "--output", "/proc/forbidden/t.yaml"], "--output", "'/proc/forbidden/t.yaml'"),
    (["--workload", "convnt"], "--workload", "did you mean 'convnet'?"),
]


def _one_error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(("argv", "option", "value"), [c for c in BENCH if c[1] is not None], ids=str)
def test_bad_bench_invocation(argv: list[str], option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_error_line(["bench", *argv], capsys)
    assert option in line and value in line


@pytest.mark.parametrize(("argv", "option", "value"), AUTOTUNE, ids=str)
def test_bad_autotune_invocation(argv: list[str], option: str, value: str | None, capsys) -> None:
    line = _one_error_line(["autotune", *argv], capsys)
    assert option in line
    if value is not None:
        assert value in line


def test_unknown_command_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_error_line(["frobnicate"], capsys)
    assert "frobnicate" in line and "bench" in line


def test_an_export_shape_is_echoed_as_typed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = tmp_path / "model.ckpt"
    checkpoint.write_bytes(b"")
    line = _one_error_line(["export", str(checkpoint), "--input-shape", "3,x"], capsys)
    assert "--input-shape" in line and "'3,x' is not valid" in line


def test_a_writable_output_folder_is_not_created_by_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The check makes a scratch folder in the nearest existing parent and removes it: nothing is left behind."""
    output = tmp_path / "new" / "deeper" / "x.json"
    line = _one_error_line(["bench", "--output", str(output), "--configs", "nope"], capsys)
    assert "--configs" in line  # the output passed; the next check failed
    assert list(tmp_path.iterdir()) == []
