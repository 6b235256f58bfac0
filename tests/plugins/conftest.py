"""Fixtures for plugin tests: a tiny model folder, and `rlkit serve` on it (in a thread, per module)."""

from __future__ import annotations

import threading

import pytest


@pytest.fixture(scope="module")
def serve_thread(tiny_model_dir):
    """`rlkit serve` (its ProtocolModel and HTTP server) on a free localhost port, in this process."""
    import torch

    from rlkit.cli.server import ProtocolModel, make_server

    torch.set_num_threads(1)
    model = ProtocolModel(str(tiny_model_dir), seed=0)
    server = make_server(model, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", model
    finally:
        server.shutdown()
        server.server_close()
