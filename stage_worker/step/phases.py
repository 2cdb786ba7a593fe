"""Where a stage's steps go, part by part: each part's median over the last steps.

Health reports them (`step_phases`), so a pipeline's hop can be read off its stages: the wait for
the previous stage's hidden states, the ring send, building the step, the device's share, the
answer (bench/gpu_serving.py puts them beside the coordinator's round trip).
"""

import statistics
import time
from collections import deque

WINDOW = 64  # steps a median is taken over


class StepPhases:
    def __init__(self, window: int = WINDOW):
        self.window = window
        self._seconds: dict[str, deque[float]] = {}
        # The last step's clock at its start ("entered") and at the end of each part: on one host,
        # comparable with another process's (perf_counter is the system's monotonic clock there).
        self.last_marks: dict[str, float] = {}

    def add(self, part: str, seconds: float) -> None:
        self._seconds.setdefault(part, deque(maxlen=self.window)).append(seconds)

    def medians(self) -> dict[str, float]:
        return {part: statistics.median(s) for part, s in self._seconds.items() if s}

    def clear(self) -> None:
        self._seconds.clear()
        self.last_marks = {}

    def stopwatch(self) -> "Stopwatch":
        return Stopwatch(self)


class Stopwatch:
    """One step's parts in order: each mark's part is the time since the mark before it."""

    def __init__(self, phases: StepPhases):
        self.phases = phases
        self.last = time.perf_counter()
        self.marks = {"entered": self.last}
        phases.last_marks = self.marks

    def mark(self, part: str, at: float | None = None) -> None:
        now = time.perf_counter() if at is None else at
        self.phases.add(part, now - self.last)
        self.marks[part] = self.last = now

    def restart(self) -> None:
        self.last = time.perf_counter()
