"""A pipeline's schedule, timed: each action's start and end on its stage (`ActionTimer`), the bubble a schedule
leaves at given costs (`schedule_bubble`), and what a step's summary records of them."""

from __future__ import annotations

import statistics
import time

import torch


class ActionTimer:
    """The pipeline bubble's clock (experiments/pp-ft): start and end of every forward (F), loss (L) and backward
    that a rank's `torch.distributed.pipelining` stages run inside the schedule. The schedule calls each stage's
    forward_one_chunk / backward_one_chunk once per micro-batch, and the loss function once per micro-batch on the
    last stage (between the two, outside both), so wrapping those times each compute action, and the rest of the
    step is waiting (the bubble) or point-to-point transfer. A backward is B when it is whole; the zero-bubble
    schedules split it into I (backward_one_chunk with full_backward=False: the gradient of the stage's input) and
    W (backward_weight_one_chunk, run later: the gradient of its trainable weights), both compute.

    On CPU the marks are wall-clock. On CUDA the host only queues the kernels, so a wall-clock would time the
    launches: the marks are CUDA events on the compute stream (recorded after the stream was made to wait for the
    received activations), read once per step after the last one completes.

    It also counts the calls of the stages' modules between start and stop: one per micro-batch and stage, unless
    torch ran forwards of its own inside the step (to infer the stages' shapes, when they are not given)."""

    def __init__(self, stages: list, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[int, str, int, object, object]] = []  # (stage, F/B/I/W, micro-batch, start, end)
        self.forwards = 0
        for stage in stages:
            stage.submod.register_forward_pre_hook(self._count_forward)
            stage.forward_one_chunk = self._wrap(stage.forward_one_chunk, stage.stage_index, "F")
            stage.backward_one_chunk = self._wrap(stage.backward_one_chunk, stage.stage_index, "B")
            stage.backward_weight_one_chunk = self._wrap(stage.backward_weight_one_chunk, stage.stage_index, "W")

    def _count_forward(self, module, args) -> None:
        self.forwards += 1

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _wrap(self, fn, stage: int, kind: str):
        def timed(chunk_id: int, *args, **kwargs):
            start = self._now()
            try:
                return fn(chunk_id, *args, **kwargs)
            finally:
                split = kind == "B" and not kwargs.get("full_backward", True)
                self.marks.append((stage, "I" if split else kind, chunk_id, start, self._now()))

        return timed

    def timed_loss(self, loss_fn, stage: int):
        """`loss_fn` (the last stage's lm_head and cross-entropy, run by the schedule) timed as compute."""

        def timed(*args, **kwargs):
            start = self._now()
            try:
                return loss_fn(*args, **kwargs)
            finally:
                losses = sum(kind == "L" for _, kind, *_ in self.marks)
                self.marks.append((stage, "L", losses, start, self._now()))

        return timed

    def start(self) -> None:
        self.marks, self.forwards, self.t0 = [], 0, self._now()

    def stop(self) -> None:
        self.t1 = self._now()

    def read(self) -> tuple[list[tuple[int, str, int, float, float]], float, float, int]:
        """(events in seconds since start, busy seconds, seconds from start to stop, stage forwards run)."""
        if self.cuda:
            self.t1.synchronize()

            def since(mark):
                return self.t0.elapsed_time(mark) / 1e3
        else:

            def since(mark):
                return mark - self.t0

        events = [(stage, kind, mb, since(a), since(b)) for stage, kind, mb, a, b in self.marks]
        return events, sum(end - start for *_, start, end in events), since(self.t1), self.forwards


def schedule_bubble(order: dict[int, list], cost: dict[tuple[int, str], float] | None = None) -> float:
    """The bubble a multi-stage `torch.distributed.pipelining` schedule's own action order predicts (experiments/
    pp-ft): every rank runs its compute actions (`schedule.pipeline_order`, which the schedule runs; every rank
    holds every rank's) in order, each as soon
    as it may: a forward once the previous stage's forward of that micro-batch is done, an input gradient (I, or
    a whole backward B = I + W) once the next stage's of that micro-batch is, a weight gradient (W) once its I
    is; transfers are free. `cost[(stage, kind)]` is an action's time (kinds F, I, W); None: all 1, the equal
    F = I = W times the papers' formulas assume. Returns the share of the step (first action to last, on any
    rank) a rank is idle, averaged over ranks."""
    queues = {
        rank: [
            sub
            for a in actions
            if a is not None
            for sub in (a.sub_actions or (a,))
            if sub.computation_type.value in ("F", "I", "W", "B")  # not the gradient reductions and waits
        ]
        for rank, actions in order.items()
    }
    last_stage = max(a.stage_index for acts in queues.values() for a in acts)
    done: dict[tuple[int, str, int], float] = {}  # (stage, F / I / W, micro-batch) -> finish time
    clock, busy = dict.fromkeys(queues, 0.0), dict.fromkeys(queues, 0.0)
    while any(queues.values()):
        progressed = False
        for rank, queue in queues.items():
            while queue:
                stage, kind, mb = queue[0].stage_index, queue[0].computation_type.value, queue[0].microbatch_index
                needs = {
                    "F": [(stage - 1, "F", mb)] if stage > 0 else [],
                    "W": [(stage, "I", mb)],
                }.get(kind, [(stage, "F", mb)] + ([(stage + 1, "I", mb)] if stage < last_stage else []))
                if not all(n in done for n in needs):
                    break
                parts = ["I", "W"] if kind == "B" else [kind]  # a whole backward is both gradients
                took = sum(1.0 if cost is None else cost[(stage, k)] for k in parts)
                clock[rank] = max([clock[rank]] + [done[n] for n in needs]) + took
                busy[rank] += took
                done.update({(stage, k, mb): clock[rank] for k in parts})
                queue.pop(0)
                progressed = True
        if not progressed:
            raise ValueError("the schedule's actions wait on each other")
    step = max(clock.values())
    return sum(1 - b / step for b in busy.values()) / len(busy)


def action_costs(events: list[tuple[int, str, int, float, float]]) -> dict[tuple[int, str], float]:
    """Mean seconds per (stage, F / I / W) of a step's `ActionTimer` events, for `schedule_bubble`: the loss
    counts with its stage's forward; a whole backward (B) counts as its I, with W 0."""
    spans: dict[tuple[int, str], list[float]] = {}
    for stage, kind, _, start, end in events:
        spans.setdefault((stage, {"L": "F", "B": "I"}.get(kind, kind)), []).append(end - start)
    costs = {key: sum(v) / len(v) for key, v in spans.items()}
    for stage in {stage for stage, _ in costs}:
        costs.setdefault((stage, "W"), 0.0)
    return costs


def pipeline_step(every: list[tuple[float, float, int, dict]]) -> dict:
    """experiments/pp-ft's per-step fields from every rank's (busy seconds, seconds inside schedule.step, stage
    forwards run inside it, its recorded sends): the sends of all ranks together, and each rank's busy and idle
    time, bubble and stage forwards (m per stage it holds, when no shape inference ran inside the step)."""
    busy, total, forwards, sends = (list(x) for x in zip(*every))
    bubble = [1 - b / t for b, t in zip(busy, total)]
    send = {key: sum(s.get("send", {}).get(key, 0) for s in sends) for key in ("bytes", "count")}
    return {
        "comm": {"send": {**send, "time_s": 0.0}},
        "pipeline_time_s": total,
        "busy_s": busy,
        "idle_s": [t - b for b, t in zip(busy, total)],
        "bubble_per_rank": bubble,
        "bubble": sum(bubble) / len(bubble),
        "stage_forwards": forwards,
    }


def bubble_summary(rows: list[dict], world: int, theory: float, order: dict | None, timeline: dict | None) -> dict:
    """experiments/pp-ft's summary fields for the bubble: the measured median over the steps after the first (the
    first also sets up the point-to-point links; `MetricsLog.summary` keeps it out of the step time's median too),
    and per rank, next to the schedule's `theory` (equal-cost actions) and, for a multi-stage schedule (`order`:
    its actions), the order run with the last step's own mean F / I / W time per stage (`schedule_bubble`)."""
    events = [e for rank in timeline["events"] for e in rank] if timeline else []
    timed = rows[1:] if len(rows) > 1 else rows
    return {
        "bubble": statistics.median(r["bubble"] for r in timed) if timed else None,
        "bubble_per_rank": [statistics.median(r["bubble_per_rank"][k] for r in timed) for k in range(world)]
        if timed
        else None,
        "bubble_steps": f"median over steps {timed[0]['step']}..{timed[-1]['step']}" if timed else None,
        "bubble_theory": theory,
        "bubble_theory_measured_costs": schedule_bubble(order, action_costs(events)) if order and events else None,
        "bubble_note": "per rank and step: 1 - (time inside the stages' forward/loss/backward/weight-gradient "
        "actions) / (time inside schedule.step), timed with CUDA events on GPUs, wall-clock on CPU. bubble: the "
        "median over the steps after the first (bubble_steps) of the mean over ranks; bubble_per_rank: each rank's "
        "median over the same steps. Idle time includes point-to-point transfers and the schedule's own Python "
        "work, which the theory counts as zero. bubble_theory: equal-cost F, I, W on every stage and free "
        "transfers; bubble_theory_measured_costs (multi-stage schedules): their action order with the last step's "
        "mean F/I/W time per stage",
    }
