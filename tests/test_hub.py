"""The class's JupyterHub (cluster/hub/jupyterhub_config.py, utils/hub.py).

The unit tests hold the share policy to hand-counted assignments. The slow test starts the real hub
(JupyterHub, configurable-http-proxy, the idle culler) from the repository's config, with
SimpleLocalProcessSpawner and DummyAuthenticator in place of local accounts and PAM, and a fake pool
of two GPUs: two students' servers get different shares (read from the spawned processes'
/proc/PID/environ), notebook 00 runs in one of them through its kernel and prints that student's
share, the idle one is culled by the culler, and its share goes to the next student.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from utils import authoring, device, hub

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "cluster" / "hub" / "jupyterhub_config.py"


# ---- the share policy, against assignments counted by hand


def test_whole_gpus_one_each_then_the_pool_is_full():
    pool = hub.SharePool(["0", "1"])
    a, b = pool.take("ada/"), pool.take("ben/")
    assert (a.visible, b.visible) == ("0", "1")
    assert pool.take("ada/") == a  # a server asking again keeps its share
    with pytest.raises(hub.PoolFull, match="all 2 shares"):
        pool.take("cy/")
    pool.release("ada/")
    assert pool.take("cy/").visible == "0"  # the freed slot, not a new one
    pool.release("nobody/")


def test_shared_gpus_fill_every_gpu_before_doubling_up():
    # 3 GPUs, 2 students each: slots 0..5 on GPUs 0 1 2 0 1 2
    got = [hub.gpu_share(s, ["0", "1", "2"], per_gpu=2).visible for s in range(6)]
    assert got == ["0", "1", "2", "0", "1", "2"]
    assert hub.slot_count(["0", "1", "2"], per_gpu=2) == 6
    assert "shared with 1 other student" in hub.gpu_share(0, ["0"], per_gpu=2).line
    assert "up to 3 other students" in hub.gpu_share(0, ["0"], per_gpu=4).line


def test_several_whole_gpus_per_student():
    pool = ["0", "1", "2", "3", "4"]
    assert hub.slot_count(pool, gpus_per_user=2) == 2  # GPU 4 is left over
    assert [hub.gpu_share(s, pool, gpus_per_user=2).visible for s in range(2)] == ["0,1", "2,3"]
    assert "cuda:0, cuda:1" in hub.gpu_share(1, pool, gpus_per_user=2).line


def test_mig_slices_are_one_per_student_and_the_line_says_slice():
    pool = ["MIG-aaaa", "MIG-bbbb"]
    assert hub.gpu_share(1, pool).visible == "MIG-bbbb" and "MIG slice MIG-bbbb" in hub.gpu_share(1, pool).line
    with pytest.raises(ValueError, match="one MIG slice"):
        hub.slot_count(pool, gpus_per_user=2)


def test_bad_policies_and_pools_are_refused():
    with pytest.raises(ValueError, match="not both"):
        hub.slot_count(["0", "1"], per_gpu=2, gpus_per_user=2)
    with pytest.raises(ValueError, match="at least 1"):
        hub.slot_count(["0"], per_gpu=0)
    with pytest.raises(ValueError, match="twice"):
        hub.parse_pool("0,1,0")
    assert hub.parse_pool(" 0, 1,,2 ") == ["0", "1", "2"] and hub.parse_pool("") == []


def test_an_empty_pool_runs_every_server_on_the_cpu():
    pool = hub.SharePool([])
    shares = [pool.take(f"s{i}/") for i in range(5)]
    assert all(s.visible == "" and s.slot is None for s in shares)
    assert hub.spawn_environment(shares[0]) == {"CUDA_VISIBLE_DEVICES": "", "LAB_GPU_SHARE": shares[0].line}


def test_the_environment_holds_the_share_and_threads_for_a_cpu_limit():
    share = hub.gpu_share(1, ["0", "1"])
    env = hub.spawn_environment(share, cpu_limit=4.5)
    assert env == {"CUDA_VISIBLE_DEVICES": "1", "LAB_GPU_SHARE": share.line, "OMP_NUM_THREADS": "4"}
    assert hub.spawn_environment(share, cpu_limit=0.5)["OMP_NUM_THREADS"] == "1"


def test_notebook_00s_hardware_lines_show_the_share_only_when_there_is_one():
    info = {"cpu": "x", "cpu_cores": 2, "torch_threads": 2, "python": "3", "torch": "2", "cuda": None, "cudnn": None}
    info |= {"gpus": [], "driver": None}
    assert "share" not in device.hardware_summary(info | {"gpu_share": None})
    line = hub.gpu_share(0, ["3"]).line
    assert device.hardware_summary(info | {"gpu_share": line}).splitlines()[-1] == f"share  {line}"


def test_the_course_is_copied_once_without_the_environment(tmp_path):
    course = tmp_path / "release"
    (course / "notebooks").mkdir(parents=True)
    (course / "notebooks" / "00.ipynb").write_text("{}")
    (course / ".venv" / "bin").mkdir(parents=True)
    home = tmp_path / "home" / "ada"
    dest = hub.copy_course(course, home)
    assert dest == home / hub.COURSE_FOLDER and (dest / "notebooks" / "00.ipynb").read_text() == "{}"
    assert not (dest / ".venv").exists()
    (dest / "notebooks" / "00.ipynb").write_text("the student's work")
    assert hub.copy_course(course, home) is None
    assert (dest / "notebooks" / "00.ipynb").read_text() == "the student's work"
    (course / "solutions").mkdir()
    with pytest.raises(ValueError, match="solutions/"):
        hub.copy_course(course, tmp_path / "home" / "ben")


def _python_for(uid: int) -> str | None:
    """An interpreter (3.10+) that the account ``uid`` can run: this one, else the system's."""
    for python in (sys.executable, "/usr/bin/python3"):
        probe = ["-c", "import sys; assert sys.version_info >= (3, 10)"]
        try:
            subprocess.run([python, *probe], user=uid, group=uid, extra_groups=[], capture_output=True, check=True)
        except (OSError, subprocess.CalledProcessError):
            continue
        return python
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="copying as another account needs root")
def test_the_course_is_copied_as_the_student_whatever_they_put_in_their_home(tmp_path, monkeypatch):
    uid = 4321
    if (python := _python_for(uid)) is None:
        pytest.skip("no Python here that another account may run (this one lives in a private folder)")
    monkeypatch.setattr(sys, "executable", python)  # copy_course_as starts the copy with sys.executable
    base = Path(tempfile.mkdtemp(prefix="hub-copy-"))
    try:
        base.chmod(0o755)
        course, victim, home = base / "release", base / "victim", base / "home"
        (course / "labs").mkdir(parents=True)
        (course / "labs" / "lab0.ipynb").write_text("{}")
        victim.mkdir()
        home.mkdir()
        os.chown(home, uid, uid)
        # the student points the copy's working folder at a folder of root's
        (home / f".{hub.COURSE_FOLDER}.partial").symlink_to(victim)
        dest = hub.copy_course_as((uid, uid), course, home)
        assert list(victim.iterdir()) == []
        assert (dest / "labs" / "lab0.ipynb").read_text() == "{}"
        for p in [dest, *dest.rglob("*")]:
            assert (p.lstat().st_uid, p.lstat().st_gid) == (uid, uid), p
        # a home the student cannot write in: the hub says where and why it failed
        os.chown(home, 0, 0)
        with pytest.raises(RuntimeError, match="as uid 4321 failed: PermissionError"):
            hub.copy_course_as((uid, uid), course, base / "home" / "sub")
    finally:
        shutil.rmtree(base)


# ---- the real hub


def _proxy() -> str | None:
    made = Path(sys.prefix) / "hub-proxy" / "node_modules" / ".bin" / "configurable-http-proxy"
    return str(made) if made.exists() else shutil.which("configurable-http-proxy")


def _missing() -> str | None:
    for mod in ("jupyterhub", "jupyterhub_idle_culler"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed: make .venv/.installed-test (the [hub] extras)"
    if not shutil.which("node"):
        return "node is not installed: the hub's proxy, configurable-http-proxy, runs on node"
    if not _proxy():
        return "configurable-http-proxy is not installed: make hub-proxy (npm)"
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Hub:
    """Talks to a running hub's REST API and its users' servers with the test's admin token."""

    def __init__(self, url: str, token: str):
        self.url, self.token = url, token

    def api(self, method: str, path: str, body: dict | None = None, base: str = "/hub/api") -> dict | list | None:
        req = urllib.request.Request(
            f"{self.url}{base}{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read()
        return json.loads(text) if text else None

    def server(self, user: str) -> dict | None:
        return self.api("GET", f"/users/{user}")["servers"].get("")

    def run_cells(self, user: str, path: str, cells: list[str], timeout: float) -> list[str]:
        """Each cell's printed text, run in a new kernel of ``user``'s server (cwd ``path``), through
        the server's REST API and kernel websocket, as JupyterLab runs them."""
        kernel = self.api("POST", "/api/kernels", {"name": "python3", "path": path}, base=f"/user/{user}")
        try:
            return asyncio.run(self._execute(user, kernel["id"], cells, time.monotonic() + timeout))
        finally:
            self.api("DELETE", f"/api/kernels/{kernel['id']}", base=f"/user/{user}")

    async def _execute(self, user: str, kernel: str, cells: list[str], deadline: float) -> list[str]:
        from tornado.httpclient import HTTPRequest
        from tornado.websocket import websocket_connect

        url = f"{self.url.replace('http', 'ws', 1)}/user/{user}/api/kernels/{kernel}/channels"
        ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {self.token}"}))
        session, printed = uuid.uuid4().hex, []
        try:
            for code in cells:
                msg_id = uuid.uuid4().hex
                header = {"msg_id": msg_id, "session": session, "username": user, "msg_type": "execute_request"}
                content = {"code": code, "silent": False, "store_history": True, "user_expressions": {}}
                msg = {"header": header | {"version": "5.3"}, "parent_header": {}, "metadata": {}, "channel": "shell"}
                ws.write_message(json.dumps(msg | {"content": content | {"allow_stdin": False}, "buffers": []}))
                text, idle, replied = [], False, False
                while not (idle and replied):
                    raw = await asyncio.wait_for(ws.read_message(), max(0.1, deadline - time.monotonic()))
                    assert raw is not None, "the kernel's websocket closed"
                    if isinstance(raw, bytes):  # a message with binary buffers: no text to read
                        continue
                    m = json.loads(raw)
                    if m["parent_header"].get("msg_id") != msg_id:
                        continue
                    kind = m["header"]["msg_type"]
                    if kind == "error":
                        raise AssertionError(
                            f"a cell failed:\n{code}\n{m['content']['ename']}: {m['content']['evalue']}"
                        )
                    text += [m["content"]["text"]] if kind == "stream" else []
                    idle = idle or (kind == "status" and m["content"]["execution_state"] == "idle")
                    replied = replied or kind == "execute_reply"
                printed.append("".join(text))
        finally:
            ws.close()
        return printed


def _wait(what: str, cond, timeout: float, log: Path):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if got := cond():
            return got
        time.sleep(1)
    raise AssertionError(f"{what}: not within {timeout:.0f} s; the hub's log ends:\n{log.read_text()[-4000:]}")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


TEST_CONFIG = """
load_subconfig({main!r})
c.JupyterHub.bind_url = "http://127.0.0.1:{port}"
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{api_port}"
c.ConfigurableHTTPProxy.command = [{proxy!r}]
c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allow_all = True
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = {homes!r}
c.Spawner.args = {args!r}
c.Spawner.environment = {{"LAB_PROFILE": "smoke", "JUPYTERHUB_ACTIVITY_INTERVAL": "5"}}
c.JupyterHub.last_activity_interval = 5
c.JupyterHub.services.append({{"name": "test", "api_token": {token!r}}})
c.JupyterHub.load_roles.append(
    {{"name": "test", "scopes": ["admin:users", "admin:servers", "access:servers"], "services": ["test"]}}
)
"""

CULL_IDLE_S = 20


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_students_get_different_gpus_notebook_00_runs_and_an_idle_server_is_culled(tmp_path):
    if reason := _missing():
        pytest.skip(reason)
    release = tmp_path / "release"
    authoring.release(release)
    port, hub_port, api_port = _free_ports(3)
    token = secrets.token_hex(16)
    config = tmp_path / "test_config.py"
    config.write_text(
        TEST_CONFIG.format(
            main=str(CONFIG),
            port=port,
            hub_port=hub_port,
            api_port=api_port,
            proxy=_proxy(),
            homes=str(tmp_path / "home" / "{username}"),
            args=["--allow-root"] if os.geteuid() == 0 else [],
            token=token,
        )
    )
    env = os.environ | {
        "HUB_GPU_POOL": "0,1",
        "HUB_COURSE": str(release),
        "HUB_STATE": str(tmp_path / "state"),
        "HUB_CULL_IDLE_S": str(CULL_IDLE_S),
        "HUB_CULL_EVERY_S": "5",
        "HUB_MEM_LIMIT": "2G",
        "HUB_CPU_LIMIT": "1",
    }
    log = tmp_path / "hub.log"
    hub_api, pids = Hub(f"http://127.0.0.1:{port}", token), []
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(config)],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def up():
            try:
                return hub_api.api("GET", "/") is not None
            except (urllib.error.URLError, ConnectionError):
                return False

        _wait("the hub answers", up, 60, log)
        hub_api.api("POST", "/users", {"usernames": ["ada", "ben", "cy"]})

        def ready(user):
            return lambda: (s := hub_api.server(user)) and s["ready"] and s

        # Two students log in at once.
        with ThreadPoolExecutor(2) as pool:  # the hub answers a start request when the server is up
            list(pool.map(lambda u: hub_api.api("POST", f"/users/{u}/server"), ("ada", "ben")))
        servers = {u: _wait(f"{u}'s server is ready", ready(u), 90, log) for u in ("ada", "ben")}
        pids = [servers[u]["state"]["pid"] for u in ("ada", "ben")]
        envs = {u: _environ(servers[u]["state"]["pid"]) for u in ("ada", "ben")}
        gpus = {u: envs[u]["CUDA_VISIBLE_DEVICES"] for u in envs}
        assert sorted(gpus.values()) == ["0", "1"], gpus
        for u, e in envs.items():
            assert e["LAB_GPU_SHARE"] == f"the server's GPU {gpus[u]}, yours alone; your programs see it as cuda:0"
            # the limits reach the server, which LocalProcessSpawner does not enforce
            assert (e["MEM_LIMIT"], e["CPU_LIMIT"], e["OMP_NUM_THREADS"]) == (str(2 * 2**30), "1.0", "1")
            course = tmp_path / "home" / u / hub.COURSE_FOLDER
            assert (course / "notebooks" / "00_environment.ipynb").exists() and not (course / "solutions").exists()

        # A third student while both GPUs are in use: the hub says so, and starts nothing.
        with pytest.raises(urllib.error.HTTPError) as refused:
            hub_api.api("POST", "/users/cy/server")
        assert "all 2 shares of this server's GPUs are in use" in json.loads(refused.value.read())["message"]
        assert not (tmp_path / "home" / "cy").exists()

        # Notebook 00 in ada's server, through its kernel: the setup cell prints her share.
        nb = json.loads(
            (tmp_path / "home" / "ada" / hub.COURSE_FOLDER / "notebooks" / "00_environment.ipynb").read_text()
        )
        cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
        printed = hub_api.run_cells("ada", f"{hub.COURSE_FOLDER}/notebooks", cells, timeout=150)
        assert any(f"share  {envs['ada']['LAB_GPU_SHARE']}" in p for p in printed), printed

        # ben did nothing: the culler stops his server, and his GPU goes to the next student.
        _wait("ben's idle server is culled", lambda: hub_api.server("ben") is None, CULL_IDLE_S + 60, log)
        assert "Culling server ben" in log.read_text()
        _wait("ben's server process ends", lambda: _gone(pids[1]), 30, log)
        hub_api.api("POST", "/users/cy/server")
        pids.append(_wait("cy's server is ready", ready("cy"), 90, log)["state"]["pid"])
        assert _environ(pids[-1])["CUDA_VISIBLE_DEVICES"] == gpus["ben"]
    finally:
        proc.send_signal(signal.SIGTERM)  # the hub stops its servers and its proxy
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        proxy_pid = tmp_path / "state" / "jupyterhub-proxy.pid"
        for pid in pids + ([int(proxy_pid.read_text())] if proxy_pid.exists() else []):
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
