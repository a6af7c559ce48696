"""torch's memory trackers as this command runs them: `make_tracker` (`MemTracker`; `FSDPMemTracker` for FSDP)
keeping the run's peak only (`RunPeakOnly`), and `no_tracker_graph_leak`, without the leak their module tracking
causes across steps."""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import torch


@contextlib.contextmanager
def no_tracker_graph_leak():
    """torch's memory trackers, without the leak their module tracking causes across steps.

    To follow backward through the modules, ModTracker registers a hook on each module's inputs that fires once all
    of their gradients are computed (`register_multi_grad_hook`, mode "all"). That hook's closure holds the inputs'
    autograd nodes, and each node holds the hook: a cycle through C++ that Python's collector cannot see, so the
    node, and everything its graph reaches, outlives the step. Here that is the embedding output (a leaf that
    requires grad: PEFT calls `enable_input_require_grads` when checkpointing is on) with its accumulated gradient,
    two hidden-size tensors per micro-step (21 MB each in bf16 at 2 x 2048 tokens), which a run without the tracker
    frees. The hook in mode "any" (fire at the first input gradient) holds no nodes; only the per-module statistics
    see the difference, for modules with more than one input that requires grad, not the peak."""
    from torch.distributed._tools import mod_tracker

    hook = mod_tracker.register_multi_grad_hook

    def first_gradient(tensors, fn, mode="all"):
        return hook(tensors, (lambda grad: fn([grad])) if mode == "all" else fn, mode="any")

    with mock.patch.object(mod_tracker, "register_multi_grad_hook", first_gradient):
        yield


class RunPeakOnly:
    """A memory tracker that keeps the run's peak snapshot (what this command reads) and not every module's own
    peaks. Torch's trackers update those on every op by walking all the modules tracked so far, O(ops x modules):
    at 36 layers most of a run's time. The run's peak is updated as the trackers update it."""

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = copy.deepcopy(snap)


def make_tracker(technique: str, model, optimizer, inputs: tuple):
    if technique == "fsdp":
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = type("FSDPRunPeakTracker", (RunPeakOnly, FSDPMemTracker), {})(model, optimizer)
        tracker.track_inputs(inputs)
        return tracker
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = type("RunPeakTracker", (RunPeakOnly, MemTracker), {})()
    tracker.track_external(model, optimizer, *inputs)
    # MemTracker registers a gradient hook on every parameter a module's forward uses, and torch refuses a hook on
    # one that does not require grad: the frozen base gets a placeholder in the tracker's hook table instead.
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
    if technique == "pp":
        # MemTracker takes a second forward of a root module (one called outside any other's forward) for the next
        # iteration and refuses it, but a pipeline stage runs one forward per micro-batch, and on the last stage
        # the loss calls the stage's lm_head, outside the stage's forward, once per micro-batch too: a root's own
        # statistics restart at each (the layers', and the peak, are kept). The hook is registered when the
        # tracker is entered.
        track_forward = tracker._pre_fw_hook

        def each_micro_batch(module, inputs) -> None:
            name = tracker._mod_tracker.get_known_fqn(module)
            root = set(tracker._mod_tracker.parents) - {name} == {"Global"}
            if root and torch._C._current_graph_task_id() == -1:  # a forward, not a recompute
                tracker.memory_tracking.pop(module, None)
            track_forward(module, inputs)

        tracker._pre_fw_hook = each_micro_batch
    return tracker


class _NoHook:
    def remove(self) -> None:
        pass
