"""The assessment grader: ``python -m utils.grader run|batch|gradescope|zip|calibrate|data``.

A submission runs under ``torchrun --standalone --nproc-per-node N`` in a sandbox of its own
(bubblewrap, or unshare: user, PID, IPC, UTS, mount and network namespaces; read-only system
and project; a private job dir and tmpfs; cleared environment; cgroup and rlimits), with only
the training split. The grader measures its time, verifies over a channel it owns that every
rank trained with synchronised gradients, and evaluates the saved state dict in its own
process on held-out data. Threat model and limits: utils/grader/README.md.

    from utils.grader import load_spec, grade
    report = grade("student.py", load_spec("labs/assessment/spec_ci.toml"))
"""

from .core import grade, write_json
from .spec import Spec, SpecError, default_spec_path, load_spec
from .static import check_source

__all__ = ["Spec", "SpecError", "load_spec", "default_spec_path", "grade", "write_json", "check_source"]
