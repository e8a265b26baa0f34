"""PID 1 of one simulated host of ``scripts/local_cluster.sh``.

Runs inside the host's own network and PID namespaces. It mounts a private tmpfs at
``--local-dir`` (storage only this host sees), starts the host's Ray node with the command
after ``--``, and then reaps every process that the namespace hands to it, as an init must.

- SIGKILL of this process (``local_cluster.sh kill-host``) is the host's loss: the kernel
  kills every process in its PID namespace at once.
- SIGTERM (``local_cluster.sh down``) stops the node cleanly: ``ray stop --force`` here
  sees only this namespace's processes, so it cannot touch any other Ray on the machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local-dir", required=True)
    p.add_argument("--ray", required=True, help="the ray executable")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args()
    if os.getpid() != 1:
        sys.exit("host_init.py must be PID 1 of its own PID namespace (unshare --pid --fork)")
    os.makedirs(args.local_dir, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", args.local_dir], check=True)

    def stop(*_):
        subprocess.run([args.ray, "stop", "--force"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    started = subprocess.run(command)
    if started.returncode != 0:
        sys.exit(f"host_init.py: {' '.join(command)} failed with {started.returncode}")
    print("ready", flush=True)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(0.5)


if __name__ == "__main__":
    main()
