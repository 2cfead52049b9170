"""One deployment's health: failures put it into cooldown; a half-open probe must pass before traffic returns.

healthy --(max_fails consecutive failures)--> cooldown --(time passes)--> half_open --(probe ok)--> healthy
                                                 ^---------------------(probe fails)---------------'

The first cooldown lasts `cooldown_s`; the router probes the deployment as soon as it ends. While probes fail,
the wait before the next one doubles (2, 4, 8 ... times cooldown_s, up to max_cooldown_s) but never exceeds
`probe_interval_s` (the router's health_check_interval): a deployment that recovers gets traffic again within
one interval, however long it was down. A passing probe ends the back-off (the next failure starts again at
cooldown_s), as does a request served well.
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
    probe_interval_s: float = math.inf  # the longest wait between probes of a failing deployment
    state: str = HEALTHY
    fails: int = 0
    cooldowns: int = 0  # cooldowns in a row since the last passing probe or good request, for the back-off
    until: float = 0.0  # end of the current cooldown: when the next probe is due (monotonic seconds)
    last_error: str = ""

    def available(self) -> bool:
        """May get traffic: only when healthy (a cooled-down deployment waits for its probe)."""
        return self.state == HEALTHY

    def due_for_probe(self, now: float) -> bool:
        """Whether a probe should run now (a cooldown that has ended turns into half_open)."""
        if self.state == COOLDOWN and now >= self.until:
            self.state = HALF_OPEN
        return self.state == HALF_OPEN

    def retry_after(self, now: float) -> int:
        """Whole seconds until this deployment may serve again (at least 1)."""
        return max(1, math.ceil(self.until - now)) if self.state == COOLDOWN else 1

    def on_success(self) -> None:
        """A request was served well: healthy, and the back-off starts over."""
        self.state, self.fails, self.cooldowns = HEALTHY, 0, 0

    def on_probe_ok(self) -> None:
        """A probe passed: traffic returns at once, and the back-off starts over."""
        if self.state != HEALTHY:
            self.state, self.fails, self.cooldowns = HEALTHY, 0, 0

    def on_failure(self, now: float, error: str) -> None:
        """A request or a probe failed: count it; at max_fails in a row, or on a failed half-open probe, start a
        cooldown (see the module's docstring for how long). Failures during a cooldown (requests that were in
        flight when it went down) change nothing but `last_error`."""
        self.last_error = error
        if self.state == COOLDOWN:
            return
        self.fails += 1
        if self.state == HALF_OPEN:  # its probe failed: back off, but probe again within probe_interval_s
            wait = min(self.cooldown_s * 2 ** self.cooldowns, self.max_cooldown_s, self.probe_interval_s)
        elif self.fails >= self.max_fails:
            wait = min(self.cooldown_s, self.max_cooldown_s)
        else:
            return
        self.until = now + wait
        self.state, self.fails = COOLDOWN, 0
        self.cooldowns += 1
