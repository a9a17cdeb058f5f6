"""The assessment spec: one TOML file an instructor edits (see labs/assessment/spec_*.toml)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SPEC_DIR = ROOT / "labs" / "assessment"
REFERENCE_SOLUTION = ROOT / "solutions" / "assessment" / "assessment.py"
SERIAL_SCRIPT = SPEC_DIR / "assessment.py"
CALIBRATE_REPEATS = 3  # `calibrate`: runs of each kind (one process, nprocs processes)
CALIBRATE_MARGIN = 1.2  # `calibrate`: how far the budget sits from each kind's worst run, as a factor


class SpecError(ValueError):
    """The spec file is missing, malformed, or holds an unknown or invalid field."""


@dataclass(frozen=True)
class Spec:
    name: str
    dataset: str
    target_val_acc: float
    time_budget_s: float
    nprocs: int
    calibrated_on: str = ""  # what `python -m utils.grader calibrate` measured; "" = time_budget_s is not measured
    model: str = "net"
    model_kwargs: dict = field(default_factory=dict)
    n_train: int = 0  # 0 = the whole training split
    n_val: int = 0  # 0 = the dataset's whole held-out split
    device: str = "cpu"  # cpu | cuda
    heldout: str = "val"  # "val" | "secret_split" | a path to an .npz (x, y)
    heldout_seed: int = 0  # secret_split: the secret seed (never leaves the grader)
    data_dir: str = ""  # dataset cache ("" = utils.data default)
    max_output_mb: int = 512  # RLIMIT_FSIZE of the submission's processes
    max_memory_mb: int = 4096  # the job's memory (cgroup; RLIMIT_AS per process on the CPU)
    max_processes: int = 1024  # processes and threads of the job (pids.max, RLIMIT_NPROC)
    max_submission_kb: int = 20480  # a larger submission is refused unrun
    points: float = 100.0
    seed: int = 0  # subset seed for n_train / n_val
    path: str = ""  # the file this came from (filled in by load_spec)

    def replace(self, **changes) -> Spec:
        return dataclasses.replace(self, **changes)

    def public(self) -> dict:
        """What the submission is told (written to its data dir as assessment.json)."""
        return {
            "name": self.name,
            "dataset": self.dataset,
            "model": self.model,
            "model_kwargs": dict(self.model_kwargs),
            "target_val_acc": self.target_val_acc,
            "time_budget_s": self.time_budget_s,
            "nprocs": self.nprocs,
            "device": self.device,
        }

    def as_dict(self) -> dict:
        """Every field but the secret (for reports a student may see)."""
        d = dataclasses.asdict(self)
        d["heldout_seed"] = "(secret)" if self.heldout_seed else 0
        return d

    def budget_note(self) -> str | None:
        """A line for every report while the budget has not been calibrated (None once it has)."""
        if self.calibrated_on:
            return None
        return (
            f"time budget: {self.time_budget_s:g} s was not calibrated against a one-process run on this "
            "hardware, so it stops hangs, not one-process scripts. Try (instructor): python -m utils.grader calibrate"
        )

    def secret_missing(self) -> str | None:
        """Why this spec cannot be graded yet (a secret split without its secret), or None."""
        if self.heldout == "secret_split" and not self.heldout_seed:
            return (
                f"{self.path or 'the spec'} draws the held-out set with a secret seed, and "
                "heldout_seed is not set: put a secret in YOUR copy of the spec (python -c "
                "'import secrets; print(secrets.randbits(62))'), outside the repository"
            )
        return None


_FIELDS = {f.name: f for f in dataclasses.fields(Spec) if f.name != "path"}
_REQUIRED = [
    n for n, f in _FIELDS.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
]


def default_spec_path() -> Path:
    """spec_gpu.toml for the gpu profile, else spec_ci.toml (LAB_PROFILE, as everywhere)."""
    from utils.config import default_profile_name

    return SPEC_DIR / ("spec_gpu.toml" if default_profile_name() == "gpu" else "spec_ci.toml")


def validate(spec: Spec) -> Spec:
    problems = []
    from utils.data import DATASETS

    if spec.dataset not in DATASETS:
        problems.append(f"dataset {spec.dataset!r} is not one of {', '.join(DATASETS)}")
    if spec.model not in ("net", "resnet9", "linear"):
        problems.append(f"model {spec.model!r} is not one of net, resnet9, linear (utils.models.build)")
    if not 0.0 < spec.target_val_acc <= 1.0:
        problems.append(f"target_val_acc must be in (0, 1], got {spec.target_val_acc}")
    if not isinstance(spec.calibrated_on, str):
        problems.append("calibrated_on must be a string: the line `python -m utils.grader calibrate` prints")
    if not spec.time_budget_s > 0:
        problems.append(f"time_budget_s must be > 0, got {spec.time_budget_s}")
    if not (isinstance(spec.nprocs, int) and spec.nprocs >= 1):
        problems.append(f"nprocs must be an integer >= 1, got {spec.nprocs!r}")
    if spec.device not in ("cpu", "cuda"):
        problems.append(f"device must be 'cpu' or 'cuda', got {spec.device!r}")
    if spec.max_output_mb < 1:
        problems.append("max_output_mb must be >= 1")
    if spec.heldout not in ("val", "secret_split") and not spec.heldout.endswith(".npz"):
        problems.append(f"heldout must be 'val', 'secret_split' or a path to an .npz, got {spec.heldout!r}")
    if not isinstance(spec.heldout_seed, int) or spec.heldout_seed < 0:
        problems.append("heldout_seed must be an integer >= 0")
    for name in ("max_memory_mb", "max_processes", "max_submission_kb"):
        if not (isinstance(getattr(spec, name), int) and getattr(spec, name) >= 1):
            problems.append(f"{name} must be an integer >= 1")
    if problems:
        raise SpecError(f"{spec.path or 'spec'}: " + "; ".join(problems))
    return spec


def load_spec(path: str | os.PathLike | None = None, **overrides) -> Spec:
    """Read and validate a spec file (default: :func:`default_spec_path`). ``overrides``
    replace fields (e.g. ``time_budget_s=5`` in tests); unknown fields are errors."""
    path = Path(path) if path else default_spec_path()
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"spec file {path} not found; the examples are in {SPEC_DIR}") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{path} is not valid TOML: {e}") from None
    table = raw.get("assessment")
    if not isinstance(table, dict):
        raise SpecError(f"{path}: needs an [assessment] table (see {SPEC_DIR / 'spec_ci.toml'})")
    table = {**table, **overrides}
    unknown = sorted(set(table) - set(_FIELDS))
    if unknown:
        raise SpecError(f"{path}: unknown field(s) {', '.join(unknown)}; known: {', '.join(_FIELDS)}")
    missing = [k for k in _REQUIRED if k not in table]
    if missing:
        raise SpecError(f"{path}: missing field(s) {', '.join(missing)}")
    heldout = str(table.get("heldout", "val"))
    if heldout not in ("val", "secret_split") and not os.path.isabs(heldout):
        table["heldout"] = str((path.parent / heldout).resolve())
    try:
        spec = Spec(**table, path=str(path))
    except TypeError as e:
        raise SpecError(f"{path}: {e}") from None
    return validate(spec)
