"""PowerSGD hook wrapper, state (de)serialization and byte accounting, on a 1-process gloo group in this process."""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel

from lightning_perf.functional.powersgd import (
    CommunicationStats,
    PowerSGDHook,
    _batched_hook,
    gather_state_dict,
    register_powersgd_hook,
    ring_allreduce_seconds,
)


@pytest.fixture
def process_group() -> Iterator[None]:
    """A 1-process gloo group (an earlier in-process Lightning DDP fit may have left one up: it is reused)."""
    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _batches(n: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(8, 32, generator=generator) for _ in range(n)]


class _Run:
    """A DDP model with the PowerSGD hook and an SGD optimizer."""

    def __init__(self, model: nn.Module, bucket_cap_mb: float = 25.0, **hook_kwargs: object) -> None:
        self.model = model
        self.ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        kwargs = {"start_powerSGD_iter": 2, **hook_kwargs}
        self.hook = register_powersgd_hook(self.ddp, **kwargs)  # type: ignore[arg-type]
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def train(self, batches: list[torch.Tensor]) -> list[CommunicationStats]:
        stats = []
        for x in batches:
            self.ddp(x).pow(2).mean().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            stats.append(self.hook.take_stats())
        return stats


def _roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("saved_at", [5, 2], ids=["while-compressing", "before-compressing"])
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.0001], ids=["one-bucket", "bucket-per-parameter"])
def test_resume_in_a_new_ddp_trains_exactly_like_an_uninterrupted_run(
    process_group, bucket_cap_mb: float, saved_at: int
) -> None:
    """A new DDP starts with one bucket and rebuilds its buckets after a step: the state follows the parameters."""
    batches = _batches(10)
    straight = _Run(_model(), bucket_cap_mb)
    straight.train(batches)

    first = _Run(_model(), bucket_cap_mb)
    first.train(batches[:saved_at])
    state = _roundtrip(gather_state_dict(first.hook))  # type: ignore[arg-type]
    assert state["iter"] == saved_at and state["world_size"] == 1
    if saved_at > 2:
        assert set(state["residuals"][0]) == {name for name, _ in first.model.named_parameters()}
        assert set(state["q"]) == {"0.weight", "2.weight"}  # 4x64 is not worth compressing at rank 2
    else:
        assert state["residuals"] == [{}] and state["q"] == {}

    resumed = _Run(copy.deepcopy(first.model), bucket_cap_mb)
    resumed.optimizer.load_state_dict(first.optimizer.state_dict())
    assert resumed.hook.load_state_dict(state) == []
    resumed.train(batches[saved_at:])

    for (name, expected), actual in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(actual, expected, atol=0, rtol=0, msg=name)
    assert resumed.hook.state.rng.get_state()[2] == straight.hook.state.rng.get_state()[2]
    assert straight.hook.relayouts == 0  # buckets are compared by identity: a steady run never re-keys
    assert resumed.hook.relayouts <= 1


def test_state_dict_is_a_snapshot_of_plain_values(process_group) -> None:
    run = _Run(_model())
    run.train(_batches(4))
    state = run.hook.state_dict()
    loaded = _roundtrip(state)  # weights_only=True: tensors, ints, floats, strings, lists and dicts only
    assert loaded["rng"]["keys"].dtype == torch.int64 and loaded["rng"]["keys"].shape == (624,)
    q_before = {k: v.clone() for k, v in state["q"].items()}
    run.train(_batches(2))  # the hook updates its Q in place: the state dict must not follow
    for key, value in state["q"].items():
        torch.testing.assert_close(value, q_before[key], atol=0, rtol=0)


def test_stats_count_elements_and_bytes_handed_to_allreduce(process_group) -> None:
    run = _Run(_model(), matrix_approximation_rank=2)
    stats = run.train(_batches(3))
    total = sum(p.numel() for p in run.model.parameters())
    for plain in stats[:2]:  # before start_powerSGD_iter: plain all-reduce of every gradient
        assert plain.numel_before == plain.numel_after == total
        assert plain.bytes == plain.bytes_uncompressed == 4 * total
        assert plain.compression_rate == 1.0
    compressed = stats[2]
    # 64x32 and 64x64 become (64 + 32) * 2 and (64 + 64) * 2 elements; 4x64 and the biases are sent as they are.
    expected_after = (64 + 32) * 2 + (64 + 64) * 2 + 4 * 64 + 64 + 64 + 4
    assert compressed.numel_before == total
    assert compressed.numel_after == expected_after
    assert compressed.bytes == 4 * expected_after and compressed.bytes_uncompressed == 4 * total
    assert compressed.compression_rate == pytest.approx(total / expected_after)
    assert run.hook.take_stats() == CommunicationStats()
    assert math.isnan(CommunicationStats().compression_rate)


def test_cpu_buckets_train_while_cuda_is_visible(process_group, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's hook calls torch.cuda.synchronize(cpu) whenever CUDA is available; the wrapper skips that call."""

    def synchronize(device: object = None) -> None:
        raise RuntimeError(f"torch.cuda.synchronize({device!r}) called")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)

    stock = DistributedDataParallel(_model())  # the problem this guards against, reproduced with torch's hook
    stock.register_comm_hook(torch_powersgd.PowerSGDState(None, start_powerSGD_iter=2), torch_powersgd.powerSGD_hook)
    with pytest.raises(RuntimeError, match=r"synchronize\(device\(type='cpu'\)\)"):
        for x in _batches(3):
            stock(x).sum().backward()

    run = _Run(_model())
    assert run.hook.guard_cpu_synchronize and run.hook.synchronous
    stats = run.train(_batches(4))
    assert stats[-1].compression_rate > 1
    assert torch.cuda.synchronize is synchronize  # put back after each bucket


def test_batched_hook_compresses(process_group) -> None:
    if _batched_hook() is not torch_powersgd.batched_powerSGD_hook:  # this torch's own hook fails at compression
        with pytest.raises(AssertionError):
            torch_powersgd._orthogonalize(torch.ones(2, 1))
    run = _Run(_model(), hook="batched", matrix_approximation_rank=1)
    stats = run.train(_batches(4))
    assert stats[-1].compression_rate > 10
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


def test_batched_resume_waits_one_plain_step_for_the_rebuilt_buckets(process_group) -> None:
    first = _Run(_model(), bucket_cap_mb=0.01, hook="batched", matrix_approximation_rank=1)
    first.train(_batches(4))
    state = _roundtrip(first.hook.state_dict())
    resumed = _Run(copy.deepcopy(first.model), bucket_cap_mb=0.01, hook="batched", matrix_approximation_rank=1)
    assert resumed.hook.load_state_dict(state) == []
    stats = resumed.train(_batches(3))
    assert stats[0].compression_rate == 1.0  # one bucket before DDP's rebuild: no saved state fits it
    assert stats[1].compression_rate > 1 and stats[2].compression_rate > 1
    assert not resumed.hook._pending  # every saved bucket found its place


def test_load_reports_what_it_could_not_restore(process_group) -> None:
    run = _Run(_model())
    run.train(_batches(4))
    state = run.hook.state_dict()

    other_world = {**state, "world_size": 2, "residuals": [state["residuals"][0], state["residuals"][0]]}
    (reason,) = _Run(_model()).hook.load_state_dict(other_world)
    assert "saved from 2 ranks, now 1: error-feedback residuals reset" in reason

    (reason,) = _Run(_model(), matrix_approximation_rank=4).hook.load_state_dict(state)
    assert "matrix_approximation_rank=2, now 4: warm-start matrices reset" in reason

    fresh = _Run(_model(), hook="batched")
    (reason,) = fresh.hook.load_state_dict(state)
    assert "hook='powersgd', now hook='batched'" in reason
    assert fresh.hook.state.iter == 4  # the schedule is kept either way
    fresh.train(_batches(2))

    with pytest.raises(ValueError, match="Expected a PowerSGD state dict of format 1"):
        run.hook.load_state_dict({"format": 99})


def test_unknown_hook_variant_is_rejected(process_group) -> None:
    with pytest.raises(ValueError, match=r"hook='qsgd' is not valid\. Expected one of powersgd, batched"):
        PowerSGDHook(torch_powersgd.PowerSGDState(None), "qsgd", {}, True, False)  # type: ignore[arg-type]


def test_ring_allreduce_model() -> None:
    assert ring_allreduce_seconds(1e9, 8, 1e9) == pytest.approx(2 * 7 / 8)
    assert ring_allreduce_seconds(1e9, 1, 1e9) == 0.0
    with pytest.raises(ValueError, match="workers=0"):
        ring_allreduce_seconds(1.0, 0, 1.0)
