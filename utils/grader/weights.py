"""Loading a submission's model file safely, checking it strictly, evaluating it.

Runs in the grader's own process on a file the submission wrote, so it trusts nothing: the size
is bounded, the archive is inspected before torch reads it (no compressed members: no zip
bombs), ``torch.load(weights_only=True)`` refuses any pickled object that is not a tensor or a
plain container (a checkpoint that would run code when loaded is refused, never run), and the
keys, shapes and values must match the instructor's model exactly.
"""

from __future__ import annotations

import math
import zipfile
from pathlib import Path

import torch

# The probe's own fingerprint: the job's rank 0 and the grader hash weights with one definition. The
# probe keeps to torch and the standard library: importing this package from it would load the
# whole grader (its __init__: core, sandbox) into every rank of every graded job.
from ._probe.sitecustomize import fingerprint as fingerprint
from .spec import Spec


class CheckpointRejected(Exception):
    """The model file cannot be graded; ``code`` says why in one word, the message in words."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def inspect_archive(path: Path, max_bytes: int) -> None:
    if path.is_symlink() or not path.is_file():
        raise CheckpointRejected(
            "bad_checkpoint",
            f"{path.name} must be a regular file written by torch.save (not a link, a pipe or a folder)",
        )
    size = path.stat().st_size
    if size > max_bytes:
        raise CheckpointRejected(
            "too_large",
            f"{path.name} is {size / 2**20:.0f} MiB, over the "
            f"{max_bytes / 2**20:.0f} MiB limit: save only model.state_dict()",
        )
    if size == 0:
        raise CheckpointRejected("bad_checkpoint", f"{path.name} is empty: the save did not finish")
    if not zipfile.is_zipfile(path):
        raise CheckpointRejected(
            "bad_checkpoint",
            f"{path.name} is not a torch.save archive (a zip file): save with torch.save(model.state_dict(), path)",
        )
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise CheckpointRejected("bad_checkpoint", f"{path.name} is a damaged archive: {e}") from None
    if any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        raise CheckpointRejected(
            "bad_checkpoint",
            f"{path.name} has compressed members; torch.save "
            "never writes those (refused: it could expand without bound)",
        )
    if sum(i.file_size for i in infos) > max_bytes:
        raise CheckpointRejected("too_large", f"{path.name} claims more than {max_bytes / 2**20:.0f} MiB")


def load_state_dict(path: Path, max_bytes: int) -> dict:
    """The submission's state dict, loaded with ``weights_only=True`` after :func:`inspect_archive`."""
    inspect_archive(path, max_bytes)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError and anything a crafted file causes
        msg = str(e).strip().splitlines()
        detail = next(
            (l.strip() for l in msg if "Unsupported global" in l or "GLOBAL" in l), msg[0] if msg else type(e).__name__
        )
        raise CheckpointRejected(
            "unsafe_checkpoint" if "weights_only" in str(e) or "global" in str(e).lower() else "bad_checkpoint",
            f"{path.name} was refused by torch.load(weights_only=True) and NOT executed: {detail[:300]}. "
            "It holds Python objects other than tensors: save model.state_dict() (not the model, "
            "not an optimizer or a custom class) with torch.save",
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointRejected(
            "bad_checkpoint", f"{path.name} holds a {type(obj).__name__}, not a state dict: save model.state_dict()"
        )
    if (
        "state_dict" in obj
        and isinstance(obj["state_dict"], dict)
        and not any(torch.is_tensor(v) for v in obj.values())
    ):
        raise CheckpointRejected(
            "wrong_keys",
            f"{path.name} holds a dict with a 'state_dict' entry; "
            "save model.state_dict() itself, not a wrapper around it",
        )
    return obj


def check_against(model: torch.nn.Module, sd: dict) -> None:
    """Strict keys, shapes, dtypes and finite values, with a message that says what to fix."""
    bad_types = [k for k, v in sd.items() if not torch.is_tensor(v)]
    if bad_types:
        raise CheckpointRejected("wrong_keys", f"entries that are not tensors: {', '.join(map(str, bad_types[:5]))}")
    expected = model.state_dict()
    got, want = set(sd), set(expected)
    if got != want:
        prefixes = [p for p in ("module.", "_orig_mod.") if all(str(k).startswith(p) for k in got)]
        if prefixes:
            raise CheckpointRejected(
                "wrong_keys",
                f"every key starts with {prefixes[0]!r}: you saved "
                "the wrapper's state dict; save model.module.state_dict() (DDP) "
                "or the unwrapped model's",
            )
        missing, unexpected = sorted(want - got, key=str), sorted(got - want, key=str)  # keys may be any type
        raise CheckpointRejected(
            "wrong_keys",
            "the keys do not match the assessment's model "
            f"({type(model).__name__}): missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}; keep the model as the "
            "serial script builds it",
        )
    shapes = [
        f"{k}: {tuple(sd[k].shape)} != {tuple(v.shape)}"
        for k, v in expected.items()
        if tuple(sd[k].shape) != tuple(v.shape)
    ]
    if shapes:
        raise CheckpointRejected(
            "wrong_shapes",
            "tensor shapes differ from the assessment's model: "
            + "; ".join(shapes[:4])
            + "; keep the model as the serial script builds it",
        )
    dtypes = [k for k, v in expected.items() if v.is_floating_point() != sd[k].is_floating_point()]
    if dtypes:
        raise CheckpointRejected("wrong_shapes", f"wrong dtype for {', '.join(dtypes[:4])}")
    nonfinite = [k for k, v in sd.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if nonfinite:
        raise CheckpointRejected(
            "nan_weights",
            f"weights with NaN or inf in {', '.join(nonfinite[:5])}: "
            "training diverged (learning rate too high for the batch? warmup?)",
        )


def evaluate(spec: Spec, sd: dict, heldout: torch.utils.data.TensorDataset, device: str = "cpu") -> float:
    """Accuracy of ``sd`` in the instructor's model on ``heldout`` (a TensorDataset)."""
    import utils.data
    import utils.train

    model = utils.models.build(spec.model, tuple(heldout.tensors[0].shape[1:]), **dict(spec.model_kwargs))
    check_against(model, sd)
    model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in sd.items()}, strict=True)
    model.to(device)
    loader = utils.data.make_loader(heldout, 1024, shuffle=False, device=device)
    acc = utils.train.evaluate(model, loader)["acc"]
    if acc is None or not math.isfinite(acc):
        raise CheckpointRejected("nan_weights", "the model's outputs are not finite on the held-out data")
    return float(acc)
