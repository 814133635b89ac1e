"""Fresh-interpreter probes (what an import loads, in which order) started side by side instead of one by one."""

from __future__ import annotations

import subprocess
import sys


class Probes:
    """Probes, each a script in its own fresh interpreter, started side by side; :meth:`result` waits for one.

    An interpreter's start-up (importing torch and Lightning) is single-threaded: run side by side, the probes take
    about the time of the slowest one on a machine with several cores instead of the sum of them all.
    """

    def __init__(self) -> None:
        self._started: dict[str, subprocess.Popen[str]] = {}
        self._done: dict[str, subprocess.CompletedProcess[str]] = {}

    def start(self, scripts: dict[str, str]) -> None:
        for key, script in scripts.items():
            if key not in self._started:
                self._started[key] = subprocess.Popen(
                    [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )

    def result(self, key: str) -> subprocess.CompletedProcess[str]:
        if key not in self._done:
            process = self._started[key]
            try:
                stdout, stderr = process.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                process.kill()
                raise
            self._done[key] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        return self._done[key]

    def close(self) -> None:
        for process in self._started.values():
            if process.poll() is None:
                process.kill()
            process.communicate()
