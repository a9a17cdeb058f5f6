"""The assessment grader: ``python -m utils.grader run|batch|calibrate`` (see labs/assessment/README.md).

A submission runs under ``torchrun --standalone --nproc-per-node N`` in a fresh directory, in
its own session (and, where the OS allows, its own PID and network namespaces), with only the
training split; the grader measures its time, the ranks that really joined the process group,
and, in its own process, the accuracy of the state dict it wrote on held-out data.

    from utils.grader import load_spec, grade
    report = grade("student.py", load_spec("labs/assessment/spec_ci.toml"))
"""
from .spec import Spec, SpecError, load_spec, default_spec_path
from .core import grade, write_json
from .static import check_source

__all__ = ["Spec", "SpecError", "load_spec", "default_spec_path", "grade", "write_json", "check_source"]
