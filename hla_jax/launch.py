"""Several training processes on this machine, each with its own emulated CPU devices:

    python -m hla_jax.launch --processes=2 --devices_per_process=2 -- \\
        --config=configs/lm.py:size=tiny --workdir=runs/mp --config.mesh.fsdp=4

runs ``python -m hla_jax.main`` with the flags after ``--`` in ``--processes`` processes, each
with ``--devices_per_process`` CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count``)
and ``--config.mesh.multihost=True`` pointed at a coordinator that listens on ``127.0.0.1``
only (``mesh.coordinator_bind``): one mesh spans all processes, each loads only its own rows of
every global batch, collectives go through gloo. This is a multi-host run on one machine (to
test one, or to check a config before a cluster); on a real cluster run ``hla_jax.main`` itself
on every host with ``--config.mesh.multihost=True``. Every process is watched: when any one
exits with a non-zero status the others are stopped (SIGTERM, SIGKILL 3 s later) and the
launcher exits with that status (128 + the signal for a process killed by one, as a shell
reports it).
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
             f"--config.mesh.coordinator_bind=127.0.0.1:{port}",
             f"--config.mesh.num_processes={processes}", f"--config.mesh.process_id={i}"]
            for i in range(processes)]


def run_all(commands, env, timeout: float | None = None) -> int:
    """Start every command and watch them all: the first one to exit with a non-zero status (or
    ``timeout`` seconds) stops the others (``stop``: SIGTERM, then SIGKILL 3 s later).
    Returns 0 when all exit 0, else the first failure's status (-signal for a process killed by a
    signal, 124 on timeout)."""
    procs = [subprocess.Popen(cmd, env=env) for cmd in commands]
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            status = next((c for c in codes if c), 0)
            if status or None not in codes:
                break
            if deadline is not None and time.monotonic() > deadline:
                status = 124
                break
            time.sleep(0.05)
    finally:
        stop(procs)
    return status


def stop(procs, grace: float = 3.0):
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


def exit_status(status: int) -> int:
    """``run_all``'s status as a shell reports it: a process killed by signal ``s`` -> 128 + s."""
    return 128 - status if status < 0 else status


def main(argv):
    if _PROCESSES.value < 1 or _DEVICES.value < 1:
        print(f"--processes and --devices_per_process must be >= 1, got {_PROCESSES.value}, "
              f"{_DEVICES.value}", file=sys.stderr)
        sys.exit(1)
    port = _PORT.value or free_port()
    commands = main_commands(argv[1:], _PROCESSES.value, port)
    sys.exit(exit_status(run_all(commands, cpu_env(_DEVICES.value))))


if __name__ == "__main__":
    app.run(main)
