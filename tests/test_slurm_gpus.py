"""How many workers assets/slurm/train.sbatch starts per node: the GPUs of the job's own allocation
(SLURM_GPUS_ON_NODE, then CUDA_VISIBLE_DEVICES), and only then the GPUs nvidia-smi lists, its "GPU n:" lines and
not the "MIG ..." lines under them. Run under bash with a stand-in nvidia-smi; no training starts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "assets" / "slurm" / "train.sbatch"
BASH = shutil.which("bash")

# `nvidia-smi -L` on a node with three GPUs, two of them split into MIG slices (the driver indents the MIG lines).
SMI_L = """GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77)
  MIG 3g.20gb     Device  0: (UUID: MIG-aa232436-d5a6-5e39-b527-16f9b223cc46)
  MIG 3g.20gb     Device  1: (UUID: MIG-3b12da37-7fa2-596c-8655-62dab88f0b64)
GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-0aa11ebd-627f-af3f-1a0d-4e1fd92fd7b0)
  MIG 7g.40gb     Device  0: (UUID: MIG-3e209540-03e2-5edb-8798-51d4967218c9)
GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-c08d91cb-e324-655c-71ba-7570956445bc)
"""
FAILED = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"


def bin_dir(tmp_path: Path, smi: str | None, smi_rc: int = 0, tools=("grep", "hostname", "head")) -> Path:
    """A PATH of its own: the few tools the script uses, and an nvidia-smi that prints `smi` (none if None)."""
    d = tmp_path / "bin"
    d.mkdir()
    for tool in tools:
        (d / tool).symlink_to(shutil.which(tool))
    if smi is not None:
        (tmp_path / "smi-L.txt").write_text(smi)
        (d / "nvidia-smi").write_text(
            f'#!{BASH}\n[[ $1 == -L ]] && printf "%s\\n" "$(< {tmp_path}/smi-L.txt)"\nexit {smi_rc}\n'
        )
        (d / "nvidia-smi").chmod(0o755)
    return d


def gpus_per_node(tmp_path: Path, smi: str | None = SMI_L, smi_rc: int = 0, **env: str):
    """The script's count, with only `env` set of the variables it reads: (exit status, stdout, stderr)."""
    environ = {"PATH": str(bin_dir(tmp_path, smi, smi_rc)), "HOME": str(tmp_path), **env}
    proc = subprocess.run(
        [BASH, "-c", 'source "$1" && gpus_per_node', "bash", str(SBATCH)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, proc.stdout.strip(), proc.stderr


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, "3"),  # nvidia-smi's GPU lines, not its 6 lines
        ({"SLURM_GPUS_ON_NODE": "2"}, "2"),  # the job's share of the node, not every GPU on it
        ({"SLURM_GPUS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "2"),
        ({"CUDA_VISIBLE_DEVICES": "0,2"}, "2"),
        ({"CUDA_VISIBLE_DEVICES": "MIG-aa232436-d5a6-5e39-b527-16f9b223cc46"}, "1"),
        ({"CUDA_VISIBLE_DEVICES": "GPU-5d5ba0d6,GPU-0aa11ebd,GPU-c08d91cb"}, "3"),
        ({"GPUS_PER_NODE": "5", "SLURM_GPUS_ON_NODE": "2"}, "5"),  # the override wins
    ],
)
def test_the_workers_per_node_are_the_jobs_gpus(tmp_path, env, expected):
    rc, out, err = gpus_per_node(tmp_path, **env)
    assert (rc, out) == (0, expected), err


def test_mig_lines_are_not_gpus_even_unindented(tmp_path):
    """NVIDIA's MIG guide prints the MIG lines flush left: still not GPUs."""
    rc, out, err = gpus_per_node(tmp_path, smi="\n".join(line.strip() for line in SMI_L.splitlines()) + "\n")
    assert (rc, out) == (0, "3"), err


@pytest.mark.parametrize(
    "smi, smi_rc, env",
    [
        (SMI_L, 0, {"CUDA_VISIBLE_DEVICES": ""}),  # set and empty: CUDA sees no GPU
        (SMI_L, 0, {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}),  # Slurm's value when the job has no GPU
        (SMI_L, 0, {"SLURM_GPUS_ON_NODE": "0"}),
        (FAILED, 9, {}),  # no driver: nvidia-smi's message is not a GPU
        (None, 0, {}),  # no nvidia-smi at all
    ],
)
def test_no_gpus_stop_the_job_with_a_message(tmp_path, smi, smi_rc, env):
    rc, out, err = gpus_per_node(tmp_path, smi=smi, smi_rc=smi_rc, **env)
    assert rc != 0 and out == "", out
    assert "found no GPUs for this job" in err and "GPUS_PER_NODE" in err


def test_the_job_starts_torchrun_with_that_count(tmp_path):
    """The whole script, as sbatch runs it (a copy in its spool directory, from the submit directory), with srun,
    scontrol and uv stand-ins: torchrun gets --nproc-per-node=3 on the node above, not the 6 lines of nvidia-smi -L."""
    d = bin_dir(tmp_path, SMI_L)
    stubs = {
        "srun": 'while [[ $1 == -* ]]; do shift; done\nexec "$@"',
        "scontrol": "echo node1",
        "uv": 'echo "uv $*"',
    }
    for name, body in stubs.items():
        (d / name).write_text(f"#!{BASH}\n{body}\n")
        (d / name).chmod(0o755)
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(SBATCH, spool / "slurm_script")
    env = {
        "PATH": str(d),
        "HOME": str(tmp_path),
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_ID": "7",
    }
    proc = subprocess.run(
        [BASH, str(spool / "slurm_script"), "experiments/ddp-ft/train.py", "--max-steps", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--nproc-per-node=3 " in proc.stdout and proc.stdout.rstrip().endswith("train.py --max-steps 2")
