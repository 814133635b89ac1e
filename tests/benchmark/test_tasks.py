"""Task files (`lightning-perf bench --tasks`): every row checked before anything runs, errors naming row and column."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_perf.benchmark.tasks import Task, TaskFileError, read_tasks

HEADER = "name,config,configs,steps,batch_size,workload,model,datamodule,model_args,datamodule_args,stage,precision"


def _file(tmp_path: Path, text: str, name: str = "tasks.csv") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_a_valid_file_gives_its_tasks(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    path = _file(
        tmp_path,
        f"{HEADER},repeats,warmup_steps,ref\n"
        "# a comment line\n"
        "from_yaml,conf/cli.yaml,baseline;channels_last+compile,5,,,,,,,predict,,,,\n"
        "\n"
        'own,,,,64,,pkg.mod:Net,pkg.data.Data,"{""depth"": 2}",,,bf16-mixed,3,2,main;.\n'
        "ref_wl,,baseline,,,convnet,,,,,,,,,\n",
    )
    tasks = read_tasks(path, check_names=True)
    assert [t.name for t in tasks] == ["from_yaml", "own", "ref_wl"]
    first, own, workload = tasks
    assert first.line == 3 and own.line == 5 and workload.line == 6
    assert first.config == ((tmp_path / "conf" / "cli.yaml").absolute(),)  # against the task file's directory
    assert first.configs == ("baseline", "channels_last+compile") and first.steps == 5 and first.stage == "predict"
    assert first.batch_size is None and first.repeats is None and first.refs == ()
    assert own.model == "pkg.mod:Net" and own.datamodule == "pkg.data:Data"
    assert json.loads(own.model_args) == {"depth": 2} and own.datamodule_args is None
    expected_own = (64, "bf16-mixed", 3, 2, ("main", "."))
    assert (own.batch_size, own.precision, own.repeats, own.warmup_steps, own.refs) == expected_own
    assert workload.workload == "convnet" and workload.columns_set() == {"workload", "configs"}
    argv = first.argv(config_path=lambda p: Path("/tree") / p.name)
    expected = ["--config", "/tree/cli.yaml", "--configs", "baseline,channels_last+compile"]
    assert argv == [*expected, "--steps", "5", "--stage", "predict"]
    assert own.argv()[:4] == ["--batch-size", "64", "--model", "pkg.mod:Net"]
    columns = {"batch_size", "model", "datamodule", "model_args", "precision", "repeats", "warmup_steps"}
    assert own.columns_set() == columns


def test_absolute_config_paths_stay_and_several_are_merged_in_order(tmp_path: Path) -> None:
    path = _file(tmp_path, f"{HEADER}\nt,/abs/a.yaml; b.yaml,,,,,,,,,,\n")
    (task,) = read_tasks(path)
    assert task.config == (Path("/abs/a.yaml"), (tmp_path / "b.yaml").absolute())
    assert Task("x", config=task.config).argv() == ["--config", "/abs/a.yaml", "--config", str(tmp_path / "b.yaml")]


MALFORMED = [
    # (file text, line, column or None, words the message holds)
    ("name,config,configs,steps\nt,,,\n", 1, None, "missing column(s) 'batch_size'"),
    ("name,config,configs,steps,batch_size,epochs\nt,,,,,\n", 1, "epochs", "unknown column"),
    ("name,config,configs,steps,batch_size,steps\n", 1, "steps", "twice"),
    (f"{HEADER}\nt,,,0,,convnet,,,,,,\n", 2, "steps", "'0' is not valid. Expected an integer >= 1"),
    (f"{HEADER}\nt,,,,big,convnet,,,,,,\n", 2, "batch_size", "'big' is not valid"),
    (f"{HEADER}\nok,,,,,convnet,,,,,,\nok,,,,,convnet,,,,,,\n", 3, "name", "already the name of the task on line 2"),
    (f"{HEADER}\nOK,,,,,convnet,,,,,,\nok,,,,,convnet,,,,,,\n", 3, "name", "already the name"),
    (f"{HEADER}\nmy/task,,,,,convnet,,,,,,\n", 2, "name", "file-safe name"),
    (f"{HEADER}\n,,,,,convnet,,,,,,\n", 2, "name", "file-safe name"),
    (f"{HEADER}\nsummary,,,,,convnet,,,,,,\n", 2, "name", "other than summary"),
    (f"{HEADER}\nt,,,,,,pkg:M,pkg:D,{{depth: 2}},,,\n", 2, "model_args", "a JSON object"),
    (f"{HEADER}\nt,,,,,,pkg:M,pkg:D,,[1],,\n", 2, "datamodule_args", "not a JSON list"),
    (f"{HEADER}\nt,,,,,,,,,,,\n", 2, "config", "names no model"),
    (f"{HEADER}\nt,a.yaml,,,,convnet,,,,,,\n", 2, "workload", "names its model twice"),
    (f"{HEADER}\nt,,,,,,pkg:M,,,,,\n", 2, "datamodule", "model needs a datamodule"),
    (f"{HEADER}\nt,,,,,convnet,,pkg:D,,,,\n", 2, "datamodule", "goes with model"),
    (f"{HEADER}\nt,,,,,,not a class,pkg:D,,,,\n", 2, "model", "MODULE:CLASS"),
    (f"{HEADER}\nt,,,,,convnet,,,,,train,\n", 2, "stage", "one of fit, predict, validate, test"),
    (f"{HEADER}\nt,,a,b,,,convnet,,,,,,\n", 2, None, "has 13 cells, the header has 12"),
    (f'{HEADER}\nt,,"a,b",,,convnet,,,,,,\n', 2, "configs", "separated by ';', not ','"),
    (f'{HEADER}\nt,,,,,convnet,,,,,,\nu,,,,,"convnet,,,,,,\n', 3, None, "is not valid CSV"),
    (f"{HEADER},ref\nt,,,,,convnet,,,,,,,--force\n", 2, "ref", "git refs separated by ';'"),
    ("", None, None, "is empty"),
    (f"{HEADER}\n# only a comment\n", None, None, "no task"),
]


@pytest.mark.parametrize(("text", "line", "column", "words"), MALFORMED)
def test_a_malformed_file_is_refused_naming_line_and_column(
    tmp_path: Path, text: str, line: int | None, column: str | None, words: str
) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(TaskFileError) as caught:
        read_tasks(path)
    message = str(caught.value)
    assert message.startswith(str(path)) and "\n" not in message
    if line is not None:
        assert f", line {line}" in message
    if column is not None:
        assert f"column {column!r}" in message
    assert words in message


@pytest.mark.parametrize(
    ("cells", "column", "words"),
    [
        ("t,,baseline;warp_drive,,,convnet,,,,,,", "configs", "unknown configuration 'warp_drive'"),
        ("t,,,,,convnet,,,,,,fp7", "precision", "'fp7' is not valid. Expected one of 32-true"),
        ("t,,,,,mnist,,,,,,", "workload", "'mnist' is not valid. Expected one of convnet"),
    ],
)
def test_names_are_checked_on_request(tmp_path: Path, cells: str, column: str, words: str) -> None:
    path = _file(tmp_path, f"{HEADER}\n{cells}\n")
    read_tasks(path)  # names are not checked by default (their registries import torch)
    with pytest.raises(TaskFileError, match=f"line 2, column '{column}'") as caught:
        read_tasks(path, check_names=True)
    assert words in str(caught.value)


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(TaskFileError, match="no such file"):
        read_tasks(tmp_path / "nope.csv")
    with pytest.raises(TaskFileError, match="is a directory"):
        read_tasks(tmp_path)
    binary = tmp_path / "b.csv"
    binary.write_bytes(b"\xff\xfe\x00name")
    with pytest.raises(TaskFileError, match="not UTF-8"):
        read_tasks(binary)


def test_the_module_is_torch_free() -> None:
    import subprocess

    code = (
        "import sys, lightning_perf.benchmark.tasks, lightning_perf.benchmark.refs; "
        "print(sorted(m for m in ('torch', 'lightning', 'numpy') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
