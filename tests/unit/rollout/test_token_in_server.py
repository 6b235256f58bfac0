"""The HTTP server under ``rlkit serve`` and the verifiers endpoint queues many connections at once."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler

from rlkit.rollout.token_in import ConcurrentHTTPServer


class _Hello(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet
        pass

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")


def test_connections_past_five_wait_for_a_busy_server_thread_and_are_answered():
    """While the server thread accepts nothing (as when generation holds it up), 64 clients connect at
    once: the kernel queues them all (http.server's default backlog of 5 dropped the sixth on; verifiers'
    episodes then failed with "Connection error."), and each gets its answer once the server runs."""
    server = ConcurrentHTTPServer(("127.0.0.1", 0), _Hello)
    clients: list[socket.socket] = []
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    try:
        for i in range(64):
            client = socket.create_connection(server.server_address, timeout=0.5)
            clients.append(client)
            client.sendall(f"GET /{i} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        serving.start()
        for client in clients:
            client.settimeout(10)
            assert client.recv(64).startswith(b"HTTP/1.1 200")
    finally:
        for client in clients:
            client.close()
        if serving.is_alive():
            server.shutdown()
        server.server_close()
