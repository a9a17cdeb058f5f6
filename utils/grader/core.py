"""Grading one submission: snapshot it, run it under torchrun in its own sandbox, verify from the
grader's side what ran, evaluate its model in the grader's own process, report.

The report is a plain dict (JSON): ``status`` is ``passed``, ``failed`` (it ran and produced a
model, but missed a requirement) or ``error`` (nothing gradable came out); ``reasons`` lists
``{"code", "message"}`` for every requirement missed, in words that say what to fix.

Nothing the job could write is trusted: its model file and its logs are read after every
process of the job is gone, never through a link, the model from a grader-owned copy; its
evidence arrives over a socket the grader created and is cross-checked (:func:`verify_ranks`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime
import hashlib
import json
import math
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

# Every module grading uses is imported here, before any job runs (nothing is imported later
# from a place a job could have touched).
import numpy as np
import torch
from torch.utils.data import TensorDataset

import utils
import utils.data
import utils.models
import utils.train

from .. import rank_failures
from ..files import atomic_write_json
from . import sandbox, static, weights
from .spec import ROOT, Spec

PROBE_SITE = Path(__file__).with_name("_probe")
# torchrun, started so that nothing in the job dir can stand in for it: `python -m` would put the
# working directory (the submission's files: a torch/ folder, say) first on sys.path.
LAUNCHER = (
    "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.', '/job')]; import runpy; "
    "sys.argv[0] = 'torchrun'; runpy.run_module('torch.distributed.run', run_name='__main__', alter_sys=True)"
)
LOG_TAIL_BYTES = 3000
MAX_FILES = 200  # files in a submission folder
MAX_STEPS = 200_000  # optimizer steps per rank the grader looks at

# Reasons after which there is no model to grade: the status is "error", not "failed".
# Reasons the run or the model could not be graded as a result ("error", not "failed"); the
# gradebook (batch.py) groups them into its columns by these two sets.
RUN_CODES = {"no_entry", "syntax_error", "too_large_submission", "crashed", "timeout", "output_limit", "grader_error"}
MODEL_CODES = {
    "no_output",
    "bad_checkpoint",
    "unsafe_checkpoint",
    "too_large",
    "wrong_keys",
    "wrong_shapes",
    "nan_weights",
}
ERROR_CODES = RUN_CODES | MODEL_CODES


# ----------------------------------------------------------------------------------------
# Data: the training split goes to the submission, the held-out split stays here
# ----------------------------------------------------------------------------------------

_DATA_LOCK = threading.Lock()
_DATA: dict = {}


def split_secret(x: np.ndarray, y: np.ndarray, n_val: int, n_train: int, secret: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices) of a pool, drawn with the spec's secret seed: without
    the secret no public code knows which images the grader keeps."""
    order = np.random.default_rng(secret).permutation(len(y))
    held, rest = order[:n_val], order[n_val:]
    return (rest[:n_train] if n_train else rest), held


def prepare_data(spec: Spec) -> tuple[Path, torch.utils.data.TensorDataset]:
    """(path of train.npz in a grader-owned cache, held-out TensorDataset), once per process."""
    why = spec.secret_missing()
    if why:
        raise ValueError(why)
    key = (spec.dataset, spec.n_train, spec.n_val, spec.seed, spec.data_dir, spec.heldout, spec.heldout_seed)
    with _DATA_LOCK:
        if key in _DATA and _DATA[key][0].exists():
            return _DATA[key]
        kw = {"root": spec.data_dir} if spec.data_dir and spec.dataset != "digits" else {}
        if spec.heldout == "secret_split":
            splits = utils.data.load(spec.dataset, **kw)
            x = torch.cat([splits.train.tensors[0], splits.val.tensors[0]])
            y = torch.cat([splits.train.tensors[1], splits.val.tensors[1]])
            tr, held = split_secret(x, y, spec.n_val or len(splits.val), spec.n_train, spec.heldout_seed)
            train = TensorDataset(x[tr], y[tr])
            heldout = TensorDataset(x[held], y[held])
        else:
            splits = utils.data.load(
                spec.dataset, n_train=spec.n_train or None, n_val=spec.n_val or None, seed=spec.seed, **kw
            )
            train, heldout = splits.train, splits.val
            if spec.heldout != "val":
                with np.load(spec.heldout) as f:
                    hx, hy = torch.from_numpy(f["x"]).float(), torch.from_numpy(f["y"]).long()
                if tuple(hx.shape[1:]) != tuple(train.tensors[0].shape[1:]):
                    raise ValueError(
                        f"held-out images {tuple(hx.shape[1:])} differ from the training "
                        f"images {tuple(train.tensors[0].shape[1:])}: fix heldout in {spec.path}"
                    )
                heldout = TensorDataset(hx, hy)
        x, y = train.tensors
        cache = Path(tempfile.mkdtemp(prefix="grader-data-"))  # 0700, the grader's own
        import atexit

        atexit.register(shutil.rmtree, cache, True)  # CIFAR-10's split is 600 MB: never leave it
        train_npz = cache / "train.npz"
        np.savez(train_npz, x=x.numpy(), y=y.numpy())
        _DATA[key] = (train_npz, heldout)
        return _DATA[key]


# ----------------------------------------------------------------------------------------
# The submission, snapshotted
# ----------------------------------------------------------------------------------------


class Refused(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def find_entry(submission: Path) -> str:
    """The script to run, relative to the snapshot: the file itself (as assessment.py), or in a
    folder assessment.py, else its only .py."""
    if submission.is_file():
        return "assessment.py"
    if (submission / "assessment.py").is_file():
        return "assessment.py"
    scripts = sorted(p.name for p in submission.glob("*.py"))
    if len(scripts) == 1:
        if not re.fullmatch(r"[A-Za-z0-9_][\w.-]*\.py", scripts[0]):
            raise Refused("no_entry", f"{scripts[0]!r} is not a plain file name: name the script assessment.py")
        return scripts[0]
    raise Refused(
        "no_entry",
        f"{submission.name} holds {len(scripts)} .py files and no assessment.py: "
        "name the training script assessment.py",
    )


def snapshot(submission: Path, dest: Path, max_bytes: int) -> dict:
    """Copy the submission's regular files into ``dest`` (each read once: what is hashed is
    what runs), refusing it past ``max_bytes``. Links are not followed or copied."""
    if submission.is_file():
        files = [(submission, "assessment.py")]
    else:
        files = []
        for root, dirs, names in os.walk(submission):  # os.walk does not follow links
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
            for n in sorted(names):
                p = Path(root) / n
                if p.is_file() and not p.is_symlink():
                    files.append((p, str(p.relative_to(submission))))
                if len(files) > MAX_FILES:
                    raise Refused("too_large_submission", f"more than {MAX_FILES} files: submit the script")
    h, total = hashlib.sha256(), 0
    dest.mkdir(mode=0o700)
    for src, rel in files:
        with open(src, "rb") as f:
            data = f.read(max_bytes + 1 - total)
        total += len(data)
        if total > max_bytes:
            raise Refused(
                "too_large_submission",
                f"the submission is over {max_bytes >> 10} KiB (submit the script, not data or models)",
            )
        h.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
    return {"sha256": h.hexdigest(), "bytes": total, "files": [rel for _, rel in files]}


# ----------------------------------------------------------------------------------------
# Reading what the job left, after every process of it is gone
# ----------------------------------------------------------------------------------------


def _inside(root: Path, path: Path) -> bool:
    real = os.path.realpath(path)
    return real.startswith(os.path.realpath(root) + os.sep) and real == os.path.abspath(path)


def read_job_file(root: Path, path: Path, max_bytes: int, tail: bool = False) -> bytes | None:
    """A regular file of the job dir, never through a link (any component), at most ``max_bytes``
    (the last ones with ``tail``); None when it is not there or not a plain file."""
    if not _inside(root, path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None
        if tail and st.st_size > max_bytes:
            f.seek(st.st_size - max_bytes)
        return f.read(max_bytes)


def rank_logs(work: Path, nprocs: int) -> dict:
    out = {}
    logs = work / ".logs"
    for r in range(nprocs):
        out[str(r)] = {}
        for kind in ("stdout", "stderr"):
            found = sorted(logs.glob(f"*/attempt_*/{r}/{kind}.log"))[-1:] if logs.is_dir() else []
            data = read_job_file(work, found[0], LOG_TAIL_BYTES + 1, tail=True) if found else None
            text = (data or b"").decode(errors="replace")
            if len(text) > LOG_TAIL_BYTES:
                text = "[... earlier output not shown]\n" + text[-LOG_TAIL_BYTES:]
            out[str(r)][kind] = printable(text.replace("\r", "\n"))
    return out


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)')


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """The job's text without control characters (no terminal escapes reach the instructor)."""
    return _CONTROL.sub("?", text)


def rank_error(text: str) -> str | None:
    """The rank's own error, first line of it: 'ValueError: ... (assessment.py, line 12)'."""
    block = rank_failures.last_traceback(text)
    err = rank_failures.exception_line(block)
    if not err:
        return None
    where = None
    for line in block.splitlines():
        m = _FRAME.match(line)
        if m and m.group(1).startswith(sandbox.JOB_DIR + "/"):
            where = f"{m.group(1)[len(sandbox.JOB_DIR) + 1 :]}, line {m.group(2)}"
    return printable(err[:240] + (f" ({where})" if where else ""))


STDERR_TAIL_LINES, STDERR_TAIL_WIDTH = 3, 200


def stderr_tail(text: str) -> str | None:
    """The last lines a rank wrote to stderr (its own words: SystemExit's message, argparse's
    usage error), a few, each cut short; None when it wrote nothing."""
    lines = [
        l.strip()
        for l in rank_failures.RANK_PREFIX.sub("", text).splitlines()
        if l.strip() and not l.startswith("[... earlier output not shown]")
    ]
    if not lines:
        return None
    tail = [l if len(l) <= STDERR_TAIL_WIDTH else l[:STDERR_TAIL_WIDTH] + "..." for l in lines[-STDERR_TAIL_LINES:]]
    return printable(" | ".join(tail))


def failing_rank(launcher_log: str, logs: dict) -> tuple[str | None, str | None]:
    """(rank, its error) of the first failure (``rank_failures.first_failure``: torchrun's summary
    and each rank's log), in words; (None, None) when nothing names one."""
    ranks = {int(k): v.get("stdout", "") + "\n" + v.get("stderr", "") for k, v in logs.items() if k.isdigit()}
    first = rank_failures.first_failure(launcher_log, ranks)
    if first is None:
        return None, None
    r = str(first.rank)
    if first.error:
        return r, rank_error(first.traceback)
    code = first.exitcode
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return r, f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    said = stderr_tail(logs.get(r, {}).get("stderr", ""))
    return r, f"exited with code {code} without a Python traceback" + (
        f"; the last lines it wrote to stderr: {said}" if said else ""
    )


# ----------------------------------------------------------------------------------------
# Evidence: did every rank train, on its own data, with gradients synchronised every step?
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class RankRecords:
    """The probe's messages, parsed: each accepted only from the worker process torchrun started
    for that rank (the kernel names the sender)."""

    joined: dict  # rank -> its "rank" record (world size, all-reduce of ones, backend)
    exits: dict  # rank -> {"steps": {i: [grad_sum, grad_hash, reduced_bytes, n]}, "total", ...}
    wrapped: dict  # model index -> {part: (parts, bytes)}: the weights DDP wrapped, from rank 0
    problems: list  # what could not be accepted, in words


def parse_messages(messages: list, workers: list, n: int) -> RankRecords:
    """Parse the probe's ``(pid, record)`` messages of an ``n``-rank job; nothing is judged here."""
    rank_of = {w.pid: w.env_rank for w in workers}
    rec_ = RankRecords({}, {}, {}, [])
    for pid, rec in messages:
        kind = rec.get("kind")
        if kind == "error":
            rec_.problems.append(f"probe: {str(rec.get('error'))[:150]}")
            continue
        if kind not in ("rank", "exit", "wrap"):
            continue
        try:
            rank = int(rec["rank"])
        except (KeyError, TypeError, ValueError):
            continue
        if rank_of.get(pid) != str(rank):
            rec_.problems.append(f"a message for rank {rank} came from a process that is not rank {rank}")
        elif kind == "wrap":
            _parse_wrap(rec_, rank, rec)
        elif kind == "rank":
            if rec.get("world_size") == n and rec.get("all_reduce_sum") == n:
                rec_.joined[rank] = rec
            else:
                rec_.problems.append(
                    f"rank {rank}: world size {rec.get('world_size')}, all-reduce of ones gave "
                    f"{rec.get('all_reduce_sum')} (needs {n})"
                )
        else:
            _parse_exit(rec_, rank, rec)
    return rec_


def _parse_wrap(records: RankRecords, rank: int, rec: dict) -> None:
    try:
        m = int(rec.get("model", 0))
        if rank == 0 and 0 <= m < 4 and 0 <= int(rec["part"]) < int(rec["parts"]) <= 64:
            records.wrapped.setdefault(m, {})[int(rec["part"])] = (
                int(rec["parts"]),
                base64.b64decode(str(rec["data"])[: 1 << 18]),
            )
    except (KeyError, TypeError, ValueError, binascii.Error):
        records.problems.append("a malformed record of the weights DDP wrapped")


def _parse_exit(records: RankRecords, rank: int, rec: dict) -> None:
    e = records.exits.setdefault(rank, {"steps": {}, "total": 0, "grad_bytes": 0, "fingerprints": [], "ddp": []})
    try:
        first = int(rec.get("first_step", 0))
        for i, s in enumerate(list(rec.get("steps") or [])[:1000]):
            if 0 <= first + i < MAX_STEPS:
                e["steps"][first + i] = [float(s[0]), float(s[1]), int(s[2]), int(s[3])]
        e["total"] = min(int(rec.get("total_steps", 0)), MAX_STEPS)
        e["grad_bytes"] = int(rec.get("grad_bytes", 0))
        if first == 0:
            e["fingerprints"] = [str(f) for f in (rec.get("fingerprints") or [])][:8]
            e["ddp"] = [[int(x), int(b)] for x, b in list(rec.get("ddp") or [])[:8]]
    except (TypeError, ValueError, IndexError, OverflowError):
        records.problems.append(f"rank {rank}: a malformed record")


def collect_evidence(records: RankRecords, spec: Spec, loopback_octets: int) -> tuple[dict, dict]:
    """(evidence for the report, each rank's optimizer steps in order with None for a missing one)."""
    n = spec.nprocs
    joined, exits = records.joined, records.exits
    ranks = sorted(r for r in joined if 0 <= r < n)
    steps = {r: [exits[r]["steps"].get(k) for k in range(exits[r]["total"])] if r in exits else [] for r in range(n)}
    ev = {
        "ranks_joined": ranks,
        "backend_expected": "nccl" if spec.device == "cuda" else "gloo",
        "backend_reported": next((joined[r].get("backend") for r in ranks), None),
        "optimizer_steps": {str(r): len(s) for r, s in steps.items()},
        "grad_bytes": max([exits[r]["grad_bytes"] for r in exits] or [0]),
        "reduced_bytes": {str(r): sum(s[2] for s in steps[r] if s) for r in range(n)},
        "loopback_bytes": loopback_octets,
        "ddp_fingerprints": exits.get(0, {}).get("fingerprints", []),
        "problems": records.problems[:10],
        "ddp_models": {str(r): exits[r]["ddp"] for r in sorted(exits)},
        "data_parallel": False,
        "_wrapped_weights": {},
    }
    for m, got in records.wrapped.items():
        parts = {p for p, _ in got.values()}
        if len(parts) == 1 and set(got) == set(range(parts.pop())):
            ev["_wrapped_weights"][m] = b"".join(got[i][1] for i in range(len(got)))
    return ev, steps


def judge_data_parallel(ev: dict, steps: dict, backends: set, spec: Spec, model_bytes: int = 0) -> list:
    """Why the ranks' records are not those of data-parallel training (an empty list: they are)."""
    n, loopback_octets = spec.nprocs, ev["loopback_bytes"]
    counts = {r: len(s) for r, s in steps.items()}
    idle = [r for r in range(n) if counts[r] == 0]
    if spec.device == "cpu" and backends != {"gloo"}:
        return [
            f"backend {', '.join(sorted(backends))} reported on a CPU-only job, where only gloo "
            "can run: the records were not the probe's"
        ]
    if not all(None not in s for s in steps.values()):
        return ["the probe's records are incomplete (a rank did not exit normally)"]
    if idle:
        return [
            f"rank {idle[0]} took no optimizer step (rank 0 took {counts[0]}): every rank must train, not only rank 0"
        ]
    if len(set(counts.values())) > 1:
        return [
            "the ranks took different numbers of optimizer steps: "
            + ", ".join(f"rank {r}: {c}" for r, c in counts.items())
        ]
    m = counts[0]
    grad_bytes = max(ev["grad_bytes"], model_bytes)
    unsynced = sum(
        1
        for k in range(m)
        if any(not math.isclose(steps[r][k][0], steps[0][k][0], rel_tol=1e-6, abs_tol=1e-9) for r in range(1, n))
    )
    short = sum(1 for r in range(n) for k in range(m) if steps[r][k][2] < 0.45 * grad_bytes)
    same = sum(
        1
        for k in range(m)
        if all(math.isclose(steps[r][k][1], steps[0][k][1], rel_tol=1e-9, abs_tol=1e-12) for r in range(1, n))
    )
    if unsynced:
        return [
            f"the gradients differed between ranks at {unsynced} of {m} optimizer steps: "
            "they were not synchronised before every step"
        ]
    if short:
        return [
            f"{short} of {n * m} rank-steps all-reduced less than the assessment model's "
            f"gradients ({grad_bytes} bytes): synchronise every gradient before every step"
        ]
    if same > m / 2:
        return [
            f"every rank contributed the same gradients at {same} of {m} steps: each rank "
            "must train on its own shard of the data"
        ]
    claimed = sum(s[2] for s in steps[0])
    if spec.device == "cpu" and loopback_octets < 0.5 * claimed:
        return [
            f"the job's loopback traffic, measured by the grader ({loopback_octets >> 10} KiB), "
            f"is less than the gradients the ranks report synchronising ({claimed >> 10} KiB)"
        ]
    return []


def verify_ranks(messages: list, workers: list, spec: Spec, loopback_octets: int, model_bytes: int = 0) -> dict:
    """The evidence about the ranks, in three steps each readable alone: parse the probe's messages
    (:func:`parse_messages`), collect the evidence (:func:`collect_evidence`), judge whether it is
    data-parallel training (:func:`judge_data_parallel`). ``model_bytes``: the size of the
    assessment model's parameters, computed here: every step must all-reduce about that much."""
    records = parse_messages(messages, workers, spec.nprocs)
    ev, steps = collect_evidence(records, spec, loopback_octets)
    if len(ev["ranks_joined"]) < spec.nprocs:
        return ev
    backends = {str(records.joined[r].get("backend")) for r in ev["ranks_joined"]}
    dp = judge_data_parallel(ev, steps, backends, spec, model_bytes)
    ev["problems"] = (dp + records.problems)[:10]
    ev["data_parallel"] = not dp
    return ev


def verify_weights(ev: dict, saved: str, n_train: int, n: int) -> tuple[int | None, list]:
    """Are the graded weights (fingerprint ``saved``) those of a DDP model at exit, changed only
    by optimizer steps, that took most of every rank's shard? (index of that model, reasons)"""
    prints = ev.get("ddp_fingerprints") or []
    if saved not in prints:
        what = (
            "no DistributedDataParallel model was found on rank 0 at exit"
            if not prints
            else "the saved weights are not those of rank 0's DistributedDataParallel model at exit"
        )
        return None, [
            (
                "not_ddp_weights",
                f"{what}: train the model wrapped in DDP and save "
                "model.module.state_dict() of that DDP model, from rank 0, after the last step",
            )
        ]
    k, reasons = prints.index(saved), []
    models = {r: (ev.get("ddp_models", {}).get(str(r)) or [])[k : k + 1] for r in range(n)}
    if not all(models.values()):
        return k, [
            (
                "not_ddp_weights",
                "the probe's records of the DDP model are incomplete (a rank did "
                "not exit normally, or wrapped a different number of models)",
            )
        ]
    changed = [(r, m[0][1]) for r, m in models.items() if m[0][1]]
    if changed:
        reasons.append(
            (
                "weights_changed",
                f"the DDP model's weights changed outside its optimizer steps "
                f"(rank {changed[0][0]}, {changed[0][1]} time(s)): no load_state_dict or "
                "param.data writes after wrapping; only optimizer.step() may change them",
            )
        )
    need = math.ceil(0.9 * n_train / n)
    short = [(r, m[0][0]) for r, m in models.items() if m[0][0] < need]
    if short:
        reasons.append(
            (
                "too_little_data",
                f"rank {short[0][0]} passed {short[0][1]} training examples "
                f"through the DDP model's forward, under 90% of its shard ({need} of {n_train / n:g}): "
                "train every rank on all of its shard, through the DDP model",
            )
        )
    return k, reasons


# ----------------------------------------------------------------------------------------
# Grading
# ----------------------------------------------------------------------------------------


def _reason(code: str, message: str) -> dict:
    return {"code": code, "message": message}


def grader_info() -> dict:
    return {
        "version": utils.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "host": os.uname().nodename,
        "cpu_cores": os.cpu_count(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
    }


def limits_for(spec: Spec) -> sandbox.Limits:
    return sandbox.Limits(
        memory_bytes=spec.max_memory_mb << 20,
        processes=spec.max_processes,
        file_bytes=spec.max_output_mb << 20,
        cpu_seconds=int(spec.time_budget_s * max(1, os.cpu_count() or 1)) + 30,
        tmpfs_bytes=max(spec.max_output_mb, 64) << 20,
        address_space=spec.device == "cpu",
    )


def grade(
    submission: str | Path,
    spec: Spec,
    *,
    student: str | None = None,
    workroot: str | Path | None = None,
    keep: bool = False,
    gpus: list[int] | None = None,
) -> dict:
    """Grade one submission (a .py file or a folder) against ``spec``; never raises except
    :class:`sandbox.SandboxUnavailable` (nothing can be graded safely on this machine)."""
    iso = sandbox.probe_isolation()  # refuses before anything runs
    imports = sandbox.import_path(
        (spec.path, spec.heldout if spec.heldout.endswith(".npz") else "", spec.data_dir, workroot)
    )
    missing = sandbox.unbound_modules(imports)
    if missing:
        raise sandbox.SandboxUnavailable(
            "refusing to grade: the job could not import " + "; ".join(missing) + ". Install the packages "
            "in the grader's virtual environment (make .venv), or where the sandbox may bind them"
        )
    submission = Path(submission)
    t_start = time.perf_counter()
    report = {
        "student": student or submission.stem,
        "submission": str(submission),
        "sha256": None,
        "spec": spec.name,
        "spec_path": spec.path,
        "status": "error",
        "reasons": [],
        "accuracy": None,
        "target_val_acc": spec.target_val_acc,
        "time_s": None,
        "time_budget_s": spec.time_budget_s,
        "budget_note": spec.budget_note(),
        "ranks_measured": 0,
        "nprocs_required": spec.nprocs,
        "workers_seen": 0,
        "data_parallel": None,
        "exit_code": None,
        "timed_out": False,
        "error_excerpt": None,
        "static_warnings": [],
        "review": [],
        "logs": {},
        "rank_evidence": {},
        "isolation": {},
        "resources": {},
        "leftover_processes": [],
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    job = None
    try:
        job = Path(
            tempfile.mkdtemp(prefix=f"grade-{re.sub(r'[^A-Za-z0-9_.-]', '_', report['student'])[:40]}-", dir=workroot)
        )
        _grade(submission, spec, report, job, iso, gpus, imports)
    except Refused as e:
        report["reasons"].append(_reason(e.code, str(e)))
    except Exception as e:  # the grader never crashes on a submission
        report["reasons"].append(
            _reason(
                "grader_error",
                f"the grader failed: {type(e).__name__}: {e}. Tell the instructor; this is not your fault.",
            )
        )
        report["grader_traceback"] = traceback.format_exc()[-3000:]
    finally:
        if job and not keep:
            shutil.rmtree(job, ignore_errors=True)
        elif job:
            report["workdir"] = str(job)
    verdict(report, spec)
    report["grading_s"] = round(time.perf_counter() - t_start, 2)
    try:
        report["grader"] = grader_info()
    except Exception:  # provenance is best effort
        pass
    return report


def verdict(report: dict, spec: Spec) -> None:
    """The report's ``status`` and ``reason`` from the reasons collected: ``passed`` with none,
    ``error`` when one left nothing gradable (:data:`ERROR_CODES`), else ``failed``."""
    if not report["reasons"] and (report["accuracy"] is None or report["time_s"] is None):
        report["reasons"].append(_reason("grader_error", "no accuracy or time was measured; tell the instructor"))
    codes = [r["code"] for r in report["reasons"]]
    report["status"] = "passed" if not codes else "error" if any(c in ERROR_CODES for c in codes) else "failed"
    report["reason"] = (
        "; ".join(r["message"] for r in report["reasons"])
        or f"passed: accuracy {report['accuracy']:.4f} >= {spec.target_val_acc} in {report['time_s']:.1f} s "
        f"<= {spec.time_budget_s:g} s with {report['ranks_measured']} ranks"
    )


def _grade(submission: Path, spec: Spec, report: dict, job: Path, iso: dict, gpus, imports: dict):
    """One submission, in four steps each readable alone: prepare the job folder, run the job in
    the sandbox, collect the evidence (logs, the probe's records, the saved weights), judge."""
    work, entry, gpus, train_npz, heldout = _prepare_job(submission, spec, report, job, gpus)
    res, logs = _run_job(spec, report, job, work, entry, iso, gpus, imports)
    model_bytes = sum(
        p.numel() * p.element_size()
        for p in utils.models.build(
            spec.model, tuple(heldout.tensors[0].shape[1:]), **dict(spec.model_kwargs)
        ).parameters()
    )
    evidence = verify_ranks(res.messages, res.workers, spec, res.loopback_octets, model_bytes)
    report["rank_evidence"] = evidence
    report["ranks_measured"] = len(evidence["ranks_joined"])
    report["data_parallel"] = evidence["data_parallel"]
    judge_run(res, logs, spec, report)
    saved_print = _evaluate_weights(job, work, spec, heldout, res, report)
    graded, weight_reasons = None, []
    if saved_print is not None:
        with np.load(train_npz) as f:
            n_train = len(f["y"])
        graded, weight_reasons = verify_weights(evidence, saved_print, n_train, spec.nprocs)
    _check_learned_under_ddp(evidence, graded, job, spec, heldout, report)
    judge_result(res, evidence, weight_reasons, spec, report)


def _prepare_job(submission: Path, spec: Spec, report: dict, job: Path, gpus):
    """Snapshot the submission into the job folder, check its source, the GPUs and the data.
    Returns (work folder, entry script, GPUs, the training data file, the held-out set)."""
    if not submission.exists():
        raise Refused("no_entry", f"{submission} does not exist")
    entry = find_entry(submission)
    work = job / "work"  # /job in the sandbox: the one writable dir
    snap = snapshot(submission, work, spec.max_submission_kb << 10)
    report["sha256"], report["submission_bytes"] = snap["sha256"], snap["bytes"]
    found = static.check_source((work / entry).read_text(errors="replace"), entry)
    report["static_warnings"] = found["warnings"]
    if found["syntax_error"]:
        raise Refused("syntax_error", f"syntax error, nothing was run: {found['syntax_error']}")
    if spec.device == "cuda":
        have = len(gpus) if gpus is not None else (torch.cuda.device_count() if torch.cuda.is_available() else 0)
        if have < spec.nprocs:
            raise Refused(
                "grader_error",
                f"the spec runs {spec.nprocs} ranks on GPUs but this job has "
                f"{have} GPU(s): grade on a machine with enough GPUs, lower --jobs, or use a "
                'device = "cpu" spec. Not the student\'s fault.',
            )
        if gpus is None:
            gpus = list(range(spec.nprocs))
    else:
        gpus = None
    train_npz, heldout = prepare_data(spec)
    for d in ("data", "home", ".logs"):
        p = work / d
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.is_dir():
            shutil.rmtree(p)
        p.mkdir(mode=0o700)
    shutil.copy(train_npz, work / "data" / "train.npz")
    (work / "data" / "assessment.json").write_text(json.dumps(spec.public(), indent=1))
    for name in ("model.pt",):  # a model must come from this run
        (work / name).unlink(missing_ok=True)
    return work, entry, gpus, train_npz, heldout


def _run_job(spec: Spec, report: dict, job: Path, work: Path, entry: str, iso: dict, gpus, imports: dict):
    """Run the entry script under torchrun in the sandbox; record what the grader measured.
    Returns (the sandbox's RunResult, the ranks' and the launcher's logs)."""
    cmd = [
        sys.executable,
        "-c",
        LAUNCHER,
        "--standalone",
        "--nproc-per-node",
        str(spec.nprocs),
        "--monitor-interval",
        "0.2",
        "--log-dir",
        f"{sandbox.JOB_DIR}/.logs",
        "--redirects",
        "3",
        entry,
        "--data-dir",
        "data",
        "--out",
        "model.pt",
    ]
    minors, visible = (
        (None, "")
        if gpus is None
        else sandbox.gpu_binding(gpus, _cuda_uuids(), cuda_visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
    )
    env = {
        "PYTHONPATH": f"{PROBE_SITE}:{ROOT}",
        "PYTHONSAFEPATH": "1",
        "DATA_DIR": f"{sandbox.JOB_DIR}/data",
        sandbox.SYS_PATH_VAR: os.pathsep.join(imports["path"]),
        "CUDA_VISIBLE_DEVICES": visible,
    }
    limits = limits_for(spec)
    launcher_log = job / "launcher.log"  # grader-owned: the job's stdout/stderr
    res = sandbox.run(
        cmd,
        job_dir=work,
        log_path=launcher_log,
        env=env,
        budget_s=spec.time_budget_s,
        limits=limits,
        tool=iso["tool"],
        gpus=minors,
        channel=True,
        name=job.name,
        extra_ro=imports["bind"],
    )
    cg_desc = next((s.cgroup for s in res.seen if s.cgroup and "grader-" in s.cgroup), "")
    report["isolation"] = sandbox.isolation_summary(iso, res.cgroup, limits, spec.device)
    report["resources"] = {
        "processes_seen": len(res.seen),
        "outside_job_cgroup": res.cgroup_escapes[:5],
        "cgroup": _cgroup_line(cg_desc),
        "cgroup_limits": (res.cgroup or {}).get("applied", []),
        "rank_rlimits": res.rlimits,
    }
    report["time_s"] = round(res.wall_s, 3)
    report["exit_code"] = res.returncode
    report["timed_out"] = res.timed_out
    report["workers_seen"] = len({w.env_rank for w in res.workers})
    report["leftover_processes"] = res.leftovers + res.remaining
    # From here on no process of the job exists: what it left can be read without races.
    logs = rank_logs(work, spec.nprocs)
    logs["launcher"] = printable(
        (read_job_file(job, launcher_log, LOG_TAIL_BYTES, tail=True) or b"")
        .decode(errors="replace")
        .replace("\r", "\n")
    )
    report["logs"] = logs
    return res, logs


def judge_run(res: sandbox.RunResult, logs: dict, spec: Spec, report: dict) -> None:
    """Reasons from how the job ended: a timeout, a crash (with the rank's own message) or a
    file over its size limit, processes left running."""
    reasons = report["reasons"]
    limit_hit = (
        any(
            "File too large" in (v.get("stderr", "") + v.get("stdout", ""))
            for k, v in logs.items()
            if isinstance(v, dict)
        )
        or "File too large" in logs["launcher"]
    )
    if res.timed_out:
        reasons.append(
            _reason(
                "timeout",
                f"still running after the {spec.time_budget_s:g} s budget "
                "(launch to exit, measured by the grader): all its processes were killed",
            )
        )
        if limit_hit:  # a rank's write failed before the budget ran out: that is the cause to fix first
            reasons.append(
                _reason(
                    "output_limit",
                    f"a file (a log or the model) grew past the {spec.max_output_mb} MiB limit and the write failed",
                )
            )
    elif res.returncode != 0:
        rank, err = failing_rank(logs["launcher"], logs)
        detail = (
            f"rank {rank}: {err}"
            if rank is not None and err
            else (
                rank_error(logs["launcher"]) or f"no error message; see the launcher log (exit code {res.returncode})"
            )
        )
        report["error_excerpt"] = detail
        if limit_hit:
            reasons.append(
                _reason(
                    "output_limit",
                    f"a file (a log or the model) grew past the "
                    f"{spec.max_output_mb} MiB limit and the write failed: {detail}",
                )
            )
        else:
            reasons.append(_reason("crashed", f"exit code {res.returncode}: {detail}"))
    if res.stragglers or res.leftovers or res.remaining:
        n = len(res.stragglers) or len(res.leftovers) or len(res.remaining)
        reasons.append(
            _reason(
                "background_processes",
                f"{n} process(es) were still running after the "
                f"submission exited ({', '.join((res.stragglers or res.leftovers)[:2])[:160]}); "
                "the grader killed them: wait for (join) every process you start",
            )
        )


def _evaluate_weights(job: Path, work: Path, spec: Spec, heldout, res, report: dict) -> str | None:
    """Load the saved model.pt safely (a grader-owned copy) and measure its held-out accuracy.
    Returns the fingerprint of the weights, or None when there are none to grade."""
    reasons = report["reasons"]
    model = read_job_file(work, work / "model.pt", (spec.max_output_mb << 20) + 1)
    saved_print = None
    if model is None:
        if not res.timed_out and res.returncode == 0:
            if (work / "model.pt").is_symlink() or (work / "model.pt").exists():
                reasons.append(
                    _reason(
                        "bad_checkpoint",
                        "model.pt must be a regular file written by torch.save (not a link, a pipe or a folder)",
                    )
                )
            else:
                reasons.append(
                    _reason(
                        "no_output",
                        "the script exited without writing model.pt: save "
                        "model.state_dict() to the path given by --out (from rank 0)",
                    )
                )
    else:
        own = job / "grader"  # grader-owned copy: what is checked is what is loaded
        own.mkdir(mode=0o700, exist_ok=True)
        copy = own / "model.pt"  # (named as the student wrote it, for the messages)
        copy.write_bytes(model)
        try:
            sd = weights.load_state_dict(copy, spec.max_output_mb << 20)
            device = "cuda" if spec.device == "cuda" and torch.cuda.is_available() else "cpu"
            report["accuracy"] = round(weights.evaluate(spec, sd, heldout, device), 5)
            saved_print = weights.fingerprint(sd)
        except weights.CheckpointRejected as e:
            reasons.append(_reason(e.code, str(e)))
    return saved_print


def _check_learned_under_ddp(evidence: dict, graded, job: Path, spec: Spec, heldout, report: dict) -> None:
    """Evaluate the weights DDP started from: most of the learning must happen under DDP."""
    wrapped = evidence.pop("_wrapped_weights", {}).get(graded or 0)
    if wrapped and report["accuracy"] is not None:
        (job / "grader").mkdir(mode=0o700, exist_ok=True)
        copy = job / "grader" / "weights-ddp-wrapped.pt"
        copy.write_bytes(wrapped[: (spec.max_output_mb << 20) + 1])
        try:
            device = "cuda" if spec.device == "cuda" and torch.cuda.is_available() else "cpu"
            acc0 = weights.evaluate(spec, weights.load_state_dict(copy, spec.max_output_mb << 20), heldout, device)
            evidence["accuracy_when_ddp_wrapped"] = round(acc0, 5)
            chance = 1.0 / max(2, int(heldout.tensors[1].max()) + 1)
            if report["accuracy"] - acc0 < 0.5 * (report["accuracy"] - chance) and report["data_parallel"]:
                evidence["problems"].insert(
                    0,
                    f"the model already had held-out accuracy {acc0:.4f} when "
                    "DistributedDataParallel wrapped it: most of the training must "
                    "happen under DDP, on every rank",
                )
                evidence["data_parallel"] = report["data_parallel"] = False
        except weights.CheckpointRejected:
            evidence["problems"].append("the weights DDP wrapped could not be read")


def judge_result(res: sandbox.RunResult, evidence: dict, weight_reasons: list, spec: Spec, report: dict) -> None:
    """Reasons from what the run achieved: accuracy, time, ranks that joined, data parallelism and
    the graded weights (a crash is reported alone: it is the thing to fix first)."""
    reasons = report["reasons"]
    if report["accuracy"] is not None and report["accuracy"] < spec.target_val_acc:
        reasons.append(
            _reason(
                "accuracy",
                f"held-out accuracy {report['accuracy']:.4f} is below the target "
                f"{spec.target_val_acc} (measured by the grader on data the script never had)",
            )
        )
    if not res.timed_out and res.wall_s > spec.time_budget_s:
        reasons.append(_reason("time", f"took {res.wall_s:.1f} s, over the {spec.time_budget_s:g} s budget"))
    if res.timed_out or res.returncode != 0:
        return  # the crash is the thing to fix first
    if report["ranks_measured"] < spec.nprocs:
        why = (
            " (the script never called torch.distributed.init_process_group)"
            if report["ranks_measured"] == 0 and not evidence["problems"]
            else f" ({'; '.join(evidence['problems'][:2])})"
            if evidence["problems"]
            else ""
        )
        reasons.append(
            _reason(
                "not_distributed",
                f"{report['ranks_measured']} of {spec.nprocs} ranks joined "
                f"the process group, measured by the grader{why}: run as one data-parallel "
                f"job over {spec.nprocs} processes",
            )
        )
    elif not report["data_parallel"]:
        reasons.append(
            _reason(
                "not_data_parallel",
                f"not data-parallel training: {evidence['problems'][0]}. "
                "Wrap the model in DistributedDataParallel and give each rank its own shard",
            )
        )
    if report["ranks_measured"] == spec.nprocs:
        reasons.extend(_reason(code, message) for code, message in weight_reasons)


def _cuda_uuids() -> list[str] | None:
    """The UUID of each of this process's CUDA devices, as torch numbers them (None without CUDA)."""
    try:
        if not torch.cuda.is_available():
            return None
        out = []
        for i in range(torch.cuda.device_count()):
            u = str(torch.cuda.get_device_properties(i).uuid)
            out.append(u if u.startswith(("GPU-", "MIG-")) else f"GPU-{u}")
        return out
    except Exception:  # an older torch, or no UUID: the driver's table decides
        return None


def _cgroup_line(text: str) -> str:
    lines = [l for l in text.splitlines() if "grader-" in l]
    return lines[0][:120] if lines else ""


def write_json(report: dict, path: str | Path) -> None:
    atomic_write_json(path, report)
