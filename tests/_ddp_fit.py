"""Run one registry entry under 2-process DDP on CPU (gloo): ``python tests/_ddp_fit.py SETTING_ID RESULT ROOT``.

Lightning's ``ddp`` launcher re-runs this script for rank 1, which is why it is a script and not a pytest test body.
Rank 0 writes a JSON result; both ranks compare a checksum of their parameters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_perf.demos import make_workload
from tests.callback_settings import get_setting


def main() -> None:
    setting_id, result_path, root = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    setting = get_setting(setting_id)
    pl.seed_everything(0, verbose=False)
    model, data = make_workload(setting.workload, setting.preset, seed=0)
    instance = setting.build()
    kwargs = {
        "accelerator": "cpu",
        "devices": 2,
        "max_steps": 3,
        "limit_val_batches": 2,
        "num_sanity_val_steps": 0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": root,
        **setting.trainer_kwargs,
    }
    if setting.is_strategy:
        kwargs["strategy"] = instance
    else:
        kwargs["strategy"] = "ddp"
        kwargs["callbacks"] = [instance]
    trainer = pl.Trainer(**kwargs)
    trainer.fit(model, datamodule=data)

    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    gathered = [torch.zeros_like(checksum) for _ in range(trainer.world_size)]
    dist.all_gather(gathered, checksum)
    if trainer.global_rank == 0:
        result = {
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "ranks_agree": bool(all(torch.allclose(g, gathered[0], rtol=0, atol=1e-6) for g in gathered)),
        }
        result_path.write_text(json.dumps(result))
    # Lightning leaves the process group alive after fit; gloo's worker threads then die during interpreter
    # finalization and abort the process (SIGABRT, "terminate called without an active exception") now and then.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
