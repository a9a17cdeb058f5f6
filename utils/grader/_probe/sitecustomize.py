"""The grader's probe, loaded by every Python process of a submission (this folder is first on
PYTHONPATH while it is graded; it does nothing anywhere else).

It imports nothing heavy. When the submission imports ``torch.distributed`` it wraps
``init_process_group``: after the real call returns, every rank takes part in one SUM
all-reduce of a 1 and writes, into the grader's folder, the rank, the world size and the sum
the collective returned, with its process id and start time so that the grader can match the
record with a worker process it saw itself. It also counts the collectives a rank issues after
that and the iterations of any DistributedDataParallel model (written at exit): the evidence
that training was data-parallel. The grader never trusts these records alone (see
utils/grader/core.py for the cross-checks, and README.md for what a determined adversary can
still do).
"""
import os
import sys

_DIR = os.environ.get("SCALING_LABS_GRADER_PROBE")


def _stat():
    """(pid, start time in clock ticks) as the /proc the grader reads sees them."""
    try:
        with open("/proc/self/stat") as f:
            raw = f.read()
        rest = raw[raw.rindex(")") + 2:].split()
        return int(raw.split(None, 1)[0]), int(rest[19])
    except (OSError, ValueError, IndexError):
        return os.getpid(), -1


def _write(name, record):
    import json
    path = os.path.join(_DIR, name)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError:
        pass


_STATE = {"rank": None, "collectives": 0, "ddp": []}


def _confirm(dist):
    import torch
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend())
    device = torch.device("cpu")
    if backend == "nccl" and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    ones = torch.ones(1, device=device)
    _ORIG["all_reduce"](ones)                              # every rank must take part
    pid, start = _stat()
    _STATE["rank"] = rank
    _write(f"rank{rank}.{pid}.json", {
        "rank": rank, "world_size": world, "all_reduce_sum": int(ones.item()), "backend": backend,
        "pid": pid, "ns_pid": os.getpid(), "start_ticks": start,
        "env_rank": os.environ.get("RANK"), "env_world_size": os.environ.get("WORLD_SIZE"),
        "local_rank": os.environ.get("LOCAL_RANK")})


_ORIG = {}


def _patch_dist(dist):
    if not hasattr(dist, "init_process_group"):
        return
    import functools
    from torch.distributed import distributed_c10d as c10d

    orig_init = dist.init_process_group

    @functools.wraps(orig_init)
    def init_process_group(*args, **kwargs):
        out = orig_init(*args, **kwargs)
        try:
            _confirm(dist)
        except Exception as e:                               # never break the submission
            _write(f"error.{os.getpid()}.json", {"error": repr(e)})
        return out

    for name in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor",
                 "all_reduce_coalesced"):
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        _ORIG[name] = fn

        def counted(*args, __fn=fn, **kwargs):
            _STATE["collectives"] += 1
            return __fn(*args, **kwargs)

        functools.update_wrapper(counted, fn)
        setattr(dist, name, counted)
        setattr(c10d, name, counted)
    dist.init_process_group = init_process_group
    c10d.init_process_group = init_process_group


def _patch_ddp(module):
    cls = getattr(module, "DistributedDataParallel", None)
    if cls is None:
        return
    orig = cls.__init__

    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        _STATE["ddp"].append(self)

    cls.__init__ = __init__


def fingerprint(state_dict):
    """sha256 over the bytes of every tensor, keys sorted (the grader computes the same)."""
    import hashlib
    h = hashlib.sha256()
    for k in sorted(state_dict):
        t = state_dict[k].detach().cpu().contiguous()
        h.update(k.encode())
        h.update(t.view(-1).view(__import__("torch").uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _at_exit():
    if _STATE["rank"] is None:
        return
    iterations, prints = 0, []
    for model in _STATE["ddp"]:
        try:
            iterations = max(iterations, int(model._get_ddp_logging_data().get("iteration", 0)))
            if _STATE["rank"] == 0:
                prints.append(fingerprint(model.module.state_dict()))
        except Exception:
            pass
    pid, start = _stat()
    _write(f"exit{_STATE['rank']}.{pid}.json", {
        "rank": _STATE["rank"], "pid": pid, "start_ticks": start, "collectives": _STATE["collectives"],
        "ddp_models": len(_STATE["ddp"]), "ddp_iterations": iterations, "fingerprints": prints})


_HOOKS = {"torch.distributed": _patch_dist, "torch.nn.parallel.distributed": _patch_ddp}


def _install():
    import atexit
    import importlib.abc

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            hook = _HOOKS.get(name)
            if hook is None:
                return None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
            loader = spec.loader
            real_exec = loader.exec_module

            def exec_module(module):
                real_exec(module)
                try:
                    hook(module)
                except Exception as e:
                    _write(f"error.{os.getpid()}.json", {"error": f"probe patch of {name}: {e!r}"})

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
    atexit.register(_at_exit)


if _DIR:
    _install()
