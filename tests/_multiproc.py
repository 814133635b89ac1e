"""One 2-process launch for the registry's DDP and FSDP2 tests: ``python tests/_multiproc.py JOBS OUT DEVICE``.

``JOBS`` is a JSON list of ``{"mode": "ddp" | "fsdp2", "setting": <id> | null, "model": <sharded model>}`` (a null
setting is the plain FSDP2 reference run of that model). The process started by the test is rank 0: it starts rank 1
(this same script with ``LOCAL_RANK=1``, as Lightning's own launcher does), both join one process group, and every
job runs in sequence in that group, each with its own ``Trainer`` (``strategy="ddp"`` or
``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)``). Lightning finds the group already there and
the processes already started, so it launches nothing. A job's exception is caught on its rank and recorded with its
traceback: one setting's failure neither stops nor hides the others. Rank 0 writes ``OUT/<mode>__<id>.json`` per job.

Starting two processes and importing torch and Lightning costs 6-10 s on a 2-core machine; one launch for the whole
matrix pays it once instead of once per setting.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# How long a rank waits inside a collective for the other one: a hung setting costs this much, then the run ends.
COLLECTIVE_TIMEOUT_S = 300
RESULT_SUFFIX = ".json"


def result_name(mode: str, setting_id: str | None, model: str | None = None) -> str:
    """The file a job's result is written to (``plain-<model>`` for the reference run of a sharded model)."""
    return f"{mode}__{setting_id if setting_id is not None else f'plain-{model}'}{RESULT_SUFFIX}"


def run(jobs: list[dict[str, Any]], out: Path, device: str, timeout_s: float, log: Path, attempts: int = 4) -> int:
    """Run the jobs from a test (rank 0 in a subprocess) and wait; returns the last launch's exit status.

    A job that breaks the process group (a collective on one rank only: gloo aborts the other process) ends its
    launch: its result says so, and the jobs after it run in a fresh launch, up to ``attempts`` launches in all.
    Output goes to ``log``.
    """
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}  # a stale LOCAL_RANK would make it rank 1
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    # One thread per rank, as Lightning's own launcher sets on CPU: two ranks share the cores without
    # oversubscribing them, and a reduction's split across threads cannot change between runs.
    env.setdefault("OMP_NUM_THREADS", "1")
    deadline = time.monotonic() + timeout_s
    remaining, returncode = list(jobs), 0
    with log.open("w") as stream:
        for attempt in range(attempts):
            jobs_file = out / f"jobs-{attempt}.json"
            jobs_file.write_text(json.dumps(remaining))
            stream.write(f"[multiproc] launch {attempt + 1}: {len(remaining)} job(s)\n")
            stream.flush()
            # Its own session: on a timeout both ranks (rank 1 is rank 0's child) are killed together.
            proc = subprocess.Popen(
                [sys.executable, str(Path(__file__)), str(jobs_file), str(out), device],
                env=env,
                stdout=stream,
                stderr=subprocess.STDOUT,
                cwd=out,
                start_new_session=True,
            )
            try:
                returncode = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                returncode = -9
                stream.write(f"\n[multiproc] killed: the launches took more than {timeout_s:.0f} s\n")
            missing = [j for j in remaining if not (out / _name(j)).exists()]
            if not missing or returncode == -9:
                break
            if not any("abandoned" in json.loads((out / _name(j)).read_text()) for j in remaining if j not in missing):
                # Rank 0 itself died during the first missing job: it is the culprit, the rest never ran.
                culprit = missing.pop(0)
                why = f"the launch died during this job (exit status {returncode}); see the launch log"
                (out / _name(culprit)).write_text(
                    json.dumps({"job": culprit, "ranks": [{"ok": False, "error": why}], "abandoned": why})
                )
            stream.write(f"[multiproc] launch {attempt + 1} ended (exit status {returncode}); {len(missing)} left\n")
            remaining = missing
            if not remaining:
                break
    return returncode


def _name(job: dict[str, Any]) -> str:
    return result_name(job["mode"], job["setting"], job.get("model"))


_DIST_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


# ----------------------------------------------------------------------------------------------- inside the ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_rank_one() -> subprocess.Popen[bytes]:
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2", "NODE_RANK": "0"}
    )
    os.environ["LOCAL_RANK"] = "0"
    return subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, "LOCAL_RANK": "1"})


def _say(message: str) -> None:
    print(f"[multiproc rank {os.environ.get('LOCAL_RANK')}] {message}", flush=True)


class _Runner:
    def __init__(self, device: str, out: Path) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.device, self.out = device, out
        self.rank = int(os.environ["LOCAL_RANK"])
        self.model: Any = None

    def trainer_kwargs(self, mode: str, root: Path) -> dict[str, Any]:
        common: dict[str, Any] = {
            "accelerator": "gpu" if self.device == "cuda" else "cpu",
            "devices": 2,
            "num_sanity_val_steps": 0,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": root,
        }
        if mode == "ddp":
            return {**common, "max_steps": 3, "limit_val_batches": 2}
        # One epoch of three batches, then one validation batch: fit-end work (exports, conversions) runs too.
        return {**common, "max_epochs": 1, "limit_train_batches": 3, "limit_val_batches": 1}

    def fit(self, job: dict[str, Any]) -> dict[str, Any]:
        import lightning.pytorch as pl
        import torch
        from lightning.pytorch.callbacks import Callback
        from lightning.pytorch.strategies import ModelParallelStrategy

        from lightning_perf._warnings import LightningPerfWarning, reset_warn_once
        from lightning_perf.demos import make_workload
        from tests._models import SHARDED_MODELS
        from tests.callback_settings import get_setting

        class Losses(Callback):
            def __init__(self) -> None:
                self.values: list[float] = []

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
                self.values.append(float(outputs["loss"]))

        mode, setting = job["mode"], (get_setting(job["setting"]) if job["setting"] is not None else None)
        record: dict[str, Any] = {"rank": self.rank, "ok": False, "error": None, "traceback": None, "losses": []}
        reset_warn_once()
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                instance: Any = setting.build() if setting is not None else None
                kwargs = self.trainer_kwargs(mode, self.out / "roots" / Path(_name(job)).stem)
                pl.seed_everything(0, verbose=False)
                if mode == "ddp":
                    assert setting is not None
                    model, data = make_workload(setting.workload, setting.preset, seed=0)
                else:
                    model, data = SHARDED_MODELS[job["model"]](), None
                    kwargs["strategy"] = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
                losses = Losses()
                callbacks: list[Callback] = [losses]
                if setting is not None:
                    kwargs.update(setting.trainer_kwargs)
                    if setting.is_strategy:
                        kwargs["strategy"] = instance
                    else:
                        kwargs.setdefault("strategy", "ddp")
                        callbacks.insert(0, instance)  # the callback under test first, as a user would list it
                trainer = pl.Trainer(callbacks=callbacks, **kwargs)
                trainer.fit(model, datamodule=data)
                record.update(
                    ok=True,
                    losses=losses.values,
                    global_step=trainer.global_step,
                    world_size=trainer.world_size,
                    strategy=type(trainer.strategy).__name__,
                    threads=torch.get_num_threads(),
                )
                self.model = model
            except Exception as error:
                record.update(error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc()[-8000:])
                self.model = None
        record["warnings"] = [
            {
                "category": w.category.__name__,
                "lightning_perf": issubclass(w.category, LightningPerfWarning),
                "message": str(w.message)[:3000],
                "where": f"{w.filename}:{w.lineno}",
            }
            for w in caught
        ]
        record["seconds"] = round(time.perf_counter() - start, 2)
        return record

    def checksum(self) -> float:
        """The sum of the full parameters (DTensor shards gathered): a collective, called on both ranks."""
        import torch
        from torch.distributed.tensor import DTensor

        assert self.model is not None
        total = torch.zeros((), dtype=torch.float64)
        for p in self.model.parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            total += full.detach().double().sum().cpu()
        return float(total)

    def run(self, jobs: list[dict[str, Any]]) -> None:
        dist = self.dist
        for index, job in enumerate(jobs):
            name = _name(job)
            try:
                where: list[Any] = [None, None]
                dist.all_gather_object(where, index)
                if where != [index, index]:
                    raise RuntimeError(f"the ranks are at different jobs: {where}")
            except Exception as error:
                self._abandon(jobs[index:], f"process group unusable before this job: {error!r}")
                return
            _say(f"{name} ...")
            record = self.fit(job)
            try:
                records: list[Any] = [None, None]
                dist.all_gather_object(records, record)
                both_ok = all(r["ok"] for r in records)
                sums: list[Any] = [None, None]
                if both_ok:
                    dist.all_gather_object(sums, self.checksum())
            except Exception as error:
                self._abandon(jobs[index:], f"process group unusable after this job: {error!r}", record)
                return
            self.model = None
            _say(f"{name}: {'ok' if both_ok else 'FAILED'} in {record['seconds']} s")
            if self.rank == 0:
                result: dict[str, Any] = {"job": job, "ranks": records, "checksums": sums}
                result["ranks_agree"] = both_ok and abs(sums[0] - sums[1]) <= 1e-6 * max(1.0, abs(sums[0]))
                (self.out / name).write_text(json.dumps(result, indent=1))

    def _abandon(self, jobs: list[dict[str, Any]], why: str, own: dict[str, Any] | None = None) -> None:
        """Stop here; with ``own`` (the job that broke the group), record it as failed, with what this rank saw."""
        _say(f"abandoning {len(jobs)} job(s): {why}")
        if self.rank != 0 or own is None:
            return
        record = {**own, "ok": False, "error": f"{why} (this rank's own fit: {own['error'] or 'ended'})"}
        result = {"job": jobs[0], "ranks": [record], "abandoned": why}
        (self.out / _name(jobs[0])).write_text(json.dumps(result, indent=1))


def main() -> int:
    jobs_file, out, device = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    child = _start_rank_one() if "LOCAL_RANK" not in os.environ else None  # before the heavy imports: in parallel
    rank = int(os.environ["LOCAL_RANK"])
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", rank=rank, world_size=2, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    jobs = json.loads(jobs_file.read_text())
    start = time.perf_counter()
    _Runner(device, out).run(jobs)
    _say(f"{len(jobs)} job(s) in {time.perf_counter() - start:.1f} s")
    try:
        # Lightning leaves the group alive after fit; gloo's threads dying at interpreter exit can abort the process.
        dist.barrier()
    except Exception as error:  # the other rank is gone (a job broke the group): nothing left to synchronize
        _say(f"final barrier: {error!r}")
    finally:
        dist.destroy_process_group()
    if child is not None:
        try:
            return child.wait(timeout=COLLECTIVE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            return -9
    return 0


if __name__ == "__main__":
    sys.exit(main())
