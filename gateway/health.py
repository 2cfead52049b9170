"""One deployment's health: failures put it into cooldown; a half-open probe must pass before traffic returns.

healthy --(max_fails consecutive failures)--> cooldown --(time passes)--> half_open --(probe ok)--> healthy
                                                 ^---------------------(probe fails)---------------'
Each cooldown in a row lasts twice the one before (up to max_cooldown_s); a request served well resets that.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

HEALTHY, COOLDOWN, HALF_OPEN = "healthy", "cooldown", "half_open"


@dataclass
class Health:
    max_fails: int = 1  # consecutive failures (requests or probes) before a cooldown
    cooldown_s: float = 5.0
    max_cooldown_s: float = 60.0
    state: str = HEALTHY
    fails: int = 0
    cooldowns: int = 0  # cooldowns in a row, for the back-off
    until: float = 0.0  # end of the current cooldown (monotonic seconds)
    last_error: str = ""

    def available(self) -> bool:
        """May get traffic: only when healthy (a cooled-down deployment waits for its probe)."""
        return self.state == HEALTHY

    def due_for_probe(self, now: float) -> bool:
        if self.state == COOLDOWN and now >= self.until:
            self.state = HALF_OPEN
        return self.state == HALF_OPEN

    def retry_after(self, now: float) -> int:
        """Whole seconds until this deployment may serve again (at least 1)."""
        return max(1, math.ceil(self.until - now)) if self.state == COOLDOWN else 1

    def on_success(self) -> None:
        self.state, self.fails, self.cooldowns = HEALTHY, 0, 0

    def on_probe_ok(self) -> None:
        """A probe passed: traffic returns; the back-off is kept until a real request succeeds."""
        if self.state != HEALTHY:
            self.state, self.fails = HEALTHY, 0

    def on_failure(self, now: float, error: str) -> None:
        self.last_error = error
        if self.state == COOLDOWN:
            return  # requests that were already in flight when it went down do not extend the cooldown
        self.fails += 1
        if self.state == HALF_OPEN or self.fails >= self.max_fails:
            self.until = now + min(self.max_cooldown_s, self.cooldown_s * 2 ** self.cooldowns)
            self.state, self.fails = COOLDOWN, 0
            self.cooldowns += 1
