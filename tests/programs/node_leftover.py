"""A command whose child outlives it (tests/test_sim_node.py).

Starts a Python child in a session of its own (so that killing the command's process group
misses it) that ignores SIGTERM and sleeps for ever; with `--sleep`, also a non-Python
`sleep` in its own process group. Waits until the child runs its code (it is then a process
of the node), writes `RESULT {json}` with the pids and the node's folder, and exits (with
`--stay`, sleeps for ever instead: the test kills it).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

folder = Path(sys.argv[1])
ready = folder / "child-ready"
CHILD = f"""
import os, pathlib, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
pathlib.Path({str(ready)!r}).write_text(str(os.getpid()))
while True:
    time.sleep(60)
"""
escaped = subprocess.Popen([sys.executable, "-c", CHILD], start_new_session=True)
sleeper = subprocess.Popen(["sleep", "600"]) if "--sleep" in sys.argv else None
deadline = time.monotonic() + 60
while not ready.exists():
    if time.monotonic() > deadline or escaped.poll() is not None:
        sys.exit(f"the child did not start (status {escaped.poll()})")
    time.sleep(0.05)
result = {
    "escaped": escaped.pid,
    "escaped_session": os.getsid(escaped.pid),
    "session": os.getsid(0),
    "sleep": sleeper.pid if sleeper else None,
    "node": os.environ.get("ACCEL_SIM_NODE"),
}
os.write(1, f"RESULT {json.dumps(result)}\n".encode())
while "--stay" in sys.argv:
    time.sleep(60)
