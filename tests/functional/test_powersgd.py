"""PowerSGD hook wrapper, state (de)serialization and byte accounting, on a 1-process gloo group in this process."""

from __future__ import annotations

import copy
import gc
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
    waits_each_bucket,
)


@pytest.fixture(scope="module")
def process_group() -> Iterator[None]:
    """A 1-process gloo group for the module's tests (an earlier in-process Lightning DDP fit may have left one up: it
    is reused)."""
    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        # The tests' DDP models and their comm hooks hold each other (a cycle), freed by the collector at any later
        # moment: once per test, a destroyed group under them aborted the process (SIGABRT, seen once in the suite).
        gc.collect()
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
    with pytest.raises(ValueError, match=r"PowerSGDHook\(hook='qsgd'\)` is not valid\. Expected one of 'powersgd'"):
        PowerSGDHook(torch_powersgd.PowerSGDState(None), "qsgd", {}, True, False)  # type: ignore[arg-type]


def test_ring_allreduce_model() -> None:
    assert ring_allreduce_seconds(1e9, 8, 1e9) == pytest.approx(2 * 7 / 8)
    assert ring_allreduce_seconds(1e9, 1, 1e9) == 0.0
    with pytest.raises(ValueError, match="workers=0"):
        ring_allreduce_seconds(1.0, 0, 1.0)


# ------------------------------------------------------------------------------ backends and devices (NCCL, CUDA)


@pytest.mark.parametrize(
    ("backend", "device_type", "waits"),
    [
        ("nccl", "cuda", False),  # NCCL: torch's asynchronous hook, as shipped
        ("gloo", "cpu", True),  # gloo: each bucket finished before the hook returns (else it can deadlock)
        ("gloo", "cuda", True),
        ("cpu:gloo,cuda:nccl", "cuda", False),
        ("cpu:gloo,cuda:nccl", "cpu", True),
        ("NCCL", "cuda", False),
        ("mpi", "cpu", True),
    ],
)
def test_the_hook_waits_on_each_bucket_everywhere_but_nccl(backend: str, device_type: str, waits: bool) -> None:
    assert waits_each_bucket(backend, device_type) is waits


class _FakeGroup:
    def size(self) -> int:
        return 1


class _Bucket:
    """What DDP hands a comm hook: one flat buffer on ``device`` and each parameter's gradient as a view into it."""

    def __init__(self, model: nn.Module, device: str, index: int = 0) -> None:
        self.params = list(model.parameters())
        self.buf = torch.zeros(sum(p.numel() for p in self.params), device=device)
        self.grads, offset = [], 0
        for p in self.params:
            self.grads.append(self.buf[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self._index = index

    def buffer(self) -> torch.Tensor:
        return self.buf

    def index(self) -> int:
        return self._index

    def parameters(self) -> list[torch.Tensor]:
        return self.params

    def gradients(self) -> list[torch.Tensor]:
        return self.grads

    def is_last(self) -> bool:
        return True


@pytest.fixture
def collective_devices(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """Replace ``dist.all_reduce`` by one that records the device of every tensor handed to it."""
    seen: list[torch.device] = []

    class Work:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

        def get_future(self) -> torch.futures.Future:
            future: torch.futures.Future = torch.futures.Future()
            future.set_result([self.tensor])
            return future

        def wait(self) -> bool:
            return True

    def all_reduce(tensor: torch.Tensor, op: object = None, group: object = None, async_op: bool = False) -> Work:
        seen.append(tensor.device)
        return Work(tensor)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return seen


@pytest.mark.parametrize("variant", ["powersgd", "batched"])
@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed-from-a-cpu-checkpoint"])
def test_every_collective_gets_tensors_on_the_buckets_device(
    process_group, collective_devices: list[torch.device], variant: str, resumed: bool
) -> None:
    """On a GPU every tensor handed to NCCL must be on the GPU. The "meta" device stands in for CUDA here: a tensor
    the hook's state creates on the CPU (a fresh Q, a restored residual) would show up as a CPU tensor."""
    rank = 1 if variant == "batched" else 2
    saved = None
    if resumed:
        run = _Run(_model(), hook=variant, matrix_approximation_rank=rank)
        run.train(_batches(4))
        saved = _roundtrip(run.hook.state_dict())  # on the CPU, as a checkpoint holds it
        collective_devices.clear()
    model = _model()
    state = torch_powersgd.PowerSGDState(_FakeGroup(), matrix_approximation_rank=rank, start_powerSGD_iter=2)
    names = {id(p): n for n, p in model.named_parameters()}
    hook = PowerSGDHook(state, variant, names, synchronous=False, guard_cpu_synchronize=False)  # type: ignore[arg-type]
    if saved is not None:
        assert hook.load_state_dict(saved) == []
    for _ in range(4):
        hook.run(_Bucket(model, "meta")).wait()  # type: ignore[arg-type]
    assert collective_devices and set(collective_devices) == {torch.device("meta")}
    held = [*state.error_dict.values(), *state.p_memory_dict.values(), *state.q_memory_dict.values()]
    assert held and all(t.device.type == "meta" for t in held)
    assert state.iter == (8 if resumed else 4)


def test_state_left_on_another_device_follows_the_bucket(process_group, collective_devices: list[torch.device]) -> None:
    model = _model()
    state = torch_powersgd.PowerSGDState(_FakeGroup(), start_powerSGD_iter=2)
    hook = PowerSGDHook(state, "powersgd", {id(p): n for n, p in model.named_parameters()}, False, False)
    for _ in range(3):
        hook.run(_Bucket(model, "meta")).wait()  # type: ignore[arg-type]
    for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
        memory[0] = torch.zeros(memory[0].shape)  # as if built on the CPU
    collective_devices.clear()
    hook.run(_Bucket(model, "meta")).wait()  # type: ignore[arg-type]
    assert set(collective_devices) == {torch.device("meta")}
    assert all(m[0].device.type == "meta" for m in (state.error_dict, state.p_memory_dict, state.q_memory_dict))


@pytest.mark.gpu
def test_powersgd_trains_a_cuda_model_on_nccl(tmp_path) -> None:
    """One process on NCCL: torch's asynchronous hook, state on the GPU, every collective on CUDA tensors."""
    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    initialized_here = not dist.is_initialized()
    if initialized_here:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    elif "nccl" not in str(dist.get_backend()) or dist.get_world_size() != 1:
        pytest.skip(f"an earlier test left a {dist.get_backend()} group of {dist.get_world_size()} up here")
    try:
        torch.manual_seed(0)
        model = _model().cuda()
        ddp = DistributedDataParallel(model, device_ids=[0])
        hook = register_powersgd_hook(ddp, start_powerSGD_iter=2)
        assert not hook.synchronous  # NCCL keeps the asynchronous hook
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in _batches(5):
            ddp(x.cuda()).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        stats = hook.take_stats()
        assert stats.compression_rate > 1
        held = [*hook.state.error_dict.values(), *hook.state.q_memory_dict.values()]
        assert held and all(t.is_cuda for t in held)
        state = _roundtrip(gather_state_dict(hook))
        resumed = register_powersgd_hook(DistributedDataParallel(copy.deepcopy(model), device_ids=[0]))
        assert resumed.load_state_dict(state) == []
    finally:
        if initialized_here:
            dist.destroy_process_group()
