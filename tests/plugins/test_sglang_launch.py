"""The sglang backend's launch machinery without SGLang: the command line per device, the memory-release
decision and its errors, and the server process group (guard, death detection, kill) with `rlkit serve`
standing in for the server. The same paths against real SGLang: tests/engines/test_sglang_real.py."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("rlkit_sglang", reason="pip install -e plugins/rlkit-sglang")

from rlkit_sglang import SglangClient, SglangServerError  # noqa: E402
from rlkit_sglang.launch import (  # noqa: E402
    GUARD,
    LocalServer,
    PortTakenError,
    _ephemeral_range,
    _free_port,
    server_command,
    start_on_a_free_port,
)
from rlkit_sglang.params import SglangLaunchParams, SglangParams  # noqa: E402


def _resolve(component):
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe.compose import resolve

    return resolve("rollout.backend", "rollout_backends", component, build_registries())


def test_cpu_command_has_the_cpu_flags_and_no_memory_saver():
    params = SglangLaunchParams(python="/opt/sglang/bin/python", threads=2, max_total_tokens=4096)
    cmd, env = server_command(params, "/models/m", "cpu", 31000)
    assert cmd[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    joined = " ".join(cmd)
    for flag in (
        "--device cpu",
        "--attention-backend torch_native",
        "--disable-overlap-schedule",
        "--sleep-on-idle",
        "--dtype float32",
        "--max-total-tokens 4096",
        "--context-length 1024",
        "--port 31000",
    ):
        assert flag in joined
    assert "--enable-memory-saver" not in cmd and "--mem-fraction-static" not in cmd
    assert env == {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "2"}
    cuda, cuda_env = server_command(SglangLaunchParams(), "/models/m", "cuda", 31000)
    assert (
        cuda[0] == sys.executable and "--enable-memory-saver" in cuda and "--dtype bfloat16" in " ".join(cuda)
    )
    assert cuda_env == {} and "--device" not in cuda
    off, _ = server_command(SglangLaunchParams(enable_memory_saver=False), "/models/m", "cuda", 31000)
    assert "--enable-memory-saver" not in off


def test_memory_release_on_cpu_is_refused_at_validation():
    for component, match in (
        ({"name": "sglang", "launch": {"device": "cpu", "enable_memory_saver": True}}, "CUDA-only"),
        (
            {"name": "sglang", "memory_release": True, "launch": {"device": "cpu"}},
            "memory_release=true.*CUDA-only",
        ),
    ):
        _, problems = _resolve(component)
        assert problems and any(re.search(match, str(p)) for p in problems), problems
    resolved, problems = _resolve({"name": "sglang", "launch": {"device": "cpu"}})
    assert not problems and resolved.params.memory_release is None


def test_memory_saver_asked_for_a_cpu_worker_is_refused_at_start(tmp_path):
    from rlkit_sglang.backend import SglangRollout

    from rlkit.errors import RlkitError
    from rlkit.recipe.schema import RolloutConfig

    params = SglangParams(model_path=str(tmp_path), launch={"enable_memory_saver": True})  # device auto
    with pytest.raises(RlkitError, match="enable_memory_saver=true, but the servers run on cpu"):
        SglangRollout(
            tokenizer=None, rollout_config=RolloutConfig(), max_response_length=4, device="cpu", params=params
        )


def test_memory_release_follows_what_the_server_reports(serve_thread):
    from rlkit.recipe.schema import RolloutConfig
    from rlkit.testing.rollout import chat_prompts

    url, model = serve_thread  # rlkit serve reports no server info: release is off unless asked for
    built, problems = _resolve({"name": "sglang", "urls": [url]})
    backend = built.build(tokenizer=model.tokenizer, rollout_config=RolloutConfig(), max_response_length=4)
    assert backend.memory_release is False
    backend.release_memory()  # a no-op: rlkit serve would refuse /generate after a real release
    assert backend.generate(chat_prompts(model.tokenizer))["responses"].shape[1] == 4
    asked, _ = _resolve({"name": "sglang", "urls": [url], "memory_release": True})
    backend = asked.build(tokenizer=model.tokenizer, rollout_config=RolloutConfig(), max_response_length=4)
    assert backend.memory_release is True
    backend.release_memory()
    with pytest.raises(SglangServerError, match="resume_memory_occupation"):
        backend.generate(chat_prompts(model.tokenizer))
    backend.resume_memory()
    assert backend.generate(chat_prompts(model.tokenizer))["responses"].shape[1] == 4


def test_a_server_that_exits_at_start_is_an_error_with_its_log(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('no CUDA here', flush=True); sys.exit(3)"]
    start = time.monotonic()
    with pytest.raises(SglangServerError, match=r"exited \(code 3.*no CUDA here"):
        LocalServer(
            cmd,
            {},
            host="127.0.0.1",
            port=_free_port(),
            log_path=str(tmp_path / "s.log"),
            startup_timeout_s=60,
        )
    assert time.monotonic() - start < 30  # not the startup timeout


# A server that is healthy and never answers /generate (a hung engine): only the liveness watch can end the
# wait.
HUNG_SERVER = """
import http.server, sys, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def do_POST(self):
        time.sleep(600)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_launched_server_killed_mid_request_raises_at_once_and_stops_by_group(tmp_path):
    port = _free_port()
    server = LocalServer(
        [sys.executable, "-c", HUNG_SERVER, str(port)],
        {},
        host="127.0.0.1",
        port=port,
        log_path=str(tmp_path / "s.log"),
        startup_timeout_s=60,
    )
    try:
        # no answer for 600 s
        client = SglangClient(server.url, retries=5, backoff_s=5.0, watch=server.problem)
        assert client.health() and server.problem() is None
        killer = threading.Timer(0.5, os.killpg, (server.proc.pid, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        with pytest.raises(SglangServerError, match="exited") as err:
            client.generate([[1, 2, 3]], {"max_new_tokens": 8})
        assert server.url in str(err.value) and "/generate" in str(err.value)
        assert time.monotonic() - start < 20
    finally:
        server.stop()
    assert server.proc.poll() is not None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_guard_ends_the_server_when_its_launcher_dies():
    launcher = (
        "import os, subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, {GUARD!r}, str(os.getpid()), sys.executable, '-c', "
        "'import time; time.sleep(300)'], start_new_session=True)\n"
        "print(p.pid, flush=True)\ntime.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    guard = int(proc.stdout.readline())
    time.sleep(1.0)
    children = [int(c) for c in open(f"/proc/{guard}/task/{guard}/children").read().split()]
    assert _alive(guard) and children and all(_alive(c) for c in children)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (_alive(guard) or any(_alive(c) for c in children)):
        time.sleep(0.2)
    assert not _alive(guard) and not any(_alive(c) for c in children)


def test_server_dies_with_a_killed_guard():
    """Ray SIGKILLs what a stopped worker leaves behind, the guard included: the server must not survive
    it."""
    guard = subprocess.Popen(
        [sys.executable, GUARD, str(os.getpid()), sys.executable, "-c", "import time; time.sleep(300)"],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        children: list[int] = []
        while not children and time.monotonic() < deadline:
            children = [int(c) for c in open(f"/proc/{guard.pid}/task/{guard.pid}/children").read().split()]
            time.sleep(0.1)
        assert children and _alive(children[0])
        guard.kill()
        guard.wait()
        while _alive(children[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(children[0])
    finally:
        try:  # a failed run leaves the sleeper in the group
            os.killpg(guard.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_launch_ports_leave_room_for_sglangs_derived_grpc_port_and_miss_the_ephemeral_range():
    """SGLang refuses to start when --port + 10000 (its gRPC port) is above 65535: seen with an OS-chosen
    58691. A port in the kernel's ephemeral range can be taken by an outgoing connection before the server
    binds it (CI lost a run to it)."""
    ports = [_free_port() for _ in range(200)]
    assert all(10000 <= p <= 55535 for p in ports), ports
    low, high = _ephemeral_range()
    assert not [p for p in ports if low <= p <= high or low <= p + 10000 <= high]


# SGLang when its port is taken: uvicorn logs the failed bind, and SGLang's warmup thread keeps the process
# alive ~120 s before it ends it.
PORT_CHECKING_SERVER = """# rlkit-port-checking-stand-in
import http.server, sys, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
try:
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
except OSError as err:
    print("ERROR:", err, flush=True)
    time.sleep(600)
server.serve_forever()
"""


class _PortThief:
    """Takes each port it is shown the way an outgoing connection does: a connected socket bound to it."""

    def __init__(self, times: int):
        self.times = times
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.taken: list[socket.socket] = []

    def __call__(self, port: int) -> tuple[list[str], dict]:
        if len(self.taken) < self.times:
            client = socket.socket()
            client.bind(("127.0.0.1", port))
            client.connect(self.listener.getsockname())
            self.taken.append(client)
        return [sys.executable, "-c", PORT_CHECKING_SERVER, str(port)], {}

    def close(self):
        for s in (*self.taken, self.listener):
            s.close()


def test_a_server_whose_port_was_taken_starts_again_on_another_at_once(tmp_path):
    thief = _PortThief(times=1)
    start = time.monotonic()
    try:
        server = start_on_a_free_port(
            thief, host="127.0.0.1", log_dir=tmp_path, startup_timeout_s=120, separate_python=False
        )
        try:
            assert SglangClient(server.url, retries=0).health()
            lost = thief.taken[0].getsockname()[1]
            assert server.url != f"http://127.0.0.1:{lost}"
            assert "address already in use" in (tmp_path / f"sglang-{lost}.log").read_text().lower()
        finally:
            server.stop()
    finally:
        thief.close()
    assert time.monotonic() - start < 60  # not SGLang's ~120 s linger


def test_a_port_taken_at_every_attempt_is_an_error_that_says_so(tmp_path):
    thief = _PortThief(times=3)
    try:
        with pytest.raises(PortTakenError, match="3 ports tried"):
            start_on_a_free_port(
                thief, host="127.0.0.1", log_dir=tmp_path, startup_timeout_s=120, separate_python=False
            )
    finally:
        thief.close()
    assert len(thief.taken) == 3
    assert not subprocess.run(["pgrep", "-f", "rlkit-port-checking-stand-in"], capture_output=True).stdout
