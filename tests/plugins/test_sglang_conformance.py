"""The sglang backend (a third-party package) passes rlkit's rollout conformance kit against `rlkit serve`,
including the capabilities its spec declares (generate_ids, memory_release)."""

from __future__ import annotations

import pytest

pytest.importorskip("rlkit_sglang", reason="pip install -e plugins/rlkit-sglang")


def test_sglang_backend_passes_the_rollout_kit(serve_thread, tmp_path):
    from rlkit.plugin.manager import make_plugin_manager
    from rlkit.plugin.registry import build_registries
    from rlkit.testing import check_rollout_backend

    url, model = serve_thread
    registries = build_registries(make_plugin_manager())
    spec = registries.rollout_backends.get("sglang")
    assert spec.generate_ids and spec.memory_release  # so the kit checks both capabilities
    backend = check_rollout_backend(
        "sglang",
        model.rollout.module,
        model.tokenizer,
        registries=registries,
        urls=[url],
        weights_dir=str(tmp_path / "weights"),
    )
    assert backend.clients[0].url == url.rstrip("/")
