"""The pipeline's health as the engine process sees it: serving, healing after a lost stage, or
unavailable. The executor changes it; the scheduler waits on it, so that requests that have not
started yet are held while the cluster re-plans instead of being sent to stages that are gone.

One object per engine, handed from the executor to the scheduler through vLLM's config (the only
thing both are built from), under CONTROL_KEY of `additional_config`, the platform's own slot.
"""

import logging
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("vllm.metal_cluster.control")

CONTROL_KEY = "metal_cluster_control"
MAX_EVENTS = 20


@dataclass
class PlanView:
    """What the scheduler needs of the current plan."""

    generation: int  # +1 per plan: the scheduler resets its prefix cache when this changes
    state: str  # serving | healing | unavailable
    capacity_blocks: int | None  # KV blocks the stages hold now; None: all of vLLM's
    outage_id: int = 0


@dataclass
class Event:
    time: float
    message: str


@dataclass
class ClusterControl:
    generation: int = 0
    state: str = "serving"
    reason: str = ""
    capacity_blocks: int | None = None
    outage_id: int = 0  # the outage now (or last) being healed
    stage_losses: int = 0
    replans: int = 0
    # Requests running when a stage was lost: held for the next plan (for up to resume_timeout_s),
    # then resumed on it or, when it cannot take them, ended with a retryable error.
    resume_timeout_s: float = 120.0
    requests_held: int = 0  # now
    requests_resumed: int = 0
    requests_lost: int = 0
    events: list[Event] = field(default_factory=list)
    # The last re-plan's phases in seconds (probe, restart, place, load, start, ...), for `status`.
    last_replan: dict[str, float] = field(default_factory=dict)
    changed: threading.Condition = field(default_factory=threading.Condition)
    # A re-plan the operator asked for lets running requests finish first: the scheduler starts no
    # new ones while `draining`, and sets `drained` once nothing runs.
    draining: bool = False
    drained: threading.Event = field(default_factory=threading.Event)

    def begin_drain(self) -> bool:
        with self.changed:
            if self.state == "healing" or self.draining:
                return False
            self.draining = True
            self.drained.clear()
            self._note("draining: running requests finish, new ones wait, then the cluster re-plans")
            return True

    def wait_drain_over(self) -> None:
        """Until the re-plan that the drain prepares has begun (bounded by the drain's timeout)."""
        with self.changed:
            self.changed.wait_for(lambda: not self.draining)

    def begin_outage(self, reason: str) -> int | None:
        """Mark the pipeline broken; the outage id, or None when one is already being healed."""
        with self.changed:
            if self.state == "healing":
                return None
            self.state, self.reason = "healing", reason
            self.draining = False
            self.outage_id += 1
            self._note(reason)
            self.changed.notify_all()
            return self.outage_id

    def note_lost(self, reasons: list[str]) -> None:
        """The stages that did not answer when the re-plan looked: they are out of the next plan."""
        with self.changed:
            self.stage_losses += len(reasons)
            for reason in reasons:
                self._note(f"lost {reason}")

    def settle(self, state: str, message: str, capacity_blocks: int | None = None,
               seconds: dict[str, float] | None = None) -> None:
        """The end of a re-plan: serving on a new plan, or unavailable with the reason; `seconds`:
        where the re-plan's time went."""
        with self.changed:
            self.state = state
            self.last_replan = dict(seconds or {})
            self.reason = "" if state == "serving" else message
            if state == "serving":
                self.generation += 1
                self.replans += 1
                self.capacity_blocks = capacity_blocks
            self._note(message)
            self.changed.notify_all()

    def wait_settled(self, timeout: float | None = None) -> PlanView:
        """Blocks while the cluster heals, for at most `timeout` seconds (None: until it ends; healing
        ends by itself, every wait in it is bounded). The view's state says which came first."""
        with self.changed:
            self.changed.wait_for(lambda: self.state != "healing", timeout)
            return PlanView(self.generation, self.state, self.capacity_blocks, self.outage_id)

    def note_requests(self, held: int, resumed: int = 0, lost: int = 0) -> None:
        """The scheduler's count of requests held through an outage, and of how they came out of it."""
        with self.changed:
            if held != self.requests_held:
                log.info("cluster: requests held for the new plan: %d", held)
            self.requests_held = held
            self.requests_resumed += resumed
            self.requests_lost += lost

    def summary(self) -> dict:
        with self.changed:
            return {
                "state": self.state, "reason": self.reason, "replans": self.replans,
                "stage_losses": self.stage_losses, "requests_held": self.requests_held,
                "requests_resumed": self.requests_resumed, "requests_lost": self.requests_lost,
                "events": [{"time": e.time, "message": e.message} for e in self.events],
                "last_replan": dict(self.last_replan),
            }

    def note(self, message: str) -> None:
        with self.changed:
            self._note(message)

    def _note(self, message: str) -> None:
        self.events = (self.events + [Event(time.time(), message)])[-MAX_EVENTS:]
