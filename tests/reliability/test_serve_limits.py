"""`rlkit serve` is bounded: ``n`` and ``max_new_tokens`` over the limits get HTTP 400 naming the limit,
weights load only from folders of safetensors (at start and in /update_weights_from_disk), and a non-loopback
host needs ``--allow-remote``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
from rlkit_harness import rlkit_env

from rlkit.cli.server import MAX_N, MAX_NEW_TOKENS, ProtocolModel, ServeError, check_host, make_server


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def server(assets):
    import torch

    torch.set_num_threads(1)
    model = ProtocolModel(str(assets[0]), max_n=2, max_new_tokens=4)
    httpd = make_server(model, "127.0.0.1", 0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_defaults_are_bounded():
    assert (MAX_N, MAX_NEW_TOKENS) == (64, 4096)


def test_requests_over_the_bounds_get_400_naming_the_limit(server):
    ok, body = post(
        f"{server}/generate", {"input_ids": [1, 2, 3], "sampling_params": {"n": 2, "max_new_tokens": 4}}
    )
    assert ok == 200 and len(body) == 2
    code, body = post(
        f"{server}/generate", {"input_ids": [1, 2, 3], "sampling_params": {"n": 3, "max_new_tokens": 2}}
    )
    assert (
        code == 400
        and body["error"]["message"] == "n=3 is over this server's limit of 2 (rlkit serve --max-n)"
    )
    code, body = post(
        f"{server}/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1_000_000}}
    )
    assert (
        code == 400 and "max_new_tokens=1000000 is over this server's limit of 4" in body["error"]["message"]
    )


def test_weights_load_only_from_safetensors_folders(server, assets, tmp_path):
    pickled = tmp_path / "pickled"
    shutil.copytree(assets[0], pickled, ignore=shutil.ignore_patterns("*.safetensors"))
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    code, body = post(f"{server}/update_weights_from_disk", {"model_path": str(pickled)})
    assert (
        code == 400
        and "has no *.safetensors weights (it holds pytorch_model.bin: pickle files"
        in body["error"]["message"]
    )
    code, body = post(
        f"{server}/update_weights_from_disk", {"model_path": str(pickled / "pytorch_model.bin")}
    )
    assert code == 400 and "config.json" in body["error"]["message"]  # a file is no model folder
    ok, body = post(f"{server}/update_weights_from_disk", {"model_path": str(assets[0])})
    assert ok == 200 and body["success"]
    with pytest.raises(ServeError, match="has no \\*.safetensors weights"):
        ProtocolModel(str(pickled))


def test_a_non_loopback_host_needs_allow_remote():
    for host in ("127.0.0.1", "localhost", "::1"):
        check_host(host, allow_remote=False)
    with pytest.raises(ServeError, match="--host 0.0.0.0 is not a loopback address .* add --allow-remote"):
        check_host("0.0.0.0", allow_remote=False)
    check_host("0.0.0.0", allow_remote=True)


def test_the_cli_flags_reach_the_server(assets):
    """`rlkit serve --max-n 1 --max-new-tokens 3 --port 0`: a real server process applies both limits."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlkit",
            "serve",
            str(assets[0]),
            "--port",
            "0",
            "--max-n",
            "1",
            "--max-new-tokens",
            "3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=rlkit_env(),
    )
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, (line, proc.poll())
        url = line.strip().rsplit(" ", 1)[-1]
        code, body = post(f"{url}/generate", {"input_ids": [1, 2], "sampling_params": {"n": 2}})
        assert code == 400 and "limit of 1 (rlkit serve --max-n)" in body["error"]["message"]
        code, body = post(f"{url}/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}})
        assert code == 400 and "limit of 3 (rlkit serve --max-new-tokens)" in body["error"]["message"]
    finally:
        proc.kill()
        proc.wait()
    remote = subprocess.run(
        [sys.executable, "-m", "rlkit", "serve", str(assets[0]), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        env=rlkit_env(),
        timeout=120,
    )
    assert remote.returncode == 1 and remote.stderr.startswith(
        "error: --host 0.0.0.0 is not a loopback address"
    )
