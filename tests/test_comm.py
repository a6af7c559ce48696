"""ftkit/comm.py: the collective wrapper and the DDP hook record kind, bytes and count as issued, in a one-process
gloo group (the 2-process numbers are checked on the real script in tests/test_ddp.py), and the ring model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ftkit import comm

CPU = torch.device("cpu")


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_recording_counts_the_collectives_of_the_block_and_restores_them(group):
    original = dist.all_reduce
    recorder = comm.CommRecorder(CPU)
    with comm.recording(recorder):
        assert dist.all_reduce is not original
        dist.all_reduce(torch.ones(10))  # 40 B
        dist.all_reduce(torch.ones(5, dtype=torch.float64), async_op=True).wait()  # 40 B
        dist.all_gather_into_tensor(torch.empty(6), torch.ones(6))  # the gathered output: 24 B
        dist.broadcast(torch.ones(3, dtype=torch.bfloat16), src=0)  # 6 B
        dist.all_gather([torch.empty(4)], torch.ones(4))  # 16 B
    assert dist.all_reduce is original
    dist.all_reduce(torch.ones(10))  # outside the block: not recorded
    stats = recorder.take()
    assert {k: (v["bytes"], v["count"]) for k, v in stats.items()} == {
        "all_reduce": (80, 2),
        "all_gather": (40, 2),
        "broadcast": (6, 1),
    }
    assert all(v["time_s"] > 0 for v in stats.values())
    assert recorder.take() == {}  # take() starts the next step from zero


def test_recording_skips_the_names_an_older_torch_does_not_have(group, monkeypatch):
    """torch 2.11 (the lent GPU machines' own) has no dist.all_gather_single: the block records the rest and does
    not add the missing name."""
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    recorder = comm.CommRecorder(CPU)
    with comm.recording(recorder):
        dist.all_reduce(torch.ones(10))
    assert not hasattr(dist, "all_gather_single")
    assert {k: v["count"] for k, v in recorder.take().items()} == {"all_reduce": 1}


def test_functional_collectives_are_timed_until_their_result_is_waited_for(group):
    """DTensor's collectives return at issue (on CUDA before NCCL moves a byte) and complete at the wait_tensor on
    their result: the time recorded spans the two, not the issue call alone, which is ~0 on a GPU."""
    import time

    import torch.distributed._functional_collectives as funcol

    recorder = comm.CommRecorder(CPU)
    with comm.recording_functional(recorder):
        out = funcol.all_reduce(torch.ones(10), "sum", dist.group.WORLD)
        time.sleep(0.2)  # compute queued between the issue and the wait
        funcol.wait_tensor(out)
        out = funcol.all_reduce(torch.ones(3), "sum", dist.group.WORLD)
        time.sleep(0.2)
        out + 1  # the first op on the result waits for it, as DTensor's next op does
        late = funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD)  # not used in the block: counted only
    funcol.wait_tensor(late)
    stats = recorder.take()
    assert (stats["all_reduce"]["bytes"], stats["all_reduce"]["count"]) == (60, 3)
    assert 0.4 <= stats["all_reduce"]["time_s"] < 1.5


def test_ddp_hook_sees_every_bucket_once_per_sync(group):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    net[0].weight.requires_grad_(False)  # frozen, like the base under LoRA: DDP sends no gradient for it
    trainable = [p for p in net.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * 4 for p in trainable)
    # A bucket cap (104 B) below the gradients' size, so there is more than one bucket.
    ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=1e-4)
    recorder = comm.CommRecorder(CPU)
    comm.register_ddp_hook(ddp, recorder)
    x = torch.randn(4, 64)
    with ddp.no_sync():
        ddp(x).sum().backward()
    assert recorder.take() == {}  # accumulation: nothing sent
    ddp(x).sum().backward()
    assert recorder.take()["all_reduce"]["bytes"] == grad_bytes
    expected = torch.autograd.grad(net(x).sum(), trainable)
    assert all(torch.allclose(p.grad, 2 * g) for p, g in zip(trainable, expected))  # the accumulated sum (1 rank)
    # DDP rebuilds its buckets after the first synced backward, in the order the gradients became ready, and
    # closes a bucket once it holds at least the cap: [bias 1 + weight 1], [bias 0].
    ddp(x).sum().backward()
    stats = recorder.take()["all_reduce"]
    assert stats["bytes"] == grad_bytes and stats["count"] == 2, stats


def test_ddp_buffer_sync_is_turned_off_in_this_torch_and_in_2_11(group, monkeypatch):
    """ddp-ft's DDP broadcasts no buffer before each forward: `forward_sync_buffers=False` where torch has it
    (2.13 on), `broadcast_buffers=False` on torch 2.11, whose DDP has no such keyword (a TypeError there)."""
    import warnings

    DDP = torch.nn.parallel.DistributedDataParallel
    net = torch.nn.Linear(4, 4)
    net.register_buffer("inv_freq", torch.ones(2))  # a constant buffer, as RoPE's
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch >= 2.13 warns that broadcast_buffers is deprecated
        ddp = DDP(net, **comm.ddp_no_forward_buffer_sync())
    assert ddp.broadcast_buffers is False  # an attribute in 2.11, a property of forward_sync_buffers after

    def init_2_11(self, module, device_ids=None, broadcast_buffers=True, init_sync=True): ...

    monkeypatch.setattr(DDP, "__init__", init_2_11)
    assert comm.ddp_no_forward_buffer_sync() == {"broadcast_buffers": False}


def test_summarize_gives_totals_and_per_step_means():
    rows = [
        {"step": 1, "comm": {"all_reduce": {"bytes": 100, "count": 1, "time_s": 0.5}}},
        {"step": 2, "comm": {"all_reduce": {"bytes": 300, "count": 3, "time_s": 1.5}}},
    ]
    s = comm.summarize(rows)
    assert s["comm"] == {"all_reduce": {"bytes": 400, "count": 4, "time_s": 2.0}}
    assert (s["comm_bytes_per_step"], s["comm_count_per_step"], s["comm_time_s_per_step"]) == (200, 2, 1.0)
    assert comm.summarize([{"step": 1}]) == {}


def test_time_is_the_union_of_the_in_flight_intervals():
    # Queued collectives overlap: [0, 2] and [1, 3] are in flight together for 3 s, not 4; [5, 6] adds 1.
    assert comm._union([(1.0, 3.0), (0.0, 2.0), (5.0, 6.0), (5.5, 5.7)]) == 4.0
    assert comm._union([]) == 0.0


def test_ring_wire_bytes():
    # All-reduce = reduce-scatter + all-gather: 2(N-1)/N of the buffer per rank; each half (N-1)/N.
    assert comm.ring_wire_bytes("all_reduce", 1000, 2) == 1000
    assert comm.ring_wire_bytes("all_reduce", 1000, 8) == 1750
    assert comm.ring_wire_bytes("all_gather", 1000, 8) == comm.ring_wire_bytes("reduce_scatter", 1000, 8) == 875
    assert comm.ring_wire_bytes("all_reduce", 1000, 1) == 0
    with pytest.raises(ValueError):
        comm.ring_wire_bytes("send", 1000, 2)
