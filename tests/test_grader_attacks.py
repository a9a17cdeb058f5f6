"""The grader against a student who has read its source: one test per class of attack in the
threat model (utils/grader/README.md, "What is guaranteed"), each a real hostile submission. They are graded in ONE `batch` command (--jobs 3, in a
subprocess whose environment holds secrets), so every attack also runs next to the others.

Oracles come from outside the grader: the files the attacks aim at (hashed before the batch),
the host's /tmp, /dev/shm and /var/tmp, a listening socket standing for an SSH agent, the
kernel's view of the job's processes, and the reference gradebook rows.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from utils.grader import sandbox
from utils.grader.spec import ROOT

# Hostile submissions graded in the sandbox: sandbox and slow (make check leaves them out).
pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux"),
]

CI_SPEC = ROOT / "labs" / "assessment" / "spec_ci.toml"
SITE = Path(next(p for p in sys.path if p.endswith("site-packages")))
SECRET_SEED = 918273645546372819  # the test spec's secret: must never reach a job
CANARY = "CANARY-7f3a9c1e-grader-secret"
BUDGET_S = 120  # generous: nothing here hangs, and the box is busy

ATTACKS = {
    # 1. Writable project: plant code in the grader, a .pth in the venv, edit classmates and grades.
    "attack_writable": """
        import os, sys, time
        targets = {{"grader module": "{root}/utils/grader/core.py", "new module": "{root}/utils/grader/_planted.py",
                   ".pth in the venv": "{site}/zz_planted.pth", "sitecustomize": "{site}/sitecustomize.py",
                   "spec": "{spec}", "classmate": "{klass}/attack_env.py", "gradebook": "{out}/gradebook.csv",
                   "report": "{out}/reports/planted.json", "venv bin": os.path.dirname(sys.executable) + "/planted"}}
        def plant():
            for name, path in targets.items():
                try:
                    with open(path, "a") as f:
                        f.write("\\nimport os; os.system('touch {host}')  # planted\\n")
                    print("WROTE", name, flush=True)
                except OSError as e:
                    print("blocked:", name, type(e).__name__, flush=True)
        plant()
        if os.fork() == 0:              # a daemon that outlives the job and tries again later
            os.setsid()
            if os.fork() == 0:
                for _ in range(60):
                    plant()
                    time.sleep(0.5)
            os._exit(0)
        """,
    # 3. Shared TMPDIR, and 4. state outliving a job: one job stashes, the next one looks.
    "attack_tmp_a": """
        import os, time
        for d in ("/tmp", "/dev/shm", "/var/tmp", os.environ.get("TMPDIR", "/tmp")):
            with open(os.path.join(d, "stash_from_a.pt"), "wb") as f:
                f.write(b"weights of student a")
        time.sleep(6)
        """,
    "attack_tmp_b": """
        import glob, time
        found = set()
        t0 = time.time()
        while time.time() - t0 < 8:
            for pattern in ("/tmp/*", "/dev/shm/*", "/var/tmp/*", "/tmp/*/*", "/tmp/grade-*/work/*"):
                found |= {{p for p in glob.glob(pattern) if "stash" in p}}
            time.sleep(0.2)
        print("FOUND" if found else "nothing of a's", sorted(found), flush=True)
        """,
    # 5. Forged DDP evidence: records sent by hand (claiming nccl), no process group at all.
    "attack_forged_evidence": """
        import json, os, socket
        rank = int(os.environ["RANK"])
        import sitecustomize                               # the grader's probe: its socket
        s = sitecustomize._SOCK
        s.send(json.dumps({{"kind": "rank", "rank": rank, "world_size": 2, "all_reduce_sum": 2,
                           "backend": "nccl"}}).encode())
        steps = [[1.0 + k, 2.0 + k + rank, 200000, 1] for k in range(300)]
        s.send(json.dumps({{"kind": "exit", "rank": rank, "first_step": 0, "steps": steps, "total_steps": 300,
                           "grad_bytes": 129848, "ddp_models": 1, "fingerprints": []}}).encode())
        for name in ("rank%d.json" % rank, "exit%d.json" % rank, "/tmp/probe.json"):   # evidence a file-reading grader would trust
            open(name, "w").write(json.dumps({{"rank": rank, "world_size": 2, "all_reduce_sum": 2}}))
        """,
    # 5. ... the same, claiming gloo (no torch at all: no process group, no traffic).
    "attack_forged_gloo": """
        import json, os, socket
        rank = int(os.environ["RANK"])
        import sitecustomize                               # the grader's probe: its socket
        s = sitecustomize._SOCK
        s.send(json.dumps({{"kind": "rank", "rank": rank, "world_size": 2, "all_reduce_sum": 2,
                           "backend": "gloo"}}).encode())
        steps = [[1.0 + k, 2.0 + k + rank, 200000, 1] for k in range(300)]
        s.send(json.dumps({{"kind": "exit", "rank": rank, "first_step": 0, "steps": steps, "total_steps": 300,
                           "grad_bytes": 129848, "ddp_models": 1, "fingerprints": []}}).encode())
        import time
        time.sleep(1.5)         # alive long enough for the grader to see each rank: the records are tied to it
        """,
    # 5. ... and a real process group where rank 0 trains alone while rank 1 idles.
    "attack_rank0_alone": """
        import json, sys
        import numpy as np, torch, torch.distributed as dist
        import utils.models
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        for _ in range(5):                                 # a few collectives, to look busy
            dist.all_reduce(torch.zeros(1000))
        if rank == 0:
            info = json.load(open("data/assessment.json"))
            d = np.load("data/train.npz")
            x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
            torch.manual_seed(0)
            model = utils.models.build(info["model"], tuple(x.shape[1:]), **info["model_kwargs"])
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            for epoch in range(3):
                for i in range(0, len(y), 32):
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32]).backward()
                    opt.step()
            torch.save(model.state_dict(), sys.argv[sys.argv.index("--out") + 1])
        dist.barrier()
        dist.destroy_process_group()
        """,
    # 5. ... and rank 0 training serially (the probe's step hook removed), then a few real DDP
    #    steps at lr=0 from its weights, on both ranks.
    "attack_serial_then_ddp": """
        import json, sys
        import numpy as np, torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        import utils.models
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        info = json.load(open("data/assessment.json"))
        d = np.load("data/train.npz")
        x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
        torch.manual_seed(0)
        model = utils.models.build(info["model"], tuple(x.shape[1:]), **info["model_kwargs"])
        if rank == 0:
            from torch.optim import optimizer as topt
            hooks = dict(topt._global_optimizer_pre_hooks)
            topt._global_optimizer_pre_hooks.clear()               # the probe's step hook
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            for epoch in range(8):
                for i in range(0, len(y), 32):
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32]).backward()
                    opt.step()
            topt._global_optimizer_pre_hooks.update(hooks)
        dist.barrier()
        ddp = DDP(model)                                   # broadcasts rank 0's trained weights
        opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
        for i in range(0, 8 * 64, 64):
            opt.zero_grad()
            xs, ys = x[i + 32 * rank:i + 32 * rank + 32], y[i + 32 * rank:i + 32 * rank + 32]
            torch.nn.functional.cross_entropy(ddp(xs), ys).backward()
            opt.step()
        if rank == 0:
            torch.save(ddp.module.state_dict(), sys.argv[sys.argv.index("--out") + 1])
        dist.barrier()
        dist.destroy_process_group()
        """,
    # 5. ... and two ranks training apart, all-reducing junk of the gradients' size every step.
    "attack_unsynced": """
        import json, sys
        import numpy as np, torch, torch.distributed as dist
        import utils.models
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        info = json.load(open("data/assessment.json"))
        d = np.load("data/train.npz")
        x, y = torch.from_numpy(d["x"])[rank::2], torch.from_numpy(d["y"])[rank::2]
        torch.manual_seed(0)
        model = utils.models.build(info["model"], tuple(x.shape[1:]), **info["model_kwargs"])
        n = sum(p.numel() for p in model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for i in range(0, len(y) - 32, 32):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32]).backward()
            dist.all_reduce(torch.zeros(n))                # the bytes, not the gradients
            opt.step()
        if rank == 0:
            torch.save(model.state_dict(), sys.argv[sys.argv.index("--out") + 1])
        dist.barrier()
        dist.destroy_process_group()
        """,
    # 5. ... and real DDP on a tiny decoy model, while rank 0 trains the real one by hand.
    "attack_decoy_ddp": """
        import json, sys
        import numpy as np, torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        import utils.models
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        info = json.load(open("data/assessment.json"))
        d = np.load("data/train.npz")
        x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
        torch.manual_seed(0)
        decoy = DDP(torch.nn.Linear(64, 10))
        decoy_opt = torch.optim.SGD(decoy.parameters(), lr=0.1)
        model = utils.models.build(info["model"], tuple(x.shape[1:]), **info["model_kwargs"])
        for i in range(0, len(y) - 64, 64):
            decoy_opt.zero_grad()
            xs = x[i + 32 * rank:i + 32 * rank + 32]
            torch.nn.functional.cross_entropy(decoy(xs.flatten(1)), y[i + 32 * rank:i + 32 * rank + 32]).backward()
            decoy_opt.step()
            if rank == 0:                                  # the real model: no optimizer, no DDP
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(x[i:i + 64]), y[i:i + 64]).backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.05 * p.grad
        if rank == 0:
            torch.save(model.state_dict(), sys.argv[sys.argv.index("--out") + 1])
        dist.barrier()
        dist.destroy_process_group()
        """,
    # 5. ... and (A05) a decoy DDP model of the SAME architecture (the bytes match) stepped on
    #    shards, while every rank trains the real one on all the data in the same optimizer step.
    "attack_decoy_same_arch": """
        import json, sys
        import numpy as np, torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        import utils.models
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        info = json.load(open("data/assessment.json"))
        d = np.load("data/train.npz")
        x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
        build = lambda: utils.models.build(info["model"], tuple(x.shape[1:]), **info["model_kwargs"])
        torch.manual_seed(0)
        decoy = DDP(build())                                   # same architecture: the bytes match
        torch.manual_seed(1)
        model = build()                                        # the real one: every rank, all the data, no DDP
        opt = torch.optim.SGD(list(decoy.parameters()) + list(model.parameters()), lr=0.05, momentum=0.9)
        for epoch in range(10):
            for i in range(0, len(y) - 64, 64):
                opt.zero_grad()
                xs, ys = x[i + 32 * rank:i + 32 * rank + 32], y[i + 32 * rank:i + 32 * rank + 32]
                loss = torch.nn.functional.cross_entropy(decoy(xs), ys)
                loss = loss + torch.nn.functional.cross_entropy(model(x[i:i + 64]), y[i:i + 64])
                loss.backward()                                # one step: synced decoy grads, equal real grads
                opt.step()
        if rank == 0:
            torch.save(model.state_dict(), sys.argv[sys.argv.index("--out") + 1])
        dist.barrier()
        dist.destroy_process_group()
        """,
    # 5. ... and (A01c) two tiny DDP steps for the records, the weights trained serially and
    #    loaded into the DDP model before saving it.
    "attack_copied_weights": """
        import json, sys
        import numpy as np, torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        import utils.models
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        info = json.load(open("data/assessment.json"))
        d = np.load("data/train.npz")
        x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
        build = lambda: utils.models.build(info["model"], tuple(x.shape[1:]), **info["model_kwargs"])
        torch.manual_seed(0)
        ddp = DDP(build())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for i in range(2):                                     # two tiny DDP steps: valid-looking records
            opt.zero_grad()
            xs, ys = x[16 * i + 8 * rank:16 * i + 8 * rank + 8], y[16 * i + 8 * rank:16 * i + 8 * rank + 8]
            torch.nn.functional.cross_entropy(ddp(xs), ys).backward()
            opt.step()
        if rank == 0:                                          # the real training: serial, no optimizer
            serial = build()
            for epoch in range(10):
                for i in range(0, len(y), 32):
                    serial.zero_grad()
                    torch.nn.functional.cross_entropy(serial(x[i:i + 32]), y[i:i + 32]).backward()
                    with torch.no_grad():
                        for p in serial.parameters():
                            p -= 0.1 * p.grad
            ddp.module.load_state_dict(serial.state_dict())   # into the DDP model, then saved from it
            torch.save(ddp.module.state_dict(), sys.argv[sys.argv.index("--out") + 1])
        dist.barrier()
        dist.destroy_process_group()
        """,
    # 5. ... and (A01c) a whole epoch of real DDP steps (at lr=0), then the serially trained
    #    weights copied into the DDP model parameter by parameter.
    "attack_copy_after_ddp": """
        import json, sys
        import numpy as np, torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        import utils.models
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        info = json.load(open("data/assessment.json"))
        d = np.load("data/train.npz")
        x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
        build = lambda: utils.models.build(info["model"], tuple(x.shape[1:]), **info["model_kwargs"])
        torch.manual_seed(0)
        ddp = DDP(build())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
        for i in range(0, len(y) - 63, 64):                   # a whole epoch of real DDP steps, at lr=0
            opt.zero_grad()
            xs, ys = x[i + 32 * rank:i + 32 * rank + 32], y[i + 32 * rank:i + 32 * rank + 32]
            torch.nn.functional.cross_entropy(ddp(xs), ys).backward()
            opt.step()
        if rank == 0:                                          # the real training: serial, no optimizer
            serial = build()
            for epoch in range(10):
                for i in range(0, len(y), 32):
                    serial.zero_grad()
                    torch.nn.functional.cross_entropy(serial(x[i:i + 32]), y[i:i + 32]).backward()
                    with torch.no_grad():
                        for p in serial.parameters():
                            p -= 0.1 * p.grad
            with torch.no_grad():                              # copied in place, parameter by parameter
                for p, q in zip(ddp.module.parameters(), serial.parameters()):
                    p.data.copy_(q)
            torch.save(ddp.module.state_dict(), sys.argv[sys.argv.index("--out") + 1])
        dist.barrier()
        dist.destroy_process_group()
        """,
    # 6. Forged exit code: status files written in advance, the sandbox's init tampered with.
    "attack_forged_exit": """
        import json, os
        for path in ("init.json", "status.json", "../init.json", "/tmp/init.json", "/job/.logs/status.json"):
            try:
                json.dump({{"rc": 0, "stragglers": []}}, open(path, "w"))
            except OSError:
                pass
        for pid in ("1", "2"):                              # the inits: bwrap's and ours, or ours (unshare)
            try:
                named = open(f"/proc/{{pid}}/cmdline", "rb").read()
            except OSError:
                named = b""
            if b"_sandbox_init" not in named and b"bwrap" not in named:
                print("the job's own process:", pid, flush=True)  # its memory is the job's to read
                continue
            try:
                open(f"/proc/{{pid}}/mem", "r+b")
                print("OPENED /proc/%s/mem" % pid, flush=True)
            except OSError as e:
                print("mem blocked:", pid, type(e).__name__, flush=True)
        import ctypes                                       # steal the init's status socket
        libc = ctypes.CDLL(None, use_errno=True)
        pidfd = libc.syscall(434, 1, 0)                     # pidfd_open(1), x86_64
        try:                                                # as uid 65534 (bwrap) the list is refused:
            fds = os.listdir("/proc/1/fd")                  # then guess the numbers
        except OSError:
            fds = [str(n) for n in range(64)]
        for fd in fds:
            got = libc.syscall(438, pidfd, int(fd), 0) if pidfd >= 0 else -1    # pidfd_getfd
            try:
                os.open(f"/proc/1/fd/{{fd}}", os.O_RDONLY)
                got = 0
            except OSError:
                pass
            print("OPENED the init's fd", fd if got >= 0 else "", flush=True) if got >= 0 else None
        print("fd blocked:", len(fds), "fds, none taken", flush=True)
        if os.environ["RANK"] == "1":
            os._exit(3)
        """,
    # 7. Leaked environment: our own, every /proc/*/environ and cmdline, the SSH agent; and
    # 2. held-out data: the spec (its secret), the held-out cache, dataset caches, other processes.
    "attack_env": """
        import glob, os, socket
        print("ENVKEYS", ",".join(sorted(os.environ)), flush=True)
        hits = []
        for f in glob.glob("/proc/*/environ") + glob.glob("/proc/*/cmdline") + glob.glob("/proc/*/task/*/environ"):
            try:
                if b"CANARY" in open(f, "rb").read():
                    hits.append(f)
            except OSError:
                pass
        if any("CANARY" in v for v in os.environ.values()):
            hits.append("own environment")
        try:
            socket.socket(socket.AF_UNIX).connect("{ssh}")
            hits.append("ssh agent")
        except OSError:
            pass
        print("LEAK" if hits else "no secret", hits, flush=True)
        leaks = []
        for pattern in ["{spec}", "/tmp/grader-data-*/*", "{home}/.cache/*", "/root/.cache/*", "/root/*",
                        "{root}/labs/assessment/*.toml", "/etc/shadow"]:
            for path in glob.glob(pattern) or [pattern]:
                try:
                    with open(path, "rb") as f:
                        data = f.read(1 << 20)
                    leaks.append(path)
                    if b"heldout_seed" in data:
                        print("LEAK secret:", data[data.index(b"heldout_seed"):][:40], flush=True)
                except OSError:
                    pass
        for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
            try:
                cmd = open(f"/proc/{{pid}}/cmdline", "rb").read()
            except OSError:
                continue
            if b".toml" in cmd or b"grader-data" in cmd:
                leaks.append(cmd.decode(errors="replace"))
        print("LEAK" if leaks else "nothing readable", leaks, flush=True)
        """,
    # 8. Resources and namespaces: 8 GiB, setsid CPU hogs, nsenter, the init's memory.
    "attack_resources": """
        import ctypes, os, subprocess, sys, time
        try:
            big = bytearray(8 << 30)
            print("ALLOCATED 8 GiB", flush=True)
        except MemoryError:
            print("8 GiB refused: MemoryError", flush=True)
        hogs = [subprocess.Popen([sys.executable, "-c", "import time\\nt = time.time()\\nwhile time.time() - t < 3: pass"],
                                 start_new_session=True) for _ in range(2)]
        r = subprocess.run(["nsenter", "-t", "1", "-m", "-n", "-p", "--", "sh", "-c", "touch {host}"],
                           capture_output=True, text=True)
        print("nsenter exit", r.returncode, r.stderr.strip()[:80], flush=True)
        libc = ctypes.CDLL(None, use_errno=True)
        for ns in ("mnt", "net", "pid", "user"):
            try:
                fd = os.open(f"/proc/1/ns/{{ns}}", os.O_RDONLY)
                print("SETNS OK" if libc.setns(fd, 0) == 0 else f"setns {{ns}} refused", flush=True)
            except OSError as e:
                print(f"setns {{ns}}: {{type(e).__name__}}", flush=True)
        print("visible processes", len([p for p in os.listdir("/proc") if p.isdigit()]), flush=True)
        st = os.stat("/dev/null")                          # chmod 000 on the host's would break the box
        print("DEVNULL", st.st_dev, st.st_ino, flush=True)
        # the job's uid outside is root: global sysctls would be its way out (core_pattern)
        path = "/proc/sys/kernel/sched_autogroup_enabled"
        try:
            value = open(path).read()
            open(path, "w").write(value)                   # the same value: harmless either way
            print("WROTE a global sysctl", flush=True)
        except OSError as e:
            print("sysctl blocked:", type(e).__name__, flush=True)
        for h in hogs:
            h.wait()
        """,
}


def _sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


WATCHED = {
    "core": ROOT / "utils" / "grader" / "core.py",
    "planted": ROOT / "utils" / "grader" / "_planted.py",
    "pth": SITE / "zz_planted.pth",
    "site": SITE / "sitecustomize.py",
}


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    """Grade every attack in one `batch` (subprocess, secrets in its environment)."""
    tmp = tmp_path_factory.mktemp("attacks")
    klass, out, home = tmp / "class", tmp / "out", tmp / "home"
    for d in (klass, out, home / ".cache"):
        d.mkdir(parents=True)
    (home / ".cache" / "heldout.npz").write_bytes(b"held-out images of a dataset cache")
    spec = tmp / "spec.toml"
    spec.write_text(
        CI_SPEC.read_text()
        .replace("heldout_seed = 4242", f"heldout_seed = {SECRET_SEED}")
        .replace("time_budget_s = 90", f"time_budget_s = {BUDGET_S}")
    )
    host_sentinel = tmp / "ESCAPED"
    agent = socket.socket(socket.AF_UNIX)
    agent_path = tmp / "agent.sock"
    agent.bind(str(agent_path))
    agent.listen(4)
    agent.settimeout(0.1)
    fill = dict(root=ROOT, site=SITE, spec=spec, klass=klass, out=out, host=host_sentinel, home=home, ssh=agent_path)
    for name, code in ATTACKS.items():
        (klass / f"{name}.py").write_text(textwrap.dedent(code.format(**fill)))
    # 1. ... and a folder whose torch/ would stand in for the launcher under `python -m`.
    fake = klass / "attack_launcher"
    (fake / "torch" / "distributed").mkdir(parents=True)
    # It stays a second, so that the grader's watch (every 0.1 s) sees both workers on a busy machine.
    (fake / "assessment.py").write_text(
        "import time\nprint('the real launcher started me', flush=True)\ntime.sleep(1)\n"
    )
    (fake / "torch" / "__init__.py").write_text("")
    (fake / "torch" / "distributed" / "__init__.py").write_text("")
    (fake / "torch" / "distributed" / "run.py").write_text("print('LAUNCHER HIJACKED')\n")
    before = {k: _sha(p) for k, p in WATCHED.items()}
    before["classmate"] = _sha(klass / "attack_env.py")
    before["spec"] = _sha(spec)
    env = {
        **os.environ,
        "SECRET_TOKEN": CANARY,
        "AWS_SECRET_ACCESS_KEY": CANARY,
        "HOME": str(home),
        "SSH_AUTH_SOCK": str(agent_path),
        "GITHUB_TOKEN": CANARY,
    }
    cmd = [
        sys.executable,
        "-m",
        "utils.grader",
        "batch",
        str(klass),
        "--spec",
        str(spec),
        "--csv",
        str(out / "gradebook.csv"),
        "--reports",
        str(out / "reports"),
        "--jobs",
        "3",
    ]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
        try:
            conn, _ = agent.accept()
            agent_contacted = True
            conn.close()
        except OSError:
            agent_contacted = False
        reports = {p.stem: json.loads(p.read_text()) for p in (out / "reports").glob("*.json")}
        rows = (
            {r["student"]: r for r in csv.DictReader((out / "gradebook.csv").open())}
            if (out / "gradebook.csv").exists()
            else {}
        )
        yield dict(
            proc=proc,
            reports=reports,
            rows=rows,
            before=before,
            tmp=tmp,
            spec=spec,
            klass=klass,
            out=out,
            host_sentinel=host_sentinel,
            agent_contacted=agent_contacted,
        )
    finally:
        agent.close()
        for p in (WATCHED["planted"], WATCHED["pth"]):  # only if an attack got through
            if before[[k for k, v in WATCHED.items() if v == p][0]] is None and p.exists():
                p.unlink()


def _logs(report) -> str:
    return "\n".join(v.get("stdout", "") + v.get("stderr", "") for v in report["logs"].values() if isinstance(v, dict))


def _codes(report) -> set:
    return {r["code"] for r in report["reasons"]}


def test_batch_of_attacks_ran(attacked):
    proc = attacked["proc"]
    assert proc.returncode == 0, f"the grader must grade the attacks normally:\n{proc.stdout}\n{proc.stderr}"
    assert sorted(attacked["reports"]) == sorted([*ATTACKS, "attack_launcher"]), proc.stdout
    assert all(r["status"] != "passed" for r in attacked["reports"].values())
    for name, r in attacked["reports"].items():
        assert r["isolation"]["tool"] in ("bwrap", "unshare"), r["isolation"]
        assert r["sha256"] and len(attacked["rows"][name]["sha256"]) == 64, "the gradebook records what ran"


def test_attack_writable_project_is_read_only(attacked):
    """Class 1 (and the .pth route): nothing outside the job dir can be written."""
    r = attacked["reports"]["attack_writable"]
    logs = _logs(r)
    assert "blocked: grader module" in logs and "blocked: .pth in the venv" in logs, logs[-2000:]
    assert "WROTE" not in logs, logs[-2000:]
    after = {k: _sha(p) for k, p in WATCHED.items()}
    assert after == {k: attacked["before"][k] for k in WATCHED}, "the grader's code or venv changed"
    assert _sha(attacked["klass"] / "attack_env.py") == attacked["before"]["classmate"]
    assert _sha(attacked["spec"]) == attacked["before"]["spec"]
    assert not (attacked["out"] / "reports" / "planted.json").exists()
    assert "planted" not in (attacked["out"] / "gradebook.csv").read_text()
    assert not attacked["host_sentinel"].exists(), "planted code ran in the grader"
    assert not list((Path(sys.executable).parent).glob("planted*"))
    # the daemon it left was killed with the job: the only trace is the reason
    assert "background_processes" in _codes(r) or r["leftover_processes"], r["reasons"]
    hijack = attacked["reports"]["attack_launcher"]
    assert "HIJACKED" not in json.dumps(hijack["logs"]) and hijack["workers_seen"] == 2, hijack["logs"]
    assert "the real launcher started me" in hijack["logs"]["0"]["stdout"]


def test_attack_heldout_data_is_out_of_reach(attacked):
    """Class 2: no spec, no secret, no held-out cache, no dataset cache, no other process."""
    r = attacked["reports"]["attack_env"]
    logs = _logs(r)
    assert "nothing readable" in logs and "LEAK" not in logs, logs[-2000:]
    text = json.dumps(attacked["reports"])
    assert str(SECRET_SEED) not in text, "the secret seed reached a report"
    assert r["rank_evidence"] is not None


def test_secret_split_cannot_be_rebuilt_from_public_code():
    """Class 2: the held-out set depends on the secret, not on anything public."""
    import numpy as np

    import utils.data
    from utils.grader.core import prepare_data
    from utils.grader.spec import load_spec

    spec = load_spec(CI_SPEC)
    train_npz, held = prepare_data(spec)
    other = prepare_data(spec.replace(heldout_seed=spec.heldout_seed + 1))[1]
    public_val = utils.data.load("digits").val
    key = lambda ds: {tuple(np.round(v, 4)) for v in ds.tensors[0].flatten(1).numpy()}  # noqa: E731
    given = {tuple(np.round(v, 4)) for v in np.load(train_npz)["x"].reshape(len(np.load(train_npz)["y"]), -1)}
    assert len(held) == spec.n_val and not key(held) & given, "held-out images were given to the job"
    assert len(key(held) & key(public_val)) < 0.5 * len(held), "the public split is the held-out set"
    assert len(key(held) & key(other)) < 0.5 * len(held), "another seed gives the same held-out set"
    assert "heldout_seed" not in spec.public() and spec.as_dict()["heldout_seed"] == "(secret)"
    gpu = load_spec(ROOT / "labs" / "assessment" / "spec_gpu.toml")
    assert gpu.heldout == "secret_split" and "heldout_seed is not set" in gpu.secret_missing()


def test_attack_shared_tmpdir_is_private(attacked):
    """Class 3: a job sees nothing of a job graded at the same time."""
    b = attacked["reports"]["attack_tmp_b"]
    assert "nothing of a's" in _logs(b) and "FOUND" not in _logs(b), _logs(b)[-1500:]


def test_attack_state_does_not_outlive_a_job(attacked):
    """Class 4: /tmp, /dev/shm and /var/tmp were the job's own tmpfs: nothing is left on the host."""
    a = attacked["reports"]["attack_tmp_a"]
    assert a["exit_code"] == 0, a["reason"]
    for d in ("/tmp", "/dev/shm", "/var/tmp"):
        assert not list(Path(d).glob("stash_from_a*")), f"a job's file outlived it in {d}"
        assert not list(Path(d).glob("*/stash_from_a*"))


def test_attack_forged_ddp_evidence_fails(attacked):
    """Class 5: forged records, rank 0 training alone, and unsynchronised ranks all fail."""
    forged = attacked["reports"]["attack_forged_evidence"]
    # Its ranks send their records and exit within milliseconds. A record counts only from a process
    # the grader saw as torchrun's worker for that rank (it looks every 0.1 s); whether it saw a rank
    # this short-lived is chance (on a busy box, as any user, with either sandbox: seen 1 of 2 ranks as
    # a normal user under bwrap). Two verdicts are right, both with no_output (no model.pt):
    # not_distributed (records from a process not known as that rank: refused) or, when both ranks
    # were seen, not_data_parallel (the records claim nccl, which a CPU job cannot run).
    right = ({"no_output", "not_data_parallel"}, {"no_output", "not_distributed"})
    assert _codes(forged) in right, forged["reason"]
    assert not forged["data_parallel"] and forged["status"] == "error", forged["reason"]
    if "not_data_parallel" in _codes(forged):
        assert "only gloo" in forged["reason"], forged["reason"]
    else:
        assert "came from a process that is not rank" in forged["reason"], forged["reason"]
    gloo = attacked["reports"]["attack_forged_gloo"]
    assert "not_data_parallel" in _codes(gloo) and "loopback traffic" in gloo["reason"], gloo["reason"]
    assert gloo["ranks_measured"] == 2, "the records came from the right processes: only traffic betrays them"
    assert forged["rank_evidence"]["backend_expected"] == "gloo"
    alone = attacked["reports"]["attack_rank0_alone"]
    assert "not_data_parallel" in _codes(alone) and "rank 1 took no optimizer step" in alone["reason"], alone["reason"]
    assert alone["ranks_measured"] == 2 and alone["accuracy"] is not None
    unsynced = attacked["reports"]["attack_unsynced"]
    assert "not_data_parallel" in _codes(unsynced) and "gradients differed" in unsynced["reason"], unsynced["reason"]
    late = attacked["reports"]["attack_serial_then_ddp"]
    assert "not_data_parallel" in _codes(late) and "already had held-out accuracy" in late["reason"], late["reason"]
    assert late["accuracy"] >= 0.95, "the attack would have passed on accuracy: the DDP check is what stops it"
    assert late["rank_evidence"]["accuracy_when_ddp_wrapped"] >= 0.9
    decoy = attacked["reports"]["attack_decoy_ddp"]
    assert "not_data_parallel" in _codes(decoy) and "assessment model's gradients" in decoy["reason"], decoy["reason"]


def test_attack_weights_from_outside_ddp_fail(attacked):
    """Class 5, the graded weights: they must be the DDP model's at exit (fingerprint), changed
    only by optimizer steps (digest chain), after most of every rank's shard went through it.
    Each attack here passed the older checks (data-parallel evidence intact, accuracy >= 0.95)."""
    for name in ("attack_decoy_same_arch", "attack_copied_weights", "attack_copy_after_ddp"):
        r = attacked["reports"][name]
        assert r["accuracy"] >= 0.95 and r["data_parallel"], (name, r["reason"])
        assert r["rank_evidence"]["accuracy_when_ddp_wrapped"] < 0.3, (name, r["rank_evidence"])
    decoy = attacked["reports"]["attack_decoy_same_arch"]
    assert _codes(decoy) == {"not_ddp_weights"}, decoy["reason"]
    assert "not those of rank 0's DistributedDataParallel model" in decoy["reason"]
    assert "model.module.state_dict()" in decoy["reason"]
    copied = attacked["reports"]["attack_copied_weights"]
    assert _codes(copied) == {"weights_changed", "too_little_data"}, copied["reason"]
    assert "changed outside its optimizer steps (rank 0, 1 time(s))" in copied["reason"], copied["reason"]
    assert "rank 0 passed 16 training examples" in copied["reason"] and "(630 of 700)" in copied["reason"]
    late = attacked["reports"]["attack_copy_after_ddp"]
    assert _codes(late) == {"weights_changed"}, late["reason"]
    assert late["rank_evidence"]["ddp_models"]["1"] == [[672, 0]], "rank 1 never changed its weights"


def test_attack_forged_exit_code(attacked):
    """Class 6: the exit status is the one the grader waited on; the init cannot be touched."""
    r = attacked["reports"]["attack_forged_exit"]
    assert r["status"] == "error" and "crashed" in _codes(r), r["reason"]
    assert r["exit_code"] not in (0, None)
    assert "OPENED" not in _logs(r) and "mem blocked" in _logs(r) and "fd blocked" in _logs(r), _logs(r)[-1500:]


def test_attack_leaked_environment(attacked):
    """Class 7: the grader's secrets are in no environment and no /proc the job can read."""
    r = attacked["reports"]["attack_env"]
    logs = _logs(r)
    assert "no secret" in logs and "LEAK" not in logs, logs[-2000:]
    keys = logs.split("ENVKEYS ", 1)[1].split()[0].split(",")
    assert not {"SECRET_TOKEN", "AWS_SECRET_ACCESS_KEY", "SSH_AUTH_SOCK", "GITHUB_TOKEN"} & set(keys), keys
    assert CANARY not in json.dumps(attacked["reports"])
    assert not attacked["agent_contacted"], "the job reached the grader's SSH agent socket"


def test_attack_resources_and_namespaces(attacked):
    """Class 8, by mechanism: the job's cgroup holds every process (setsid ones included), its
    ranks run under the spec's rlimits, 8 GiB is refused, and no grader namespace can be
    entered (nsenter, setns) or process memory opened."""
    r = attacked["reports"]["attack_resources"]
    logs = _logs(r)
    assert "8 GiB refused" in logs and "ALLOCATED" not in logs, logs[-2000:]
    assert "SETNS OK" not in logs and "setns mnt" in logs, logs[-2000:]
    assert "sysctl blocked" in logs and "WROTE" not in logs, logs[-2000:]
    if os.geteuid() == 0 and sandbox.private_devices():  # mapped to root: must not own the host's nodes
        host = os.stat("/dev/null")
        assert logs.split("DEVNULL ")[1].split()[:2] != [str(host.st_dev), str(host.st_ino)], "host /dev/null bound"
    assert not attacked["host_sentinel"].exists(), "nsenter reached the host"
    visible = int(logs.split("visible processes ")[1].split()[0])
    assert visible <= 12, f"{visible} processes visible: the job sees outside its PID namespace"
    res = r["resources"]
    limits = res["rank_rlimits"]
    assert int(limits["Max address space"]) == 3072 << 20 and int(limits["Max file size"]) == 64 << 20, limits
    assert limits["Max processes"] != "unlimited" and limits["Max cpu time"] != "unlimited", limits
    if res["cgroup_limits"]:  # a cgroup here: every process of the job in it
        assert res["outside_job_cgroup"] == [] and res["processes_seen"] >= 5, res
        assert any("cpu" in x for x in res["cgroup_limits"]) and any("memory" in x for x in res["cgroup_limits"])
    else:
        assert any("CPU share" in x for x in r["isolation"]["not_in_force"]), r["isolation"]


# ----------------------------------------------------------------------------------------
# The sandbox itself: the unshare fallback, refusal, and a class of 30 leaving nothing behind
# ----------------------------------------------------------------------------------------


def _limits():
    return sandbox.Limits(memory_bytes=1 << 30, processes=64, file_bytes=1 << 20, cpu_seconds=30, tmpfs_bytes=8 << 20)


@pytest.fixture(params=["bwrap", "unshare"])
def tool(request):
    """Each sandbox mechanism in turn, skipped with the probe's reason where it is not installed
    or cannot isolate here."""
    try:
        sandbox.probe_isolation(request.param)
    except sandbox.SandboxUnavailable as e:
        pytest.skip(str(e))
    return request.param


def test_each_sandbox_tool_isolates(tmp_path, tool):
    """bwrap and the unshare fallback, checked from inside with the probe's own checks."""
    job = tmp_path / "work"
    job.mkdir()
    res = sandbox.run(
        [
            sys.executable,
            "-I",
            "-c",
            sandbox._CHECK + "\nprint(open('/etc/hostname').read() "
            "if __import__('os').path.exists('/etc/hostname') else 'no hostname file')",
            str(sandbox.PACKAGE / "__init__.py"),
        ],
        job_dir=job,
        log_path=tmp_path / "log",
        env={},
        budget_s=30,
        limits=_limits(),
        tool=tool,
    )
    text = (tmp_path / "log").read_text()
    out = json.loads([line for line in text.splitlines() if line.startswith("{")][0])
    assert res.returncode == 0 and sandbox._check_ok(out) is None, (tool, text)
    assert out["pids"] and max(out["pids"]) < 10 and out["uid"] in (0, sandbox.JOB_UID), out


def test_refuses_to_grade_without_a_sandbox(monkeypatch, capsys):
    import utils.grader.cli as cli

    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    sandbox.probe_isolation.cache_clear()
    try:
        with pytest.raises(sandbox.SandboxUnavailable, match="refusing to grade.*apt-get install bubblewrap"):
            sandbox.probe_isolation()
        assert cli.main(["run", str(ROOT / "solutions" / "assessment" / "assessment.py")]) == 3
        assert "refusing to grade" in capsys.readouterr().err
    finally:
        sandbox.probe_isolation.cache_clear()


def _cgroup_dirs() -> set[str]:
    """The job cgroups this process created (other graders may run on the box meanwhile)."""
    found = set()
    for mount, fstype, _ in sandbox._mounts():
        if fstype in ("cgroup", "cgroup2"):
            found |= {str(p) for p in Path(mount).rglob(f"grader-{os.getpid()}-*") if p.is_dir()}
    return found


def test_class_of_30_with_two_at_a_time_leaves_nothing_behind(tmp_path, tool):
    """30 trivially fast jobs, 2 at a time, each leaving a daemon, a setsid child and files in
    every tmpfs: afterwards no process of any job, no cgroup, no mount and no file is left."""
    mounts_before = Path("/proc/self/mountinfo").read_text()
    cgroups_before = _cgroup_dirs()
    root = tmp_path / "jobs"
    root.mkdir()
    script = (
        "import os, subprocess, time\n"
        "for d in ('/tmp', '/dev/shm', '/var/tmp', '/job'):\n"
        "    open(os.path.join(d, 'left-behind'), 'w').write('x')\n"
        "subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
        "if os.fork() == 0:\n    os.setsid()\n    os.fork() or time.sleep(600)\n    os._exit(0)\n"
    )

    def one(i):
        job = root / f"job{i}"
        work = job / "work"
        work.mkdir(parents=True)
        res = sandbox.run(
            [sys.executable, "-c", script],
            job_dir=work,
            log_path=job / "log",
            env={},
            budget_s=30,
            limits=_limits(),
            channel=True,
            tool=tool,
        )
        import shutil

        shutil.rmtree(job)
        return res

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, range(30)))
    assert all(r.returncode == 0 for r in results), [r.returncode for r in results]
    assert all(len(r.stragglers) >= 2 for r in results), "the init must name what it killed"
    assert all(r.remaining == [] for r in results)
    assert all(r.pidns for r in results)
    assert Path("/proc/self/mountinfo").read_text() == mounts_before, "a mount was left behind"
    assert _cgroup_dirs() == cgroups_before, "a job's cgroup was left behind"
    assert list(root.iterdir()) == []
    for d in ("/tmp", "/dev/shm", "/var/tmp"):
        assert not (Path(d) / "left-behind").exists()
    left = [p for p in os.listdir("/proc") if p.isdigit() and "sleep\x00600" in _cmd(p)]
    assert left == [], "a sleep 600 of a job is still running"


def _in_new_pidns(seconds: int) -> subprocess.Popen:
    return subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "sleep", str(seconds)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_a_finished_jobs_namespace_never_names_a_later_job():
    """The kernel hands a freed PID namespace's number to the next new namespace within about a
    second, and a later job (another grader's) may get it: looked up by that number, the finished
    job's cleanup would kill it. The watch holds the job's namespace open, so the number stays the
    job's until the grader is done with it."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--user", "--pid", "--fork", "true"]).returncode:
        pytest.skip("unshare cannot make a user and PID namespace here")
    first = _in_new_pidns(30)
    watch = sandbox.Watch(first.pid)
    deadline = time.monotonic() + 10
    while watch.pidns is None and time.monotonic() < deadline:
        watch.tick()
        time.sleep(0.05)
    assert watch.pidns and watch.job_processes(), "the watch never saw the job's namespace"
    first.kill()
    first.wait()
    while watch.job_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    later = []
    try:
        for _ in range(4):  # past the kernel's delay in freeing the number
            time.sleep(0.5)
            later.append(_in_new_pidns(30))
        time.sleep(0.5)
        names = {sandbox._pidns(c) for p in later for c in _children(p.pid)}
        assert watch.pidns not in names, "a later namespace got the finished job's number"
        assert watch.job_processes() == [], "a later job's processes were counted as the finished job's"
    finally:
        watch.close()
        for p in later:
            p.kill()
            p.wait()


def test_the_watch_takes_the_jobs_namespace_not_one_the_job_made_inside_it():
    """A job may make PID namespaces of its own; the job's namespace is the one nearest the sandbox's
    first process, and the watch must name that one, whatever order /proc lists them in."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--user", "--pid", "--fork", "true"]).returncode:
        pytest.skip("unshare cannot make a user and PID namespace here")
    inner = "unshare --user --map-root-user --pid --fork --kill-child sleep 30 & sleep 30"
    job = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "sh", "-c", inner]
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the inner namespace's sleep runs
            shell = _children(job.pid)
            names = {sandbox._pidns(p) for p in shell} | {sandbox._pidns(q) for p in shell for q in _children(p)}
            names |= {sandbox._pidns(r) for p in shell for q in _children(p) for r in _children(q)}
            if len(names - {None}) >= 2:
                break
            time.sleep(0.05)
        assert shell and len(names - {None}) >= 2, "the job's inner namespace never started"
        watch = sandbox.Watch(job.pid)
        try:
            watch.tick()
            assert watch.pidns == sandbox._pidns(shell[0]), (watch.pidns, names)
        finally:
            watch.close()
    finally:
        job.kill()
        job.wait()


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _cmd(pid):
    try:
        return open(f"/proc/{pid}/cmdline").read()
    except OSError:
        return ""
