"""Start N processes of one command on this machine as one JAX multi-process run.

    python scripts/launch_multihost.py -n 2 -- jaxdec generate --mesh data=2 -p "Hello" --no-stream
    python scripts/launch_multihost.py -n 2 --local-devices 2 -- python my_script.py

Each process gets JAXDEC_COORDINATOR (localhost and a free port), JAXDEC_NUM_PROCESSES and
JAXDEC_PROCESS_ID; `jaxdec` (and any script that calls
`jaxdec.sharding.initialize_from_env()`) then joins the run through
`jax.distributed.initialize`, and XLA's CPU collectives (gloo) connect the processes.
Each process offers `--local-devices` CPU devices. Process 0's stdout is printed; every
process's stderr is printed with a prefix. The exit status is the first non-zero one (or
1 on a timeout, after killing the rest).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from jaxdec.serve.server import free_port


def launch(command: list[str], n: int, local_devices: int = 1, timeout: float = 600.0) -> int:
    port = free_port("localhost")
    procs, outs = [], []
    for rank in range(n):
        env = dict(os.environ, JAXDEC_COORDINATOR=f"localhost:{port}",
                   JAXDEC_NUM_PROCESSES=str(n), JAXDEC_PROCESS_ID=str(rank),
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={local_devices}")
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=err))
        outs.append((out, err))
    deadline, codes = time.monotonic() + timeout, [None] * n
    while any(c is None for c in codes) and time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            break  # one failed: the others would wait for it forever
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
    codes = [p.wait() for p in procs]
    for rank, (out, err) in enumerate(outs):
        out.seek(0)
        err.seek(0)
        if rank == 0:  # (less gloo's connection notices, which it writes to stdout)
            sys.stdout.writelines(l for l in out.read().splitlines(True) if not l.startswith("[Gloo]"))
        for line in err.read().splitlines():
            print(f"[process {rank}] {line}", file=sys.stderr)
    if any(c is None or c < 0 for c in codes) and time.monotonic() >= deadline:
        print(f"launch_multihost: timed out after {timeout:.0f} s", file=sys.stderr)
        return 1
    return next((c for c in codes if c), 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--processes", type=int, default=2)
    p.add_argument("--local-devices", type=int, default=1, help="CPU devices per process")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.processes < 1 or args.local_devices < 1:
        p.error("give a positive -n, --local-devices and a command after --")
    return launch(command, args.processes, args.local_devices, args.timeout)


if __name__ == "__main__":
    raise SystemExit(main())
