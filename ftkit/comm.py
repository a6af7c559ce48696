"""Communication accounting: the collectives a training step issues - kind, bytes, count, time - per optimizer step.

Collectives reach the network by two routes, so there are two ways to record them:

- DDP's reducer calls the process group from C++, so no Python function sees its gradient all-reduces. The one
  place its buckets pass through Python is a DDP communication hook. `register_ddp_hook` installs a hook that
  does exactly what DDP does without one - average each gradient bucket with one all-reduce
  (`default_hooks.allreduce_hook`) - and records it.
- Everything else (FSDP2's all-gathers and reduce-scatters, hand-written tensor- and pipeline-parallel
  collectives, send/recv) calls the functions of `torch.distributed`: `recording()` wraps them for the duration
  of a `with` block. Functional collectives (`torch.distributed._functional_collectives`, which DTensor's
  redistributions use) dispatch to `torch.ops._c10d_functional` without passing through these functions, so
  `recording` does not see them; `recording_functional` (below) does. Use one route per piece of traffic: the DDP
  hook's all-reduce itself goes through `torch.distributed.all_reduce`, so wrapping it as well would count the
  buckets twice.

What is recorded, per kind of collective:
- bytes: the size of the whole buffer the collective works on, on one rank: the tensor of an all-reduce or a
  broadcast, the gathered output of an all-gather, the input of a reduce-scatter, the message of a send. What a
  rank puts on the wire depends on the algorithm; for the ring algorithms see `ring_wire_bytes`.
- count: collectives issued.
- time_s: the wall time during which at least one collective of the kind was in flight: the union of the
  intervals from issuing each one to seeing it complete. Collectives queue behind each other, so their
  intervals overlap and summing them would count the queue many times. An interval includes the wait for the
  slowest rank to issue the same collective, and it overlaps the backward pass, so it is not the time the
  step lost to communication. On CPU (gloo) the end is when the work's future ran its Python callback, which
  needs the GIL, so it can come late by a thread switch (5 ms at most, sys.getswitchinterval). On CUDA (NCCL)
  the host returns as soon as the kernel is enqueued, so the interval is timed with CUDA events instead: one
  recorded on the issuing stream before the collective, one in the future's callback, which runs on a stream
  made to wait for the collective.

The training scripts keep their own metric reductions (a loss scalar per step, the eval sums) out of the
accounting, so the numbers are the technique's traffic. The FSDP and tensor-parallel scripts' summaries set it
beside what theory says they send (`fsdp_theory`, `tp_all_reduce_theory`, `tp_sp_collective_theory`), and
`ftkit.realscale` checks the same functions at Qwen3-4B's widths.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist

# torch.distributed functions `recording()` wraps -> (the kind recorded, the argument that holds the buffer).
COLLECTIVES = {
    "all_reduce": ("all_reduce", "tensor"),
    "reduce": ("reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    # The names FSDP2 calls in this PyTorch (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py).
    "all_gather_single": ("all_gather", "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "all_to_all_single": ("all_to_all", "input"),
    "send": ("send", "tensor"),
    "isend": ("send", "tensor"),
    "recv": ("recv", "tensor"),
    "irecv": ("recv", "tensor"),
}


def nbytes(buffer: torch.Tensor | list[torch.Tensor]) -> int:
    if isinstance(buffer, torch.Tensor):
        return buffer.numel() * buffer.element_size()
    return sum(t.numel() * t.element_size() for t in buffer)


class CommRecorder:
    """Per-kind bytes, count and in-flight time since the last `take()`. Futures complete on the backend's
    threads (gloo) or in CUDA callbacks, hence the lock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._lock = threading.Lock()
        self._stats: dict[str, dict[str, float]] = {}
        self._spans: list[tuple[str, object, object]] = []  # (kind, start, end): perf_counter times or CUDA events

    def issued(self, kind: str, size: int):
        """Count a collective as it is issued; returns the token to pass to `completed`."""
        with self._lock:
            entry = self._stats.setdefault(kind, {"bytes": 0, "count": 0, "time_s": 0.0})
            entry["bytes"] += size
            entry["count"] += 1
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        return time.perf_counter()

    def completed(self, kind: str, token) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        with self._lock:
            self._spans.append((kind, token, end))

    def take(self) -> dict[str, dict[str, float]]:
        """The totals since the last call, e.g. {"all_reduce": {"bytes": 524288, "count": 1, "time_s": 0.002}};
        call it once per optimizer step, after the step's collectives have completed."""
        with self._lock:
            stats, spans = self._stats, self._spans
            self._stats, self._spans = {}, []
        if self.cuda and spans:  # CUDA events -> seconds after one of the start events
            torch.cuda.synchronize()
            ref = spans[0][1]
            spans = [(k, ref.elapsed_time(a) / 1e3, ref.elapsed_time(b) / 1e3) for k, a, b in spans]
        for kind in stats:
            stats[kind]["time_s"] = _union([(a, b) for k, a, b in spans if k == kind])
        return stats


def _union(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals: the time at least one of them was in flight."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _on_completion(work, recorder: CommRecorder, kind: str, token) -> None:
    """Time an async collective until its future completes; a backend whose work has no future (some
    point-to-point works) is timed until the call returned."""
    try:
        future = work.get_future()
    except RuntimeError:
        recorder.completed(kind, token)
        return
    future.add_done_callback(lambda _: recorder.completed(kind, token))


@contextlib.contextmanager
def recording(recorder: CommRecorder) -> Iterator[CommRecorder]:
    """Record every collective issued through `torch.distributed`'s functions (COLLECTIVES) inside the block.

    The functions are swapped on the `torch.distributed` module, which is where callers look them up
    (`dist.all_gather_into_tensor(...)`), and restored on exit. A collective implemented by calling another one
    is recorded once, by the outermost call.
    """
    # A name this torch does not have (2.11 has no all_gather_single) has no caller to record.
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    local = threading.local()

    def wrap(name: str, fn):
        kind, arg = COLLECTIVES[name]
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if getattr(local, "depth", 0):
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            token = recorder.issued(kind, nbytes(bound.arguments[arg]))
            local.depth = 1
            try:
                result = fn(*args, **kwargs)
            finally:
                local.depth = 0
            if isinstance(result, dist.Work):
                _on_completion(result, recorder, kind, token)
            else:
                recorder.completed(kind, token)
            return result

        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield recorder
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def ddp_no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's keyword that turns off the broadcast of rank 0's buffers before every forward, in this torch's
    spelling: `forward_sync_buffers=False` from torch 2.13 (which deprecates `broadcast_buffers`, with a warning),
    `broadcast_buffers=False` before (torch 2.11, the lent GPU machines' own). The older flag also leaves the
    buffers out of DDP's broadcast at construction; the scripts' only buffers are RoPE's frequencies, computed
    alike on every rank, so the two give the same run."""
    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def register_ddp_hook(ddp_model, recorder: CommRecorder, process_group=None) -> None:
    """Route DDP's gradient buckets through a hook that all-reduces each one exactly as DDP's built-in reducer
    does (divide by the world size, all-reduce SUM: the average) and records it. Call before the first forward.

    DDP calls the hook once per bucket as soon as the last gradient of the bucket is ready, in the middle of the
    backward pass; DDP waits for the returned future at the end of backward, before it writes the averaged
    bucket back into the parameters' .grad (Li et al. 2020, arXiv 2006.15704, Sec. 3.2)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    # No annotations on the hook: DDP checks them against the real classes, and this module's are strings.
    def hook(state, bucket):
        token = recorder.issued("all_reduce", nbytes(bucket.buffer()))
        future = allreduce_hook(state, bucket)

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            recorder.completed("all_reduce", token)
            return fut.value()

        return future.then(done)

    ddp_model.register_comm_hook(process_group, hook)


def summarize(rows: list[dict], key: str = "comm") -> dict:
    """Totals over the steps of a run from the `key` entries of its metrics rows (`comm`; a 2-D mesh records one per
    dimension), and the per-step means the devlog tables show (`<key>_bytes_per_step`, `<key>_count_per_step`,
    `<key>_time_s_per_step`)."""
    steps = [r[key] for r in rows if key in r]
    if not steps:
        return {}
    totals: dict[str, dict[str, float]] = {}
    for step in steps:
        for kind, s in step.items():
            t = totals.setdefault(kind, {"bytes": 0, "count": 0, "time_s": 0.0})
            for field in t:
                t[field] += s[field]
    n = len(steps)
    return {
        key: totals,
        f"{key}_bytes_per_step": sum(t["bytes"] for t in totals.values()) / n,
        f"{key}_count_per_step": sum(t["count"] for t in totals.values()) / n,
        f"{key}_time_s_per_step": sum(t["time_s"] for t in totals.values()) / n,
    }


# What each experiment's summary.json says its `comm` entries are (its `comm_note`).
NOTES = {
    "ddp-ft": "per optimizer step, DDP's gradient all-reduces as the comm hook saw them (ftkit/comm.py): "
    "bytes of the buckets, buckets issued, and the time at least one of them was in flight (the union of their "
    "issue-to-completion spans: they overlap backward and each other); the metrics' own loss/eval all-reduces "
    "are not counted",
    "fsdp-ft": "per optimizer step, FSDP2's all-gathers and reduce-scatters as recorded around "
    "torch.distributed (ftkit/comm.py): bytes of the full buffers; the grad-norm all-reduce (DTensor's "
    "functional collectives) and the metrics' own all-reduces are not counted",
    "tp-ft": "per optimizer step, every functional collective DTensor issued in forward and backward "
    "(ftkit/comm.py recording_functional): bytes of the all-reduced tensors; time_s from each one's issue to "
    "the wait on its result (in flight, overlapping compute queued meanwhile); the gradient-norm clipping, the "
    "metrics and the reassembly are not counted. "
    "Recorded on sampled steps only (the first step run and every eval step; all with --comm-every-step): "
    "the rows with a `comm` entry, and the means here are over those rows",
    "fsdp-tp-ft": "`comm` (dp): FSDP2's all-gathers and reduce-scatters per optimizer step on rank 0's FSDP group, "
    "as recorded around torch.distributed; `comm_tp` (tp): DTensor's functional collectives on rank 0's TP "
    "group, on sampled steps (the first run and every eval step); bytes of the whole buffers; time_s from issue "
    "to completion (the FSDP works' futures; the wait on each functional collective's result)",
    "tp-sp-ft": "per optimizer step, every torch.distributed collective inside the step (ftkit/comm.py): "
    "bytes of the whole buffer (all-reduce tensor, all-gather output, reduce-scatter input); the metrics' "
    "own reductions and the adapter reassembly are not counted",
    "cp-ft": "per optimizer step, every torch.distributed collective inside the step (ftkit/comm.py): the K and V "
    "all-gathers (bytes of the gathered output) in forward and in checkpointing's recompute, their gradients' "
    "reduce-scatters (bytes of the input) and the LoRA gradients' all-reduce; the loss and eval all-reduces are "
    "not counted",
    "pp-ft": "per optimizer step, all ranks together: the point-to-point sends between stages (activations "
    "forward, their gradients backward), counted where the stages build them; time is not measured",
}


def ring_wire_bytes(kind: str, size: float, world: int) -> float:
    """Bytes each rank sends for one collective on `size` bytes with the ring algorithms (Patarasuk & Yuan 2009,
    "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 69(2)): an all-reduce is a
    reduce-scatter followed by an all-gather, each N-1 steps of size/N per rank, so 2(N-1)/N x size; either half
    alone sends (N-1)/N x size. This is the bandwidth term only (the latency term is 2(N-1) message latencies)."""
    if world == 1:
        return 0.0
    factor = {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1) / world}
    factor["reduce_scatter"] = factor["all_gather"]
    if kind not in factor:
        raise ValueError(f"no ring model for {kind!r}; known: {', '.join(factor)}")
    return factor[kind] * size


def gathered_bytes(params, param_dtype: torch.dtype) -> int:
    """Bytes an FSDP2 all-gather of these parameters sends in full: floating ones in the policy's param_dtype
    (MixedPrecisionPolicy casts them), the others as stored (a 4-bit base's uint8 bytes, two weights each, which
    FSDP2 never casts: a unit of mixed dtypes is all-gathered as one byte buffer)."""
    return sum(p.numel() * (param_dtype.itemsize if p.is_floating_point() else p.dtype.itemsize) for p in params)


def fsdp_theory(
    param_bytes: int,
    layer_unit_bytes: int,
    micro_steps: int,
    reshard_after_forward: bool,
    grad_bytes: int,
    world_size: int,
) -> dict[str, int]:
    """Bytes FSDP2 sends per optimizer step (experiments/fsdp-ft), of the full (gathered) buffers: every unit is
    all-gathered once per micro-step forward (`param_bytes`: all of them, in --param-dtype), and the layer units
    (`layer_unit_bytes`) once more per backward when they were resharded after forward; the trainable (LoRA)
    gradients (`grad_bytes`, in --reduce-dtype) are reduce-scattered once, at the micro-step that syncs (frozen
    weights have no gradient and send nothing). The ring puts (N-1)/N of each on the wire (`ring_wire_bytes`).
    A group of one calls no collective: FSDP2 copies each unit's shards into its unsharded parameters instead."""
    if world_size == 1:
        return {"all_gather": 0, "reduce_scatter": 0}
    gathered = param_bytes + (layer_unit_bytes if reshard_after_forward else 0)
    return {"all_gather": micro_steps * gathered, "reduce_scatter": grad_bytes}


def checkpointed_count(args, layers: int) -> int:
    """How many of `layers` decoder layers the run checkpoints (--checkpointing: all, none, every-K from layer 0; a
    run from before it, --grad-checkpointing's all or none): `lora.checkpointed_layers`' count, said here at the
    bottom of the import order for the theories below. Layer 0 is among them whenever any is."""
    spec = getattr(args, "checkpointing", None) or ("all" if args.grad_checkpointing else "none")
    every = {"all": 1, "none": 0}.get(spec)
    every = int(spec.removeprefix("every-")) if every is None else every
    return -(-layers // every) if every else 0


def tp_all_reduce_theory(config, args, rows: list[dict], tp: int, key: str = "comm") -> float:
    """Bytes per sampled step that tp-ft's LoRA-aware DTensor plan all-reduces (experiments/tp-ft; fsdp-tp-ft on
    its `tp` dimension), from each sampled step's activation bytes (rows with a `key` entry). Per micro-batch and
    layer: forward, o_proj's and down_proj's partial outputs and those of their lora_A (rank r: r/hidden of an
    activation); backward, the input gradients of the five column modules and their lora_B, less layer 0's q/k/v
    input gradients (no gradient flows into the frozen embedding; their lora_B still send); checkpointing repeats a
    checkpointed layer's forward ones (each layer's, or every K-th's) and makes the embedding's output require grad
    (transformers' enable_input_require_grads), so layer 0's q/k/v send too.
    A TP group of one (`tp`) sends nothing: DTensor on a mesh of one redistributes nothing."""
    if tp == 1:
        return 0.0
    layers = config.num_hidden_layers
    forward = 2 * (layers + checkpointed_count(args, layers))  # a checkpointed layer's forward again
    backward = 5 * layers - (0 if forward > 2 * layers else 3)
    per_activation = forward + backward + (forward + 5 * layers) * args.lora_rank / config.hidden_size
    sampled = [r["activation_bytes"] for r in rows if key in r]
    return per_activation * sum(sampled) / max(1, len(sampled))


def tp_sp_collective_theory(config, args, rows: list[dict], replicated_bytes: int) -> dict[str, float]:
    """Bytes per optimizer step of each collective kind that tp-sp-ft's hand-rolled TP (and SP) sends, from each
    step's `activation_bytes` ([micro, seq, hidden] summed over its micro-batches; the mean over the steps). Each
    decoder layer's two blocks enter with f (an all-reduce of the input gradient in backward) or SP's all-gather (a
    reduce-scatter in backward) and leave with g (an all-reduce in forward) or SP's reduce-scatter (an all-gather
    in backward), on one activation each (Korthikanti et al. 2022, Sec. 4.2.2). Layer 0's attention gets no input
    gradient: the frozen embedding's output needs none. Checkpointing changes three things: the recompute repeats
    the entries and the attention's exit, but stops before the MLP's exit, whose output nothing saves
    (torch.utils.checkpoint's early stop); and transformers makes the embedding output require grad, so layer 0's
    attention and (SP) the scatter into the sequence-parallel region send their backward too. SP also all-gathers
    the final norm's output for the lm_head. Plus one all-reduce of the replicated LoRA gradients
    (`replicated_bytes`)."""
    layers = config.num_hidden_layers
    recomputed = checkpointed_count(args, layers)  # layers 0, K, 2K, ... (every-K); layer 0 whenever any
    recompute = min(recomputed, 1)  # the embedding's output requires grad: layer 0's entry sends its backward
    entries_forward, entries_backward = 2 * (layers + recomputed), 2 * layers - 1 + recompute
    exits_forward, exits_backward = 2 * layers + recomputed, 2 * layers
    act = sum(r["activation_bytes"] for r in rows) / max(1, len(rows))
    if not args.sequence_parallel:
        return {"all_reduce": (exits_forward + entries_backward) * act + replicated_bytes}
    return {
        "all_gather": (entries_forward + exits_backward + 1 + recompute) * act,
        "reduce_scatter": (exits_forward + entries_backward) * act,
        "all_reduce": float(replicated_bytes),
    }


# Functional collectives (the route DTensor's redistributions take) -> (the kind recorded, the index of the
# argument that holds the buffer, whether that buffer is the gathered output rather than the input).
FUNCTIONAL_COLLECTIVES = {
    "all_reduce": ("all_reduce", 0, False),
    "all_gather_into_tensor": ("all_gather", 0, True),
    "reduce_scatter_tensor": ("reduce_scatter", 0, False),
    "all_to_all_single": ("all_to_all", 0, False),
    "broadcast": ("broadcast", 0, False),
}


@contextlib.contextmanager
def recording_functional(recorder: CommRecorder) -> Iterator[CommRecorder]:
    """Record the functional collectives (`torch.ops._c10d_functional.*`) dispatched inside the block, forward and
    backward, with the same conventions as `recording` for bytes and count. These ops are asynchronous: they
    return at issue (on CUDA, before NCCL has moved a byte), wrapped in an AsyncCollectiveTensor that waits for the
    result in the first op that uses it (or an explicit `wait_tensor`). Each is timed from its issue to the end of
    that op (on CUDA, to the moment the compute stream, made to wait there, passes it): in flight, overlapping the
    compute queued meanwhile, as `recording` times torch.distributed's works. A result whose first use is a view,
    or that is not used inside the block, is counted but not timed."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = {getattr(torch.ops._c10d_functional, name).default: spec for name, spec in FUNCTIONAL_COLLECTIVES.items()}
    # id(result) -> (a weak reference to it, kind, issue token): weak, so a result that is never waited for here is
    # not kept alive (and does not change the memory the step measures).
    in_flight: dict[int, tuple[weakref.ref, str, object]] = {}
    wrap = torch.ops._c10d_functional._wrap_tensor_autograd.default  # wraps a result at issue: not a use

    def used(args) -> list[int]:
        """The in-flight results among an op's arguments (top-level tensors or lists of them): the op waits."""
        found = []
        for arg in args:
            for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                t = t.elem if isinstance(t, AsyncCollectiveTensor) else t
                if id(t) in in_flight and in_flight[id(t)][0]() is t:
                    found.append(id(t))
        return found

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            spec = ops.get(func)
            if spec is None:
                waits = used(args) if in_flight and func is not wrap else []
                out = func(*args, **(kwargs or {}))
                for key in waits:
                    _, kind, token = in_flight.pop(key)
                    recorder.completed(kind, token)
                return out
            kind, index, gathered = spec
            buffer = args[index]
            size = nbytes(buffer) * (args[1] if gathered else 1)  # all_gather_into_tensor(input, group_size, ...)
            token = recorder.issued(kind, size)
            out = func(*args, **(kwargs or {}))
            in_flight[id(out)] = (weakref.ref(out), kind, token)
            return out

    with Mode():
        yield recorder


def record_stage_sends(stages: list, recorder: CommRecorder) -> None:
    """Count the bytes each `torch.distributed.pipelining` stage sends (experiments/pp-ft). The schedules batch
    their point-to-point operations as P2POp(dist.isend, ...) and check `op is dist.isend`, so wrapping dist.isend
    (`recording`) would break them; the sends are recorded where the stage builds them instead. The schedule
    waits for these works itself, so only bytes and counts are recorded (time_s stays 0)."""
    for stage in stages:
        for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
            build = getattr(stage, name)

            def counted(chunk_id: int, build=build):
                ops = build(chunk_id)
                for op in ops:
                    recorder.completed("send", recorder.issued("send", nbytes(op.tensor)))
                return ops

            setattr(stage, name, counted)
