"""Time one all-reduce against its size on this machine's process group: the latency and bandwidth that the
ring model's alpha + 2(N-1)/N * bytes / beta needs, measured rather than assumed.

    uv run torchrun --nproc_per_node=2 assets/allreduce_bench.py --out devlogs/runs/ddp-ft-allreduce/cpu-gloo.json
    uv run torchrun --nproc_per_node=2 assets/allreduce_bench.py --cuda --out ...       # NCCL, one GPU per rank

fp32 buffers from 4 B to 16 MiB in steps of 4x; each size is all-reduced --warmup times, then timed --repeats
times one after the other, and the median kept. Rank 0 writes the medians and a least-squares fit of
time = alpha + wire_bytes / beta, with wire_bytes = 2(N-1)/N x size (ftkit.comm.ring_wire_bytes). gloo may use
another algorithm than the ring for some sizes; the fit is then an effective alpha and beta.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ftkit import comm, hardware

SIZES = [4 * 4**k for k in range(12)]  # 4 B .. 16 MiB in steps of 4x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cuda", action="store_true", help="NCCL on CUDA tensors instead of gloo on CPU")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    medians = {}
    for size in SIZES:
        x = torch.ones(size // 4, device=device)
        times = []
        for i in range(args.warmup + args.repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        medians[size] = statistics.median(times)
    if dist.get_rank() == 0:
        wire = {s: comm.ring_wire_bytes("all_reduce", s, world) for s in SIZES}
        # Least squares for t = alpha + wire / beta.
        n, sx, sy = len(SIZES), sum(wire.values()), sum(medians.values())
        sxx = sum(w * w for w in wire.values())
        sxy = sum(wire[s] * medians[s] for s in SIZES)
        slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
        alpha = (sy - slope * sx) / n
        result = {
            "backend": dist.get_backend(),
            "world_size": world,
            "hardware": hardware.describe(device, world),
            "versions": hardware.versions(),
            "repeats": args.repeats,
            "median_seconds": {str(s): t for s, t in medians.items()},
            "fit": {"alpha_s": alpha, "beta_bytes_per_s": 1 / slope},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"alpha {alpha * 1e6:.1f} us, beta {1 / slope / 1e9:.2f} GB/s -> {args.out}")
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip C++ static destructors: see experiments/ddp-ft/train.py


if __name__ == "__main__":
    main()
