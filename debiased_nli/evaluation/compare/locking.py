"""Sharing a machine: the heavy lock held in turns, and claims that split the units between worker processes."""
from __future__ import annotations

import contextlib
import datetime as _dt
import os
import time
from pathlib import Path


def log(msg: str) -> None:
    print(f"[{_dt.datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


@contextlib.contextmanager
def heavy_lock(path: str | None, what: str):
    """Hold ``flock(path)`` for one short stage (the project's heavy lock)."""
    with LockTurns(path, None, what) as turns:
        turns.step()
        yield


class LockTurns:
    """The heavy lock held across the steps of one stage, given up between steps once it has been held
    for ``budget_s`` (at most ~20 minutes at a time on a shared machine), so other work interleaves;
    the stage then queues for it again. ``path=None``: no locking."""

    pause_s = 10.0

    def __init__(self, path: str | None, budget_s: float | None, what: str):
        self.path, self.budget, self.what = path, budget_s, what
        self.fh, self.since, self.turns = None, None, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def held_for(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since

    def remaining(self) -> float | None:
        return None if self.budget is None else max(0.0, self.budget - self.held_for())

    def step(self) -> None:
        """Before a step: take the lock, or give it up and queue again if this turn is over."""
        if not self.path:
            return
        if self.fh is not None and self.budget is not None and self.held_for() >= self.budget:
            self.release()
            time.sleep(self.pause_s)  # let a waiting process take it before we queue again
        if self.fh is None:
            import fcntl

            from ...utils.outputs import open_lock_file

            # opened without following a link at the lock's path (open_lock_file); named by its path
            self.fh = open(self.path, "a", opener=lambda path, flags: open_lock_file(path))
            log(f"{self.what}: waiting for {self.path}")
            t0 = time.time()
            fcntl.flock(self.fh, fcntl.LOCK_EX)
            self.since, self.turns = time.monotonic(), self.turns + 1
            log(f"{self.what}: lock acquired after {time.time() - t0:.0f}s (turn {self.turns})")

    def release(self) -> None:
        if self.fh is not None:
            import fcntl

            fcntl.flock(self.fh, fcntl.LOCK_UN)
            self.fh.close()
            self.fh, self.since = None, None
            log(f"{self.what}: lock released")


def claim(claims: Path, row: str, seed: int) -> bool:
    """Take the unit for this process (``O_CREAT | O_EXCL``: of several processes sharing ``claims``,
    exactly one gets each unit). A claim is never released: a unit whose process died is run again by
    a later ``run`` with a fresh claims folder (it resumes from its checkpoint)."""
    claims.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(claims / f"{row}-s{seed}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()} {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}\n")
    return True
