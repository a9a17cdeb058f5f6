"""The grader's probe, loaded by every Python process of a graded job (this folder is first on
the job's PYTHONPATH; without the grader's channel it does nothing).

It reports over the channel the grader created (an inherited socket fd, SCM_CREDENTIALS tells
the grader which process sent each message; nothing is written to a file):

* ``rank``: right after the submission's ``init_process_group`` returns, every rank takes part
  in one SUM all-reduce of a 1; the rank, the world size and the sum are reported.
* ``exit``: per optimizer step (a global ``torch.optim`` step hook), the digest of the gradients
  the step used, the bytes the rank all-reduced since the previous step, and the digest of what
  it contributed to those reductions. DistributedDataParallel's reductions are routed through
  ``dist.all_reduce`` (PyTorch's own default comm hook, registered at the first forward) so
  that they are counted like a hand-written all-reduce. Per DDP model, too: the training examples
  its forward took (grad enabled), and how often its parameters changed outside an optimizer
  step over them (a chain of cheap digests: at the wrap, before and after every optimizer step,
  at exit); rank 0 adds the sha256 fingerprint of each DDP model at exit.

The grader decides from these, and from what it measured itself (the worker processes, the
job's loopback traffic), whether every rank trained on its own data with gradients
synchronised every step (core.verify_ranks). A submission runs in the same processes, so it
could send messages itself: README.md says what that costs it and what the grader still checks.
"""

import os
import sys

_FD = os.environ.get("SCALING_LABS_GRADER_FD")
_SOCK = None
_STATE = {
    "rank": None,
    "ddp": [],
    "steps": [],
    "bytes": 0,
    "calls": 0,
    "inputs": [],
    "grad_bytes": 0,
    "custom_hook": False,
}
_ORIG = {}


def _send(record):
    import json

    if _SOCK is None:
        return
    try:
        _SOCK.send(json.dumps(record).encode())
    except OSError:
        pass


def _confirm(dist):
    import torch

    rank, world = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend())
    device = torch.device("cpu")
    if backend == "nccl" and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    ones = torch.ones(1, device=device)
    _ORIG["all_reduce"](ones)  # every rank must take part
    _STATE["rank"] = rank
    _send({"kind": "rank", "rank": rank, "world_size": world, "all_reduce_sum": int(ones.item()), "backend": backend})


def _note_reduce(tensors):
    import torch

    for t in tensors:
        if torch.is_tensor(t) and t.is_floating_point():
            _STATE["bytes"] += t.numel() * t.element_size()
            _STATE["inputs"].append(t.detach().double().sum())
    _STATE["calls"] += 1


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
        except Exception as e:  # never break the submission
            _send({"kind": "error", "error": repr(e)[:300]})
        return out

    for name in ("all_reduce", "all_reduce_coalesced", "reduce_scatter_tensor", "reduce_scatter"):
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        _ORIG[name] = fn

        def counted(*args, __fn=fn, **kwargs):
            try:
                first = args[0] if args else kwargs.get("tensor", kwargs.get("tensors", kwargs.get("input")))
                _note_reduce(first if isinstance(first, (list, tuple)) else [first])
            except Exception:
                pass
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
    orig_init, orig_forward, orig_register = cls.__init__, cls.forward, cls.register_comm_hook

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        self._grader_hooked = False
        self._grader_examples, self._grader_breaks, self._grader_last = 0, 0, None
        _check(self, moved=True)  # the chain starts from the weights DDP broadcast
        _STATE["ddp"].append(self)
        if len(_STATE["ddp"]) <= 4 and _STATE["rank"] == 0:
            try:
                _send_weights(self.module.state_dict(), len(_STATE["ddp"]) - 1)
            except Exception as e:
                _send({"kind": "error", "error": f"probe could not send the weights DDP wrapped: {e!r}"[:300]})

    def register_comm_hook(self, state, hook):
        self._grader_hooked = True  # a hook of the submission's: it calls dist.*
        _STATE["custom_hook"] = True
        return orig_register(self, state, hook)

    def forward(self, *args, **kwargs):
        if not getattr(self, "_grader_hooked", True):
            self._grader_hooked = True
            try:  # PyTorch's default all-reduce, through dist.all_reduce
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                orig_register(self, self.process_group, default_hooks.allreduce_hook)
            except Exception as e:
                _send({"kind": "error", "error": f"probe could not follow DDP's reductions: {e!r}"[:300]})
        import torch

        if torch.is_grad_enabled():
            self._grader_examples += _batch_size(args, kwargs)
        return orig_forward(self, *args, **kwargs)

    cls.__init__, cls.forward, cls.register_comm_hook = __init__, forward, register_comm_hook


def _digest(ddp):
    """Cheap (two ops, no host sync): the float64 sum of every parameter's values."""
    import torch

    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()]).sum(dtype=torch.float64)


def _check(ddp, moved=False):
    """Link the chain: unless ``moved`` (an optimizer step over these weights just ran), the
    weights must be those of the last link; a change counts as a break."""
    try:
        now = _digest(ddp)
        if not moved:
            ddp._grader_breaks = ddp._grader_breaks + (now != ddp._grader_last).long()
        ddp._grader_last = now
    except Exception as e:  # fail closed, and say why
        ddp._grader_breaks = ddp._grader_breaks + 1
        ddp._grader_last = None
        _send({"kind": "error", "error": f"probe could not digest the DDP model's weights: {e!r}"[:300]})


def _batch_size(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        for t in a if isinstance(a, (list, tuple)) else [a]:
            if hasattr(t, "shape") and hasattr(t, "dim"):
                return int(t.shape[0]) if t.dim() else 1
    return 0


def _send_weights(state_dict, index=0):
    """The weights as DistributedDataParallel wrapped them (rank 0), for the grader to evaluate:
    training must happen under DDP, not before it."""
    import base64
    import io

    import torch

    buf = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in state_dict.items()}, buf)
    data, chunk = buf.getvalue(), 96 << 10
    parts = (len(data) + chunk - 1) // chunk
    for i in range(parts):
        _send(
            {
                "kind": "wrap",
                "rank": 0,
                "model": index,
                "part": i,
                "parts": parts,
                "data": base64.b64encode(data[i * chunk : (i + 1) * chunk]).decode(),
            }
        )


def _patch_optim(module):
    hook = getattr(module, "register_optimizer_step_pre_hook", None)
    if hook is None:
        return

    def before_step(optimizer, args, kwargs):
        import torch

        grads, nbytes = [], 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grads.append(p.grad.detach().double().sum())
                    nbytes += p.grad.numel() * p.grad.element_size()
        zero = torch.zeros((), dtype=torch.float64)
        digest = torch.stack([g.to(zero.device) for g in grads]).sum() if grads else zero
        inputs = torch.stack([t.to(zero.device) for t in _STATE["inputs"]]).sum() if _STATE["inputs"] else zero
        _STATE["steps"].append((digest, inputs, _STATE["bytes"], _STATE["calls"]))
        _STATE["grad_bytes"] = max(_STATE["grad_bytes"], nbytes)
        _STATE["bytes"], _STATE["calls"], _STATE["inputs"] = 0, 0, []
        for ddp in _STATE["ddp"]:
            _check(ddp)

    def after_step(optimizer, args, kwargs):
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for ddp in _STATE["ddp"]:
            _check(ddp, moved=any(id(p) in owned for p in ddp.module.parameters()))

    hook(before_step)
    module.register_optimizer_step_post_hook(after_step)


def fingerprint(state_dict):
    """sha256 over each key and the bytes of its tensor (contiguous, on the CPU), keys sorted. The
    grader's weights.py imports this function: both sides hash with this one definition."""
    import hashlib

    h = hashlib.sha256()
    for k in sorted(state_dict):
        t = state_dict[k].detach().cpu().contiguous()
        h.update(str(k).encode())
        h.update(t.view(-1).view(__import__("torch").uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _at_exit():
    if _STATE["rank"] is None:
        return
    prints, models = [], []
    for model in _STATE["ddp"][:8]:
        _check(model)  # the last link: no change after the last step
        models.append([int(model._grader_examples), int(model._grader_breaks)])
        if _STATE["rank"] == 0:
            try:
                prints.append(fingerprint(model.module.state_dict()))
            except Exception:
                prints.append("")
    steps = [[float(g), float(i), int(b), int(c)] for g, i, b, c in _STATE["steps"]]
    chunk = 1000
    for start in range(0, max(len(steps), 1), chunk):
        _send(
            {
                "kind": "exit",
                "rank": _STATE["rank"],
                "first_step": start,
                "steps": steps[start : start + chunk],
                "total_steps": len(steps),
                "grad_bytes": _STATE["grad_bytes"],
                "ddp_models": len(_STATE["ddp"]),
                "ddp": models if start == 0 else [],
                "custom_hook": _STATE["custom_hook"],
                "fingerprints": prints if start == 0 else [],
            }
        )


def _pass_channel_to_children():
    """torchrun starts the ranks with subprocess.Popen(close_fds=True): keep the channel open."""
    import subprocess

    orig = subprocess.Popen.__init__

    def __init__(self, *args, **kwargs):
        if kwargs.get("close_fds", True):
            kwargs["pass_fds"] = tuple(sorted(set(kwargs.get("pass_fds") or ()) | {int(_FD)}))
        env = kwargs.get("env")
        if env is not None and "RANK" in env:  # torchrun's ranks: tell them where the channel is
            kwargs["env"] = {**env, "SCALING_LABS_GRADER_FD": _FD}
        orig(self, *args, **kwargs)

    subprocess.Popen.__init__ = __init__


_HOOKS = {
    "torch.distributed": _patch_dist,
    "torch.nn.parallel.distributed": _patch_ddp,
    "torch.optim.optimizer": _patch_optim,
}


def _install():
    import atexit
    import fcntl
    import importlib.abc
    import socket

    global _SOCK, _FD
    # Out of the way of a casual look: moved to a high fd, the variable removed from this
    # process's environment (children get it back from the Popen patch). Not a secret from code
    # that lists /proc/self/fd: see utils/grader/README.md.
    try:
        high = fcntl.fcntl(int(_FD), fcntl.F_DUPFD_CLOEXEC, 900)
        os.close(int(_FD))
        _FD = str(high)
    except OSError:  # a low RLIMIT_NOFILE: stay where it is
        high = int(_FD)
    _SOCK = socket.socket(fileno=high)
    os.set_inheritable(high, True)
    os.environ.pop("SCALING_LABS_GRADER_FD", None)

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
                    _send({"kind": "error", "error": f"probe patch of {name}: {e!r}"[:300]})

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
    atexit.register(_at_exit)
    _pass_channel_to_children()


def _import_path():
    """The grader's import path in the job, in the grader's order: the folders that the sandbox
    bound read-only for it (a .pth file's, the user site, PYTHONPATH: sandbox.import_path)."""
    want = [p for p in os.environ.get("SCALING_LABS_SYS_PATH", "").split(os.pathsep) if p]
    have = [os.path.realpath(p) if p else p for p in sys.path]
    pos = next((i for i, p in enumerate(have) if p in want), len(sys.path))
    for p in want:
        if p in have:
            pos = have.index(p) + 1
        elif os.path.exists(p):
            sys.path.insert(pos, p)
            have.insert(pos, p)
            pos += 1


if __name__ == "sitecustomize":  # loaded by a job's Python; the grader imports it only for fingerprint
    _import_path()
    if _FD:
        try:
            _install()
        except (OSError, ValueError):
            pass
