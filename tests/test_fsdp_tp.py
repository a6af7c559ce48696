"""experiments/fsdp-tp-ft on CPU processes (torchrun, gloo): meshes 2x2 (2 "nodes" of 2 processes, through the
Slurm script), 1x2 and 2x1 each take the same training steps as the single-process LoRA reference and end with
the same stock PEFT adapter; the collectives of each mesh dimension are the ones theory says; the parameters each
rank holds are the memory model's; a bad mesh is refused before the process group."""

from __future__ import annotations

import json
from types import SimpleNamespace

import parity
import pytest
from test_tp import BATCH, LORA_RANK, STEPS, flags

TRAIN = "experiments/fsdp-tp-ft/train.py"
LAYERS, HIDDEN = 4, 128  # the tiny model


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    # The same flags as tests/test_tp.py's reference: parity caches it, one run for both modules.
    ref_flags = (*flags(data_dir), "--save-every", "1", "--keep-checkpoints", str(STEPS))
    return parity.reference(tmp_path_factory.mktemp("ref"), *ref_flags, quant="none")


@pytest.fixture(scope="module", params=["2 nodes x 2", "1,2", "2,1"])
def mesh(request, tmp_path_factory, data_dir, fork_socket):
    """Mesh 2x2 is launched as a 2-node job through assets/slurm/train.sbatch (srun and scontrol stand-ins run its
    torchrun command once per "node": 2 agents of 2 processes meeting at the c10d rendezvous on loopback, as two
    machines would) with no --mesh-shape: the default, TP = ranks per node and DP = nodes, must make it 2x2. Each
    node's torchrun is forked from the suite's fork server (parity.forked_uv), on that node's cores."""
    out = tmp_path_factory.mktemp("fsdp-tp") / request.param.replace(" ", "")
    if request.param == "2 nodes x 2":
        bin_dir = tmp_path_factory.mktemp("slurm-bin")
        proc = parity.slurm(
            bin_dir, TRAIN, *flags(data_dir), "--output-dir", str(out), nodes=2, per_node=2, fork_socket=fork_socket
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        hardware = json.loads((out / "config.json").read_text())["hardware"]
        # Each "node" is bound to one of this machine's 2 cores (as Slurm binds a job step to its node's) and its
        # two ranks share it: one thread each, not one per core of the machine (ranks spinning against each other
        # on 2 cores take 10-40x longer per step).
        assert (hardware["world_size"], hardware["nodes"], hardware["torch_threads"]) == (4, 2, 1)
        return 2, 2, SimpleNamespace(run_dir=out)
    dp, tp = (int(x) for x in request.param.split(","))
    run = parity.torchrun(
        TRAIN, *flags(data_dir, "--mesh-shape", request.param), "--output-dir", str(out), nproc=dp * tp
    )
    assert run.returncode == 0, run.report()
    return dp, tp, run


def test_same_step_as_the_single_process_reference(mesh, reference):
    dp, tp, run = mesh
    loss = parity.compare_losses(run.run_dir, reference)
    eval_loss = parity.compare_losses(run.run_dir, reference, key="eval_loss")
    adapter = parity.compare_adapters(run.run_dir / "adapter", reference / "adapter")
    print(f"mesh {dp}x{tp}: max |loss diff| {loss:.2e}, eval {eval_loss:.2e}, adapter {adapter:.2e}")
    assert loss <= parity.LOSS_TOL and eval_loss <= parity.LOSS_TOL
    assert adapter <= parity.ADAPTER_TOL


def test_no_host_sync_per_micro_batch(mesh):
    dp, tp, run = mesh  # mesh 1x2 runs two micro-batches a step: a sync in each would count 3
    counts = parity.host_syncs(run.run_dir, save_every=10**6)
    print(f"mesh {dp}x{tp}: host syncs per plain step {counts}")
    assert max(counts) <= parity.MAX_HOST_SYNCS


def test_each_mesh_dimension_sends_what_theory_says(mesh):
    """dp: FSDP2's all-gathers of this TP rank's slices (every unit in forward, the layers again in backward) and
    one reduce-scatter of the LoRA gradients per step, as fsdp-ft's; tp: tp-ft's all-reduces on this TP group's
    micro-batches (forward o_proj and down_proj and their lora_A; backward the five column modules and their lora_B,
    less layer 0's q/k/v input gradients, as their input needs none; their lora_B still send)."""
    dp, tp, run = mesh
    s = json.loads((run.run_dir / "summary.json").read_text())
    assert s["mesh"] == {"dp": dp, "tp": tp}
    rows = parity.metrics(run.run_dir)
    micro = BATCH // (2 * dp)
    for row in rows:
        if dp > 1:
            assert row["comm"]["all_gather"]["bytes"] == s["theory_all_gather_bytes"], row["comm"]
            assert row["comm"]["all_gather"]["count"] == micro * (LAYERS + 1 + LAYERS)
            assert row["comm"]["reduce_scatter"]["bytes"] == s["theory_reduce_scatter_bytes"]
            assert row["comm"]["reduce_scatter"]["count"] == LAYERS  # the root has no trainable parameter
        else:
            assert row["comm"] == {}  # an FSDP group of one sends nothing
            assert s["theory_all_gather_bytes"] == s["theory_reduce_scatter_bytes"] == 0
        if "comm_tp" in row:
            act = row["activation_bytes"]
            rank_r = act * LORA_RANK // HIDDEN
            if tp > 1:
                assert set(row["comm_tp"]) == {"all_reduce"}
                assert row["comm_tp"]["all_reduce"]["count"] == micro * (14 * LAYERS - 3)
                expected = (7 * LAYERS - 3) * act + 7 * LAYERS * rank_r
                assert row["comm_tp"]["all_reduce"]["bytes"] == expected
            else:
                assert row["comm_tp"] == {}
    assert [r["step"] for r in rows if "comm_tp" in r] == [1, 2, 4]  # the first step and the eval steps
    assert s["theory_comm_tp_bytes_per_step"] == s.get("comm_tp_bytes_per_step", 0)


@pytest.mark.parametrize(
    "world, argv, message",
    [
        (4, ["--mesh-shape", "2,4"], "--mesh-shape 2,4: DP x TP = 8 ranks, but torchrun started 4"),
        (4, ["--mesh-shape", "2x2"], "--mesh-shape '2x2': expected two integers DP,TP"),
        (6, ["--mesh-shape", "2,3"], "tensor-parallel degree 3 does not divide the model's 4 key/value heads"),
    ],
)
def test_a_bad_mesh_is_refused_before_the_process_group(monkeypatch, data_dir, world, argv, message):
    assert message in parity.refused(monkeypatch, TRAIN, "--smoke", "--data", str(data_dir), *argv, world=world)


def test_per_rank_parameter_memory_is_the_memory_models_2d_case(mesh):
    """ftkit.memory.predict(technique="fsdp", tp=TP) as the script calls it: the projections split by TP, then
    everything (the TP slices, the embedding and norms TP leaves whole, the adapters) by DP; to the byte."""
    dp, tp, run = mesh
    s = json.loads((run.run_dir / "summary.json").read_text())
    predicted = s["memory_predicted"]
    assert predicted["weights"] + predicted["lora"] == s["param_shard_bytes"]
    whole = (s["parameters"]["trainable"] + s["parameters"]["frozen"]) * 4  # fp32 in --smoke
    assert s["param_shard_bytes"] < whole / dp or tp == 1  # TP took its share too
