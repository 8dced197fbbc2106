"""What dst shows while a method runs: a byte count for ours, "running" for a baseline."""

from __future__ import annotations

import sys
import threading
import time

# -- progress --------------------------------------------------------------------------------


class ProgressBar:
    """``[#####.....] 1.20/2.00 GB  0.85 GB/s`` on stderr: bytes dst received from the others
    (decimal units, like the rate); drawn only when stderr is a terminal.

    Redrawn whenever progress moves by 2% or 32 MiB (whichever is smaller) and at the end.
    """

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled = label, enabled
        self.start = time.perf_counter()
        self.drawn = -1

    def __call__(self, done: int, total: int) -> None:
        step = min(total * 0.02, 32 * 2**20)
        if not self.enabled or (self.drawn >= 0 and done - self.drawn < step and done < total):
            return
        self.drawn = done
        now = time.perf_counter()
        frac = done / total if total else 1.0
        rate = done / max(now - self.start, 1e-9) / 1e9
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r  {self.label:<34} [{bar:<30}] {done / 1e9:6.2f}/"
                         f"{total / 1e9:.2f} GB {rate:6.2f} GB/s")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


class Running:
    """``  bytes (torch gather_object) 2/4   running 1.3 s`` on stderr while a call without
    progress of its own (a baseline, raw gloo, the floor) runs: drawn when it starts, then
    redrawn from a thread every 0.2 s."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled = label, enabled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.perf_counter()
        while True:  # drawn at once (raw gloo and the floor take under 0.2 s), then redrawn
            sys.stderr.write(f"\r  {self.label:<34} running {time.perf_counter() - start:6.1f} s")
            sys.stderr.flush()
            if self._stop.wait(0.2):
                return

    def __enter__(self) -> Running:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join()
            sys.stderr.write("\r" + " " * 90 + "\r")
            sys.stderr.flush()
