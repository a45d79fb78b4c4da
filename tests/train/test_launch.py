"""``hla_jax.launch``: every process is watched (a death of any one stops the others within 5 s
and becomes the launcher's status), the localhost coordinator listens on 127.0.0.1 only, and
``mesh.coordinator_bind`` / ``mesh.mtls`` reach ``jax.distributed.initialize``."""

import ipaddress
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import ml_collections
import pytest
from helpers import ROOT, tiny_lm_flags, write_docs

from hla_jax import launch
from hla_jax.train import base_config, sharding

PROCESSES = 3


def _sleepers(tmp_path, commands: dict) -> list[list[str]]:
    """``PROCESSES`` shell processes that write their pid to ``tmp_path/<i>.pid`` and run
    ``commands[i]`` (default: sleep 30)."""
    return [["sh", "-c", f"echo $$ > {tmp_path}/{i}.pid; {commands.get(i, 'exec sleep 30')}"]
            for i in range(PROCESSES)]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("index", range(PROCESSES))
def test_a_killed_process_stops_the_others(tmp_path, index):
    """SIGKILL of process ``index`` (any one, not only the first) is the status of ``run_all``
    and ends the others, SIGTERM-ignoring ones included, within 5 s."""
    commands = _sleepers(tmp_path, {index: "sleep 0.3; kill -KILL $$",
                                    (index + 1) % PROCESSES: "trap '' TERM; sleep 30"})
    start = time.monotonic()
    assert launch.run_all(commands, dict(os.environ)) == -signal.SIGKILL
    assert time.monotonic() - start < 5
    pids = [int((tmp_path / f"{i}.pid").read_text()) for i in range(PROCESSES)]
    assert all(_gone(p) for p in pids)


@pytest.mark.parametrize("index", range(PROCESSES))
def test_a_failing_process_is_the_status(tmp_path, index):
    commands = _sleepers(tmp_path, {index: "exit 3"})
    start = time.monotonic()
    assert launch.run_all(commands, dict(os.environ)) == 3
    assert time.monotonic() - start < 5


def test_all_succeed_and_timeout(tmp_path):
    assert launch.run_all(_sleepers(tmp_path, dict.fromkeys(range(PROCESSES), "exit 0")),
                          dict(os.environ)) == 0
    assert launch.run_all(_sleepers(tmp_path, {}), dict(os.environ), timeout=0.2) == 124
    assert (launch.exit_status(-signal.SIGKILL), launch.exit_status(3)) == (137, 3)


def _address(hex_address: str) -> str:
    """An address as /proc/net/tcp{,6} write it (32-bit words in host order) -> its text; an
    IPv4-mapped IPv6 address as IPv4."""
    raw = b"".join(int(hex_address[i:i + 8], 16).to_bytes(4, sys.byteorder)
                   for i in range(0, len(hex_address), 8))
    address = ipaddress.ip_address(raw)
    return str(getattr(address, "ipv4_mapped", None) or address)


def _listening(port: int) -> list[str]:
    """The local addresses of the sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            local, _, state = line.split()[1:4]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.append(_address(address))
    return found


def _child(parent: int, marker: str, deadline: float) -> int:
    """The pid of the child of ``parent`` whose command line contains ``marker``."""
    while time.monotonic() < deadline:
        for pid in pathlib.Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    return int(pid)
        time.sleep(0.05)
    raise AssertionError(f"no child of {parent} runs {marker}")


def test_real_run_binds_loopback_and_stops_on_a_killed_process(tmp_path):
    """``python -m hla_jax.launch`` of 2 training processes: the coordinator listens on
    127.0.0.1 only; SIGKILL of process 1 ends the launcher within 5 s with status 128 + 9."""
    port = launch.free_port()
    docs = write_docs(tmp_path / "docs")
    cmd = [sys.executable, "-m", "hla_jax.launch", "--processes=2", f"--port={port}", "--",
           *tiny_lm_flags(docs, 10_000), f"--workdir={tmp_path / 'run'}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while not _listening(port) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _listening(port) == ["127.0.0.1"], proc.poll() and proc.stderr.read()[-2000:]
        os.kill(_child(proc.pid, "--config.mesh.process_id=1", deadline), signal.SIGKILL)
        killed = time.monotonic()
        assert proc.wait(30) == 128 + signal.SIGKILL
        assert time.monotonic() - killed < 5
    finally:
        proc.kill()
        proc.wait()


def _certificates(directory: pathlib.Path):
    """A CA (``ca.pem``) and a certificate for 127.0.0.1 / localhost that it signed
    (``host.pem``, ``host.key``), made with the openssl command."""
    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "1", "-subj", "/CN=hla_jax test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "host.key", "-out", "host.csr",
            "-subj", "/CN=localhost")
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "host.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "host.pem", "-days", "1", "-extfile", "san.cnf")


def test_mtls_coordinator_serves_only_certified_peers(tmp_path):
    """Two processes with ``mesh.mtls``: they connect and exchange data; the coordinator answers
    a TLS client with the CA's certificate and hangs up on one without (tests/mtls_check.py)."""
    _certificates(tmp_path)
    port = launch.free_port()
    commands = [[sys.executable, str(ROOT / "tests" / "mtls_check.py"), str(i), str(port),
                 str(tmp_path)] for i in range(2)]
    assert launch.run_all(commands, launch.cpu_env(1), timeout=120) == 0


def _mesh(**over):
    c = base_config().mesh
    c.update_from_flattened_dict({"multihost": True, "coordinator": "10.0.0.1:1234",
                                  "num_processes": 2, "process_id": 0, **over})
    return c


def test_bind_address_and_mtls_reach_jax(tmp_path, monkeypatch):
    for name in ("cert", "key", "ca"):
        (tmp_path / f"{name}.pem").write_text("PEM")
    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    sharding.maybe_initialize_distributed(_mesh(**{
        "coordinator_bind": "10.0.0.1:1234", "mtls.cert_file": str(tmp_path / "cert.pem"),
        "mtls.key_file": str(tmp_path / "key.pem"), "mtls.ca_file": str(tmp_path / "ca.pem"),
        "mtls.peer_uri_prefix": "spiffe://cluster/", "mtls.required": True}))
    sharding.maybe_initialize_distributed(_mesh())
    assert calls == [(("10.0.0.1:1234", 2, 0), {
        "coordinator_bind_address": "10.0.0.1:1234", "mtls_cert_file": str(tmp_path / "cert.pem"),
        "mtls_key_file": str(tmp_path / "key.pem"), "mtls_ca_file": str(tmp_path / "ca.pem"),
        "mtls_peer_uri_prefix": "spiffe://cluster/", "verify_secure_credentials": True}),
        (("10.0.0.1:1234", 2, 0), {"coordinator_bind_address": None})]


@pytest.mark.parametrize("over, message", [
    ({"mtls.cert_file": "c.pem"}, "mesh.mtls: give cert_file, key_file and ca_file together, "
                                  "got only cert_file"),
    ({"mtls.cert_file": "c.pem", "mtls.key_file": "k.pem", "mtls.ca_file": "nowhere.pem"},
     "mesh.mtls.ca_file: nowhere.pem does not exist"),
    ({"mtls.required": True}, "mesh.mtls.required=True needs cert_file, key_file and ca_file"),
])
def test_bad_mtls_settings(tmp_path, monkeypatch, over, message):
    monkeypatch.chdir(tmp_path)
    for name in ("c.pem", "k.pem"):
        (tmp_path / name).write_text("PEM")
    with pytest.raises(ValueError) as e:
        sharding.mtls_arguments(ml_collections.ConfigDict(_mesh(**over).mtls))
    assert str(e.value) == message
