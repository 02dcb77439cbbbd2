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
