"""Several training processes on this machine, each with its own emulated CPU devices:

    python -m hla_jax.launch --processes=2 --devices_per_process=2 -- \\
        --config=configs/lm.py:size=tiny --workdir=runs/mp --config.mesh.fsdp=4

runs ``python -m hla_jax.main`` with the flags after ``--`` in ``--processes`` processes, each
with ``--devices_per_process`` CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count``)
and ``--config.mesh.multihost=True`` pointed at a coordinator on ``127.0.0.1``: one mesh spans all
processes, each loads only its own rows of every global batch, collectives go through gloo. This
is a multi-host run on one machine (to test one, or to check a config before a cluster); on a
real cluster run ``hla_jax.main`` itself on every host with ``--config.mesh.multihost=True``.
When one process fails the others are stopped; the exit status is the first failure's.
"""

import os
import signal
import socket
import subprocess
import sys
import time

from absl import app, flags

_PROCESSES = flags.DEFINE_integer("processes", 2, "Processes to start (>= 1).")
_DEVICES = flags.DEFINE_integer("devices_per_process", 1, "Emulated CPU devices per process (>= 1).")
_PORT = flags.DEFINE_integer("port", 0, "Coordinator port on 127.0.0.1 (0 = a free one).")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(devices_per_process: int, env=None) -> dict:
    """``env`` (default ``os.environ``) for a CPU process with ``devices_per_process`` emulated
    devices (added to the caller's ``XLA_FLAGS``)."""
    env = dict(os.environ if env is None else env)
    env["XLA_FLAGS"] = " ".join(filter(None, (
        env.get("XLA_FLAGS"), f"--xla_force_host_platform_device_count={devices_per_process}")))
    env["JAX_PLATFORMS"] = "cpu"
    return env


def main_commands(args, processes: int, port: int) -> list[list[str]]:
    """``python -m hla_jax.main *args`` for each process id, with the multi-process mesh flags."""
    return [[sys.executable, "-m", "hla_jax.main", *args, "--config.mesh.multihost=True",
             f"--config.mesh.coordinator=127.0.0.1:{port}",
             f"--config.mesh.num_processes={processes}", f"--config.mesh.process_id={i}"]
            for i in range(processes)]


def run_all(commands, env, timeout: float | None = None) -> int:
    """Start every command, wait for all; on the first failure (or ``timeout`` seconds) stop the
    others (SIGTERM, then SIGKILL after 10 s). Returns 0 or the first non-zero exit status
    (-signal for a process killed by a signal, 124 on timeout)."""
    procs = [subprocess.Popen(cmd, env=env) for cmd in commands]
    deadline = None if timeout is None else time.monotonic() + timeout
    status = 0
    try:
        while status == 0 and any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed:
                status = failed[0]
            elif deadline is not None and time.monotonic() > deadline:
                status = 124
            else:
                time.sleep(0.05)
        if status == 0:
            status = next((p.returncode for p in procs if p.returncode), 0)
    finally:
        stop(procs)
    return status


def stop(procs, grace: float = 10.0):
    """SIGTERM the running ``procs``, SIGKILL those still running after ``grace`` seconds."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(end - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv):
    if _PROCESSES.value < 1 or _DEVICES.value < 1:
        print(f"--processes and --devices_per_process must be >= 1, got {_PROCESSES.value}, "
              f"{_DEVICES.value}", file=sys.stderr)
        sys.exit(1)
    port = _PORT.value or free_port()
    commands = main_commands(argv[1:], _PROCESSES.value, port)
    sys.exit(run_all(commands, cpu_env(_DEVICES.value)))


if __name__ == "__main__":
    app.run(main)
