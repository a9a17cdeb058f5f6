"""What the sandbox gives a job from outside: the grader's whole import path (a .pth file's folder,
the user site, PYTHONPATH), and the GPUs it was handed, by device minor and by the names CUDA
will enumerate inside.

Oracles: a second virtual environment whose packages come only through a .pth file, in which the
reference solution must grade `passed` (a sandbox that binds only site-packages fails every
submission there with "No module named 'torch'"); a hand-written NVIDIA driver table (/proc/driver/nvidia/gpus) in which
CUDA indices, PCI order and device minors all differ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from utils.grader import sandbox
from utils.grader.spec import REFERENCE_SOLUTION, ROOT

CI_SPEC = ROOT / "labs" / "assessment" / "spec_ci.toml"
SITE = sysconfig.get_paths()["purelib"]


# ----------------------------------------------------------------------------------------
# The import path
# ----------------------------------------------------------------------------------------


def test_import_path_binds_package_folders_and_nothing_that_holds_secrets(tmp_path, monkeypatch):
    pkgs, private, proj_pkgs = tmp_path / "pkgs", tmp_path / "private", ROOT / "solutions"
    for d in (pkgs, private / "lib"):
        d.mkdir(parents=True)
    spec = private / "spec.toml"
    spec.write_text("heldout_seed = 1\n")
    home = os.path.expanduser("~")
    monkeypatch.setattr(
        sys,
        "path",
        [
            sys.path[0],
            str(pkgs),
            str(private),
            str(private / "lib"),
            str(ROOT),
            str(proj_pkgs),
            home,
            "/",
            str(tmp_path / "missing"),
            *sys.path[1:],
        ],
    )
    got = sandbox.import_path(hidden=(str(spec),))
    assert got["bind"] == [os.path.realpath(pkgs), os.path.realpath(private / "lib")], got
    for refused in (str(private), str(ROOT), str(proj_pkgs), home, "/"):
        assert refused in got["refused"], (refused, got["refused"])
    assert str(spec) in got["refused"][str(private)]
    assert got["path"].index(os.path.realpath(pkgs)) < got["path"].index(os.path.realpath(SITE))
    assert sandbox.unbound_modules(got) == []  # torch and numpy: in the venv, bound already
    # torch found only through a folder that may not be bound: refused up front, naming it
    monkeypatch.setattr(sandbox, "_python_roots", lambda: [])
    why = sandbox.unbound_modules(sandbox.import_path(hidden=(os.path.join(SITE, "heldout.npz"),)))
    assert why and why[0].startswith("torch (from ") and "it holds" in why[0], why


@pytest.mark.sandbox
@pytest.mark.slow
def test_reference_passes_in_a_venv_whose_packages_come_through_a_pth(tmp_path):
    """A venv with no packages of its own and a .pth naming this venv's site-packages: the grader
    runs from it, and so must the job (torch, numpy and the rest found through the .pth)."""
    venv = tmp_path / "pth-venv"
    subprocess.run(
        [
            sys._base_executable if hasattr(sys, "_base_executable") else sys.executable,
            "-m",
            "venv",
            "--without-pip",
            str(venv),
        ],
        check=True,
    )
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "course.pth").write_text(SITE + "\n")
    where = subprocess.run(
        [py, "-c", "import torch; print(torch.__file__)"], capture_output=True, text=True, check=True
    ).stdout
    assert where.startswith(SITE), where
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [py, "-m", "utils.grader", "run", str(REFERENCE_SOLUTION), "--spec", str(CI_SPEC), "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert r["status"] == "passed", (r["reason"], r["logs"].get("0", {}).get("stderr", "")[-800:])


# ----------------------------------------------------------------------------------------
# GPUs: CUDA indices -> device minors, and what CUDA enumerates inside
# ----------------------------------------------------------------------------------------

# The driver's table (PCI order), minors not in PCI order, as on many multi-GPU servers.
GPUS = [
    ("0000:18:00.0", "GPU-aaaaaaaa-0000-0000-0000-000000000018", 2),
    ("0000:2a:00.0", "GPU-bbbbbbbb-0000-0000-0000-00000000002a", 0),
    ("0000:3a:00.0", "GPU-cccccccc-0000-0000-0000-00000000003a", 3),
    ("0000:5d:00.0", "GPU-dddddddd-0000-0000-0000-00000000005d", 1),
]


def _fake_proc(tmp_path) -> str:
    d = tmp_path / "gpus"
    for bus, uuid, minor in GPUS:
        (d / bus).mkdir(parents=True)
        (d / bus / "information").write_text(
            f"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 123\nGPU UUID: \t {uuid}\n"
            f"Video BIOS: \t ??.??.??.??.??\n"
            f"Bus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\nBus Location: \t {bus}\n"
            f"Device Minor: \t {minor}\nGPU Excluded:\t No\n"
        )
    return str(d)


@pytest.mark.parametrize("grader_visible", [None, "3,1,2,0", "GPU-dddd,GPU-bbbb,GPU-cccc,GPU-aaaa", "torch"])
def test_gpus_2_and_3_are_bound_by_minor_and_named_as_cuda_enumerates_them(tmp_path, grader_visible):
    """The grader hands a job its CUDA indices [2, 3]. The job must get exactly those two GPUs'
    device nodes (/dev/nvidia<minor>), and a CUDA_VISIBLE_DEVICES under which CUDA, seeing only
    those nodes, numbers them 0 and 1 in that order: each exported name is the GPU whose node is
    bound at the same position, and it is the GPU the grader's CUDA calls 2, then 3."""
    table = sandbox.nvidia_gpus(_fake_proc(tmp_path))
    assert [(g["bus"], g["uuid"], g["minor"]) for g in table] == GPUS
    by_pci = [g[1] for g in GPUS]  # the grader's CUDA order, by hand:
    order = {
        None: [0, 1, 2, 3],
        "3,1,2,0": [3, 1, 2, 0],
        "GPU-dddd,GPU-bbbb,GPU-cccc,GPU-aaaa": [3, 1, 2, 0],
        "torch": [1, 3, 0, 2],
    }[grader_visible]
    grader_uuids = [by_pci[k] for k in order]  # the grader's CUDA index i is this GPU
    minor_of = {uuid: minor for _, uuid, minor in GPUS}
    if grader_visible == "torch":  # CUDA up in the grader: torch names each index
        minors, visible = sandbox.gpu_binding([2, 3], uuids=grader_uuids, table=table)
    else:
        minors, visible = sandbox.gpu_binding([2, 3], table=table, cuda_visible=grader_visible)
    inside = visible.split(",")  # CUDA inside: device j is the j-th name listed
    assert inside == grader_uuids[2:4], (visible, grader_uuids)
    assert minors == [minor_of[u] for u in inside], (minors, inside)
    assert sandbox._devices(minors) == [
        n
        for n in (
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools",
            "/dev/nvidia-modeset",
            *[f"/dev/nvidia{m}" for m in minors],
        )
        if os.path.exists(n)
    ]


def test_gpu_binding_without_the_driver_table_numbers_from_zero():
    assert sandbox.gpu_binding([2, 3], table=[]) == ([2, 3], "0,1")
    assert sandbox.visible_gpus([{"uuid": "GPU-a", "minor": 0, "bus": "x"}], "0,0") == []


def test_without_the_proc_table_nvml_gives_the_minors(tmp_path, monkeypatch):
    """Where /proc/driver/nvidia is hidden, nvidia-ml-py's minor numbers (a fake NVML here)."""
    import types

    devices = [GPUS[3], GPUS[0], GPUS[2], GPUS[1]]  # NVML may list them in any order
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(devices),
        nvmlDeviceGetHandleByIndex=lambda i: devices[i],
        nvmlDeviceGetUUID=lambda h: h[1].encode(),
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=("0000" + h[0]).upper().encode()),
        nvmlDeviceGetMinorNumber=lambda h: h[2],
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    table = sandbox.nvidia_gpus(str(tmp_path / "no-driver-table"))
    assert [(g["uuid"], g["minor"]) for g in table] == [(u, m) for _, u, m in GPUS]
    minors, visible = sandbox.gpu_binding([2, 3], table=table, cuda_visible="3,1,2,0")
    assert visible.split(",") == [GPUS[2][1], GPUS[0][1]] and minors == [GPUS[2][2], GPUS[0][2]]
