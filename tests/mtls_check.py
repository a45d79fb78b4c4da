"""One process of a 2-process run whose coordination service uses mutual TLS (started by
test_launch.py through ``hla_jax.launch.run_all``):

``python tests/mtls_check.py PROCESS_ID PORT TLS_DIR`` joins the run with ``mesh.mtls`` set to
``TLS_DIR``'s ``host.pem``, ``host.key`` and ``ca.pem`` (``mesh.mtls.required=True``). Process
0 then connects to its own coordinator: with the host certificate the service answers over
TLS, without one it closes the connection. Both processes exchange their ids through a
collective. Exits 1 on a mismatch.
"""

import socket
import ssl
import sys

import numpy as np
from jax.experimental import multihost_utils

from hla_jax.train import base_config, sharding


def answer(port: int, tls: str, client_cert: bool) -> int:
    """Bytes the coordinator sends back to an HTTP/2 preface over TLS (0: it hung up)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(f"{tls}/ca.pem")
    context.set_alpn_protocols(["h2"])
    if client_cert:
        context.load_cert_chain(f"{tls}/host.pem", f"{tls}/host.key")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as s:
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            try:
                return len(s.recv(100))
            except (ssl.SSLError, ConnectionResetError):  # the server refused the handshake
                return 0


def main(process_id: str, port: str, tls: str) -> int:
    mesh = base_config().mesh
    mesh.update_from_flattened_dict({
        "multihost": True, "coordinator": f"127.0.0.1:{port}",
        "coordinator_bind": f"127.0.0.1:{port}", "num_processes": 2,
        "process_id": int(process_id), "mtls.cert_file": f"{tls}/host.pem",
        "mtls.key_file": f"{tls}/host.key", "mtls.ca_file": f"{tls}/ca.pem",
        "mtls.required": True})
    sharding.maybe_initialize_distributed(mesh)
    ok = True
    if process_id == "0":
        with_cert, without = answer(int(port), tls, True), answer(int(port), tls, False)
        print(f"coordinator answers {with_cert} bytes with a certificate, {without} without")
        ok = with_cert > 0 and without == 0
    ids = multihost_utils.process_allgather(np.array([int(process_id)]))
    return int(not (ok and ids.ravel().tolist() == [0, 1]))


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
