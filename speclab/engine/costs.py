"""Step costs measured online: how the target's forward time grows with rows x tokens, and what a
draft step costs. The scheduler feeds every forward it times; policies read predictions.

A forward of n rows x T tokens is stored in a bucket (n rounded up to a power of two, T exact) as an
exponential moving average. A prediction for an unmeasured shape interpolates linearly in n*T between
the nearest measured shapes of the same row bucket, and otherwise scales the nearest bucket by the
token ratio (an honest guess, refined as soon as the shape is run).
"""

from __future__ import annotations

import threading


def row_bucket(n: int) -> int:
    return 1 << max(0, (max(1, n) - 1).bit_length())


class OnlineCosts:
    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self.target: dict[tuple[int, int], float] = {}  # (row bucket, tokens per row) -> seconds
        self.draft: dict[int, float] = {}  # row bucket -> seconds per draft step
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ recording
    def _ema(self, table: dict, key, seconds: float) -> None:
        old = table.get(key)
        table[key] = seconds if old is None else old + self.alpha * (seconds - old)

    def record_target(self, n: int, T: int, seconds: float) -> None:
        with self.lock:
            self._ema(self.target, (row_bucket(n), T), seconds)

    def record_draft(self, n: int, steps: int, seconds: float) -> None:
        if steps > 0:
            with self.lock:
                self._ema(self.draft, row_bucket(n), seconds / steps)

    # ------------------------------------------------------------------ predictions
    def target_time(self, n: int, T: int) -> float | None:
        """Seconds for a target forward of n rows x T tokens (None: nothing measured yet)."""
        with self.lock:
            if not self.target:
                return None
            nb = row_bucket(n)
            same = sorted((t, s) for (b, t), s in self.target.items() if b == nb)
            if not same:  # nearest measured row bucket, scaled by rows
                b = min({b for b, _ in self.target}, key=lambda b: abs(b - nb))
                same = sorted((t, s * nb / b) for (bb, t), s in self.target.items() if bb == b)
            for t, s in same:
                if t == T:
                    return s
            lo = [(t, s) for t, s in same if t < T]
            hi = [(t, s) for t, s in same if t > T]
            if lo and hi:
                (t0, s0), (t1, s1) = lo[-1], hi[0]
                return s0 + (s1 - s0) * (T - t0) / (t1 - t0)
            t0, s0 = (lo[-1] if lo else hi[0])
            if len(same) >= 2:  # extrapolate along the last two measured points
                (ta, sa), (tb, sb) = (same[-2], same[-1]) if lo else (same[0], same[1])
                slope = max((sb - sa) / (tb - ta), 0.0)
                return max(s0 + slope * (T - t0), 1e-7)
            return s0 * T / t0 if T > t0 else s0

    def draft_time(self, n: int) -> float | None:
        with self.lock:
            if not self.draft:
                return None
            nb = row_bucket(n)
            if nb in self.draft:
                return self.draft[nb]
            b = min(self.draft, key=lambda b: abs(b - nb))
            return self.draft[b] * (nb / b) ** 0.5  # draft steps grow sub-linearly with rows on few cores

    def snapshot(self) -> dict:
        with self.lock:
            return {"target": {f"{b}x{t}": s for (b, t), s in sorted(self.target.items())},
                    "draft": {str(b): s for b, s in sorted(self.draft.items())}}
