"""JupyterHub for the class: `make hub` starts it from a release folder (`make release DEST=...`).

Every student logs in with their local account (PAM) and gets their own single-user server,
started by LocalProcessSpawner as that account, on the release's .venv Python: one shared
environment, installed once and read-only to students. On each spawn the hub

* gives the server a GPU share from the pool (utils/hub.py): CUDA_VISIBLE_DEVICES, and the line
  notebook 00's setup cell prints (LAB_GPU_SHARE); the share is freed when the server stops;
* copies the course into ~/scaling-labs the first time (never over a student's copy);
* opens notebook 00.

The jupyterhub-idle-culler service stops servers idle for HUB_CULL_IDLE_S seconds.

The settings are environment variables, read here with their defaults (`make hub HUB_GPU_POOL=0,1`):

  HUB_GPU_POOL       CUDA_VISIBLE_DEVICES values to hand out, comma-separated: GPU indices or MIG
                     UUIDs (nvidia-smi -L); default every GPU nvidia-smi lists; empty: CPU only
  HUB_PER_GPU        students sharing each GPU (time-sliced, no memory protection); default 1
  HUB_GPUS_PER_USER  whole GPUs per student; default 1
  HUB_MEM_LIMIT      memory per student, e.g. 16G; HUB_CPU_LIMIT  cores per student, e.g. 4
                     (LocalProcessSpawner does not enforce either: see below)
  HUB_CULL_IDLE_S    stop a server idle this long; default 3600
  HUB_CULL_EVERY_S   how often the culler looks; default half of HUB_CULL_IDLE_S
  HUB_GROUP          the local group whose members may log in; default students
  HUB_ADMINS         comma-separated admin accounts (the instructors)
  HUB_COURSE         the folder copied into homes; default the release this file is in
  HUB_STATE          the hub's database and cookie secret; default .venv/hub-state (mode 700)

Limits: LocalProcessSpawner passes mem_limit and cpu_limit to the server as MEM_LIMIT and CPU_LIMIT
and enforces neither; here a CPU limit also sets OMP_NUM_THREADS (torch's threads). To enforce
them, use jupyterhub-systemdspawner (cgroups through systemd) or DockerSpawner:
`make hub HUB_ARGS=--JupyterHub.spawner_class=systemdspawner.SystemdSpawner`. GPU memory is never
capped by either; whole GPUs or MIG slices are the only protection.
"""

import os
import pwd
import sys
from pathlib import Path

COURSE_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(COURSE_ROOT))
from utils import hub  # noqa: E402  (after the path: the hub may run before the course is installed)

c = get_config()  # noqa: F821  (JupyterHub defines it in a config file)
env = os.environ

POOL = hub.parse_pool(env["HUB_GPU_POOL"]) if "HUB_GPU_POOL" in env else hub.detect_pool()
SHARES = hub.SharePool(POOL, int(env.get("HUB_PER_GPU", 1)), int(env.get("HUB_GPUS_PER_USER", 1)))
COURSE = Path(env.get("HUB_COURSE", COURSE_ROOT))
CULL_IDLE_S = int(env.get("HUB_CULL_IDLE_S", 3600))
CULL_EVERY_S = int(env.get("HUB_CULL_EVERY_S", max(1, CULL_IDLE_S // 2)))
STATE = Path(env.get("HUB_STATE", Path(sys.prefix) / "hub-state"))
STATE.mkdir(mode=0o700, parents=True, exist_ok=True)

# The hub's own files, out of the folder students get a copy of.
c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.ConfigurableHTTPProxy.pid_file = str(STATE / "jupyterhub-proxy.pid")
proxy = Path(sys.prefix) / "hub-proxy" / "node_modules" / ".bin" / "configurable-http-proxy"  # make hub's npm install
if proxy.exists():
    c.ConfigurableHTTPProxy.command = [str(proxy)]

# Who may log in: local accounts in HUB_GROUP (PAM, the default authenticator).
c.LocalAuthenticator.allowed_groups = {env.get("HUB_GROUP", "students")}
c.Authenticator.admin_users = {name.strip() for name in env.get("HUB_ADMINS", "").split(",") if name.strip()}

# Each server: the shared environment's Python, the student's home, notebook 00 first.
c.Spawner.cmd = [str(Path(sys.executable).parent / "jupyterhub-singleuser")]
c.Spawner.default_url = f"/lab/tree/{hub.COURSE_FOLDER}/notebooks/00_environment.ipynb"
if env.get("HUB_MEM_LIMIT"):
    c.Spawner.mem_limit = env["HUB_MEM_LIMIT"]
if env.get("HUB_CPU_LIMIT"):
    c.Spawner.cpu_limit = float(env["HUB_CPU_LIMIT"])


def _key(spawner) -> str:
    return f"{spawner.user.name}/{spawner.name}"


def _home(spawner) -> tuple[Path, tuple[int, int] | None]:
    """The student's home, and the account that copies the course into it (None: the hub's own, as
    when SimpleLocalProcessSpawner runs every server as the hub's user)."""
    if getattr(spawner, "home_dir", None):
        return Path(spawner.home_dir), None
    account = pwd.getpwnam(spawner.user.name)
    return Path(account.pw_dir), (account.pw_uid, account.pw_gid) if os.geteuid() == 0 else None


def pre_spawn_hook(spawner) -> None:
    try:
        share = SHARES.take(_key(spawner))
    except hub.PoolFull as e:
        e.jupyterhub_message = str(e)  # what JupyterHub shows the student (and the REST API returns)
        raise
    spawner.environment = {**spawner.environment, **hub.spawn_environment(share, spawner.cpu_limit)}
    spawner.log.info("GPU share of %s: CUDA_VISIBLE_DEVICES=%r (%s)", _key(spawner), share.visible, share.line)
    home, account = _home(spawner)
    copied = hub.copy_course_as(account, COURSE, home) if account else hub.copy_course(COURSE, home)
    if copied:
        spawner.log.info("copied the course into %s", home / hub.COURSE_FOLDER)


def post_stop_hook(spawner) -> None:
    SHARES.release(_key(spawner))


c.Spawner.pre_spawn_hook = pre_spawn_hook
c.Spawner.post_stop_hook = post_stop_hook

# Idle servers are stopped (and their GPU share freed) by the culler, a service the hub starts.
c.JupyterHub.services = [
    {
        "name": "idle-culler",
        "command": [
            sys.executable,
            "-m",
            "jupyterhub_idle_culler",
            f"--timeout={CULL_IDLE_S}",
            f"--cull-every={CULL_EVERY_S}",
        ],
    }
]
c.JupyterHub.load_roles = [
    {
        "name": "idle-culler",
        "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
        "services": ["idle-culler"],
    }
]
