"""A hand-written loop samples memory and gets the leak verdict with MemorySteps: no Trainer, a scripted probe."""

from __future__ import annotations

import torch

from lightning_perf.profiling import MemorySample
from lightning_perf.profiling.memory_steps import MemorySteps, leak_message, summary_lines


class ScriptedProbe:
    """Memory in use grows by ``leak`` bytes at each step's end; every reading is a tick of its clock."""

    device, source = torch.device("cpu"), "cpu-mallinfo2"

    def __init__(self, leak: int) -> None:
        self.leak, self.bytes, self.ns = leak, 1 << 20, 0

    def allocated(self) -> int:
        return self.bytes

    def sample(self) -> MemorySample:
        self.ns += 1000
        return MemorySample("cpu", self.bytes, 2 * self.bytes, 3 * self.bytes, self.ns, self.source, True)

    def reset_peak(self) -> None:
        pass


def run(leak: int, steps: int) -> tuple[MemorySteps, list[int], list[str]]:
    probe = ScriptedProbe(leak)
    memory = MemorySteps(probe, every_n_steps=10, warmup_steps=20)  # type: ignore[arg-type]
    checked, messages = [], []
    for step in range(steps):
        memory.begin_step(epoch=0)
        memory.sample("after_forward")
        memory.sample("after_backward", overwrite=True)
        probe.bytes += leak
        memory.end_step(epoch=0, end_ns=(step + 1) * 1_000_000)
        if memory.leak_check_due():
            checked.append(memory.step_index)
            found = memory.check_leaks(every_point=False)
            messages += [leak_message("loop", found)] if found else []
    memory.check_leaks()
    return memory, checked, messages


def test_a_steady_leak_is_reported_once_and_the_every_step_readings_stop() -> None:
    memory, checked, messages = run(leak=4096, steps=120)
    assert checked == [50] and len(messages) == 1 and "grows by 4 KiB/step" in messages[0]
    report = memory.summary()
    assert (report["steps_seen"], report["steps_sampled"]) == (120, 12)
    assert report["leaks"]["leaking"] == ["after_data", "after_forward", "after_backward", "after_optimizer"]
    assert (report["leaks"]["first_step"], report["leaks"]["stopped_at_step"]) == (20, 50)
    assert report["snapshots"]["after_optimizer"]["time_s"]["median"] == 3e-6  # three readings after "after_data"
    assert "leak: memory in use grows at" in summary_lines(report)[1]


def test_flat_memory_is_not_a_leak_and_the_verdict_is_renewed_on_a_schedule() -> None:
    memory, checked, messages = run(leak=0, steps=160)
    assert checked == [50, 100, 150] and messages == []  # then every quarter of the steps so far, at least 50
    report = memory.summary()
    assert report["leaks"]["leaking"] == [] and report["leaks"]["stopped_at_step"] is None
    assert report["peak_above_start"]["median"] == 1 << 20  # CPU: the peak (3 MiB) above the resident set (2 MiB)
    assert report["overhead"]["step_s_mean"] == 1e-3
