"""Fixtures for plugin tests: a tiny model folder, and `rlkit serve` on it (in a thread, per module)."""

from __future__ import annotations

import os
import threading

import pytest


@pytest.fixture(scope="session")
def plugin_tiny_model_dir(tmp_path_factory):
    """A tiny Qwen2 causal LM (hidden 64, 2 layers) + local BPE tokenizer, built once per session."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rlkit.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("plugin_tiny_qwen2"), arch="qwen2", seed=0)


@pytest.fixture(scope="module")
def serve_thread(plugin_tiny_model_dir):
    """`rlkit serve` (its ProtocolModel and HTTP server) on a free localhost port, in this process."""
    import torch

    from rlkit.cli.server import ProtocolModel, make_server

    torch.set_num_threads(1)
    model = ProtocolModel(str(plugin_tiny_model_dir), seed=0)
    server = make_server(model, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", model
    finally:
        server.shutdown()
        server.server_close()
