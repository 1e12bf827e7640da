"""CPU use of processes on this machine, read from /proc: the load tester's own (every process of it) and a
local server's (a process and its descendants: its workers, its engine process).

A load tester busy near its capacity measures itself, not the server: perf_analyzer warns when its own CPU
passes 80%, and so does scoremap-loadtest (`client_bound`). Its capacity is one core per sending process (each
process's Python work holds one interpreter lock), never more than the cores it may run on. Busy counts the time
its threads ran *or waited to run* (/proc/PID/task/TID/schedstat): on a machine whose cores are shared, a load
tester that gets little CPU cannot keep up either, though its CPU time alone says it was idle.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable

__all__ = ["cpu_seconds", "busy_seconds", "tree_cpu_seconds", "usable_cores", "capacity_cores"]

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PROC = pathlib.Path("/proc")


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (the state is field 0 here), or None when it has ended."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of these processes, every thread of each (/proc/PID/stat fields 14 and 15);
    a process that has ended counts 0. Our own process is read with os.times, which is finer than clock ticks."""
    total = 0.0
    for pid in pids:
        if pid == os.getpid():
            times = os.times()
            total += times.user + times.system
        elif (fields := _stat(pid)) is not None:
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return total


def busy_seconds(pids: Iterable[int]) -> float | None:
    """Seconds the threads of these processes ran or waited on a run queue (the first two fields of
    /proc/PID/task/TID/schedstat, in ns), or None where the kernel does not keep them."""
    total, found = 0.0, False
    for pid in pids:
        for path in (PROC / str(pid) / "task").glob("*/schedstat"):
            try:
                ran, waited = path.read_text().split()[:2]
            except (OSError, ValueError):  # the thread ended meanwhile
                continue
            total += (int(ran) + int(waited)) / 1e9
            found = True
    return total if found else None


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` and its live descendants (a server's worker and engine
    processes), all their threads."""
    parents: dict[int, int] = {}
    for path in PROC.glob("[0-9]*/stat"):
        if (fields := _stat(int(path.parent.name))) is not None:
            parents[int(path.parent.name)] = int(fields[1])
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    tree = [pid]
    for member in tree:  # grows as it goes: breadth first
        tree.extend(children.get(member, ()))
    return cpu_seconds(tree)


def usable_cores() -> int:
    """The cores this process may run on (its affinity: `taskset` and cgroups' cpusets narrow it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def capacity_cores(processes: int, *, cores: int | None = None) -> int:
    """What `processes` sending processes can use: one core each, no more than the cores they may run on."""
    return max(1, min(processes, usable_cores() if cores is None else cores))
