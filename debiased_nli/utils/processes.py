"""Work in forked processes without doubling the build's memory.

A forked process shares the build's memory page by page until one side writes to a page, which is then
copied: both keep a copy, and the build's memory (the sum over its processes, PSS) grows by it. The
build forks its z-filtering walks and its z-statistics while holding gigabytes (the rows' text, the
feature matrices), so it keeps those copies few:

* before forking, freed memory goes back to the system (:func:`return_free_memory`): later allocations
  then get fresh pages instead of reusing pages a child still shares;
* while children run, the garbage collector leaves the objects that existed at the fork alone
  (:func:`freeze_gc`): a full collection writes to every container object it visits, in the child and
  in the parent, which copies every page holding one;
* the children read numpy arrays, whose data have no reference counts, and few Python objects.
"""
from __future__ import annotations

import gc
import multiprocessing
import os


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def return_free_memory() -> None:
    """Give freed memory back to the system: glibc's heap (it keeps freed blocks of up to 32 MB, most of a
    stage's numpy temporaries, where they count in the process's memory until reused: about 560 MB after
    the features of 1.1M rows) and Arrow's memory pool. Where the C library is not glibc, Arrow's only."""
    import ctypes
    import ctypes.util

    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def freeze_gc() -> None:
    """Before forking: the objects that exist now are left out of garbage collections (in this process
    and in the children) until :func:`unfreeze_gc`."""
    gc.freeze()


def unfreeze_gc() -> None:
    """After the children are done: collect the frozen objects again, as before :func:`freeze_gc`."""
    gc.unfreeze()


# ------------------------------------------------------------------ processes stopped at a deadline

def start_logged(cmd, log_file, env=None, cwd=None):
    """``cmd`` in a process group of its own (so that :func:`stop_groups` reaches its children too), its output
    appended to ``log_file`` after a line naming the command and the time."""
    import subprocess
    import time
    from pathlib import Path

    log_file = Path(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a") as f:
        f.write(f"=== {time.strftime('%H:%M:%S')}: {' '.join(map(str, cmd))}\n")
        f.flush()
        return subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop_groups(*procs, grace: float = 8.0) -> None:
    """SIGTERM to the process group of each process still running, SIGKILL to those still there ``grace`` seconds
    later (each process was started with ``start_new_session=True``)."""
    import signal
    import time

    for sig in (signal.SIGTERM, signal.SIGKILL):
        running = [p for p in procs if p.poll() is None]
        for p in running:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        t = time.monotonic() + grace
        while any(p.poll() is None for p in running) and time.monotonic() < t:
            time.sleep(0.2)


def wait_until(procs: dict, until: float, tick=None, every: float = 1.0) -> dict:
    """Wait for the processes ``{name: Popen}`` until ``until`` (``time.monotonic()``); those still running then
    are stopped (:func:`stop_groups`). ``tick()`` runs every ``every`` seconds. Returns each one's exit code (None:
    stopped at the deadline)."""
    import time

    while any(p.poll() is None for p in procs.values()) and time.monotonic() < until:
        if tick:
            tick()
        time.sleep(every)
    codes = {name: p.poll() for name, p in procs.items()}
    stop_groups(*procs.values())
    return codes
