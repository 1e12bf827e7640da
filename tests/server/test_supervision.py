"""A supervised child whose supervisor ended stops, and exits with its threads' stacks logged if its drain hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

ORPHAN = textwrap.dedent("""
    import os, subprocess, threading, time
    from server.supervision import end_with
    supervisor = subprocess.Popen(["sleep", "600"])
    stop = threading.Event()
    threading.Thread(target=end_with, args=(os.pidfd_open(supervisor.pid), stop, 1.0), daemon=True).start()
    print(supervisor.pid, flush=True)
    stop.wait()
    print("stopping", flush=True)
    while True:
        time.sleep(0.1)  # a drain that never ends
""")


def test_an_orphan_whose_drain_hangs_logs_every_stack_and_exits():
    child = subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=os.getcwd())
    try:
        supervisor = int(child.stdout.readline())
        assert child.poll() is None  # nothing happens while the supervisor runs
        os.kill(supervisor, signal.SIGKILL)
        assert child.stdout.readline() == "stopping\n"
        assert child.wait(30) == 1
        log = child.stderr.read()
        assert "the supervisor ended: stopping, at the latest in 1 s" in log
        assert "Timeout (0:00:01)!" in log  # faulthandler's header, then each thread's frames
        assert 'File "<string>", line 11 in <module>' in log, log  # the hung loop's `time.sleep`
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
