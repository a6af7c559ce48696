"""Pipeline-parallel LoRA: finetune Qwen3-4B with its decoder layers split into stages, one or two per GPU.

The single-GPU step, cut by depth: rank r holds a contiguous slice of the layer stack (the embedding on the first
stage, the final norm and lm_head on the last), and the global batch flows through the stages as micro-batches,
activations forward and their gradients backward, rank to rank:
    uv run torchrun --nproc_per_node=2 experiments/pp-ft/train.py --schedule 1f1b             # Qwen3-4B, 2 GPUs
    uv run torchrun --nproc_per_node=2 experiments/pp-ft/train.py --smoke                     # CPU
    uv run torchrun --nproc_per_node=2 experiments/pp-ft/train.py --smoke --schedule zbv

One optimizer step = one global batch of --batch-size sequences, cut into m = --batch-size / --micro-batch-size
pipeline micro-batches (or --microbatches m). Pipelining does not split the batch across ranks: every rank reads
the same global batch, the first stage feeds its micro-batches in, the last stage computes their losses. The loss
of a micro-batch is its sum of token losses divided by the target tokens of the *whole* global batch, so the
micro-batch losses add up to the single-GPU loss and their gradients to its gradient. While the first micro-batch
travels down the pipe the later stages wait, and while the last one travels back the earlier stages wait: the
pipeline bubble, measured per rank in every step's metrics. The zero-bubble schedules (Qi et al. 2023, arXiv
2401.10241) split each backward into the input gradient, which the stage before waits for, and the weight
gradient, which nothing waits for and runs later, in the gaps.
"""

from __future__ import annotations

import functools
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules

from ftkit import (
    batching,
    checkpoint,
    cli,
    comm,
    compilation,
    data,
    errors,
    evaluation,
    lora,
    metrics,
    models,
    optim,
    pipeline_timing,
    prepare,
    ranks,
    rundir,
)
from ftkit.profiling import StepProfiler

SCHEDULES = {
    "gpipe": schedules.ScheduleGPipe,
    "1f1b": schedules.Schedule1F1B,
    "interleaved-1f1b": schedules.ScheduleInterleaved1F1B,
    "interleaved-zb": schedules.ScheduleInterleavedZeroBubble,
    "zbv": schedules.ScheduleZBVZeroBubble,
    "dualpipev": schedules.ScheduleDualPipeV,
}


def parse_args():
    p = cli.common_parser(__doc__.splitlines()[0], experiment="pp-ft")
    g = p.add_argument_group("pipeline")
    g.add_argument(
        "--schedule",
        choices=list(SCHEDULES),
        default="1f1b",
        help="gpipe: all forwards, then all backwards; 1f1b: one forward, one backward in the steady state (fewer "
        "activations in flight); interleaved-1f1b: stages r and r + ranks on rank r, a smaller bubble, more sends; "
        "zero bubble, each backward split into input and weight gradients, the latter run in the gaps (under "
        "checkpointing, each recomputes its layers): interleaved-zb; zbv, dualpipev on a V (stages r, 2 ranks - 1 - r)",
    )
    g.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="pipeline micro-batches per optimizer step; sets --micro-batch-size to --batch-size / this",
    )
    args = cli.resolve(p.parse_args())
    cli.resolve_microbatches(args)  # --microbatches m: --micro-batch-size = --batch-size / m
    # Padded, one example per row: the schedule has a fixed number of micro-batches (said once, and in the summary).
    cli.padded_only(args, batching.PIPELINE_PADDED_WHY)
    return args


def stage_layout(num_layers: int, world: int, schedule: str) -> tuple[int, int]:
    """(stages, layers per stage). Every schedule but GPipe and 1F1B gives each rank two stages (v = 2 model
    chunks, Narayanan et al. 2021, arXiv 2104.04473, Sec. 2.2; ZBV and DualPipeV need exactly two). Stages must
    split the layers evenly: an uneven split leaves the bigger stages as the bottleneck of every step and the
    smaller ones idle, a bubble of its own, so it is refused rather than warned about."""
    stages = world * len(rank_stages(0, world, schedule))
    if num_layers % stages:
        divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        raise errors.RunError(
            f"{stages} pipeline stages ({world} ranks x {stages // world} per rank with --schedule {schedule}) do "
            f"not divide the model's {num_layers} layers evenly; the stage count must be one of {divisors}"
        )
    return stages, num_layers // stages


def rank_stages(rank: int, world: int, schedule: str) -> list[int]:
    """The stages rank `rank` holds. GPipe, 1F1B: stage r. Interleaved: r and r + ranks, a loop. ZBV and
    DualPipeV: r and 2 * ranks - 1 - r, a V: the first rank holds the first and the last stage, and the last rank
    the two middle ones, which hand each other their activations and gradients without a send."""
    if schedule in ("gpipe", "1f1b"):
        return [rank]
    return [rank, 2 * world - 1 - rank] if schedule in ("zbv", "dualpipev") else [rank, rank + world]


class Stage(nn.Module):
    """A contiguous slice of Qwen3ForCausalLM: the token embedding if first, decoder layers, the final norm and
    lm_head if last. Its only input is the previous stage's output (token ids on the first stage), its only
    output the hidden states, which is all a PipelineStage sends between ranks. The last stage ends at the final
    norm: the loss applies the lm_head (`Stage.logits`) on the answer positions only, so the [micro, seq, 151936]
    logits of whole sequences are never made.

    No mask travels with the activations: the micro-batches are right-padded, so a real token's causal window
    never reaches a pad (pads come after every real token of the row), and causal attention alone
    (attention_mask=None: SDPA's is_causal) computes the real tokens exactly; the pads' outputs are discarded by
    the labels. Positions are 0..L-1 on every row for the same reason, and each stage recomputes the rotary
    cos/sin from them (it has no parameters). No KV cache: use_cache is off and nothing is passed."""

    def __init__(self, causal_lm, first_layer: int, num_layers: int, first: bool, last: bool):
        super().__init__()
        inner = causal_lm.model
        self.first_layer = first_layer
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[first_layer : first_layer + num_layers])
        self.rotary_emb = inner.rotary_emb
        self.norm = inner.norm if last else None
        # Qwen3-4B (and the tiny model) tie lm_head to the embedding. With two stages on two ranks the last
        # stage needs the matrix too: each rank built the whole model, so the last stage keeps its own copy of
        # the embedding weight in its lm_head. It is frozen, so the copies never drift and need none of the
        # gradient all-reduce between first and last stage that a trained tied embedding would.
        self.lm_head = causal_lm.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        cos_sin = self.rotary_emb(h, positions)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        return self.norm(h) if self.norm is not None else h

    def logits(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The lm_head at `positions` [micro, k] of the last stage's output: the logits the loss needs."""
        return self.lm_head(torch.take_along_dim(hidden, positions[..., None], dim=1))


def pipeline_stage(module: Stage, sid: int, n_stages: int, device, args, config) -> PipelineStage:
    """`module` as stage `sid`, given its shapes (meta tensors): token ids [micro, --max-length] into stage 0, hidden
    states [micro, --max-length, hidden] in the compute dtype out of each stage, requiring grad (a gradient comes
    back for each output and goes back for each input). Else the schedule infers them inside the timed step, at step
    1 and after each eval() (a mode flip): a real forward and backward of every stage, the loss on the last."""
    shape = (args.micro_batch_size, args.max_length)
    hidden = torch.empty(*shape, config.hidden_size, dtype=cli.torch_dtype(args.dtype), device="meta").requires_grad_()
    ids = torch.empty(shape, dtype=torch.long, device="meta")
    return PipelineStage(module, sid, n_stages, device, input_args=ids if sid == 0 else hidden, output_args=hidden)


def main() -> None:
    args = parse_args()
    # ---- process group: one process per GPU; each owns one pipeline stage (two but with GPipe and 1F1B).
    device = ranks.device_for(args, ranks.torchrun_local_rank())
    ranks.share_cpu_cores(device)
    world = int(os.environ["WORLD_SIZE"])
    if world < 2:
        raise errors.RunError("a pipeline needs at least 2 ranks: torchrun --nproc_per_node=2 (or more)")
    # Refused here, before the data, the group or any weight: stages must split the layers evenly.
    n_stages, per_stage = stage_layout(models.model_config(args.model).num_hidden_layers, world, args.schedule)
    # Pipelining is not data parallelism: every micro-batch of the step goes through every rank.
    accum = batching.accumulation_steps(args.batch_size, args.micro_batch_size, data_parallel=1)
    ranks.check_pipeline_microbatches(accum, n_stages, args.micro_batch_size, args.schedule, world)
    # Downloads before the group exists: no rank waits in a collective meanwhile (the group's 30-minute timeout).
    models.fetch(args.model)
    splits = data.load_splits(args.data, args.data_revision)
    ranks.init_process_group(device)  # "cpu:gloo,cuda:nccl" on GPUs
    rank = dist.get_rank()
    stage_ids = rank_stages(rank, world, args.schedule)
    dtype = cli.torch_dtype(args.dtype)
    run_dir, resume_from = ranks.on_rank0(rundir.resolve, args)

    # ---- data: the same global batches on every rank (rank 0 of 1 data-parallel replica)
    tokenizer, train_set, val_set, train_stats = prepare.encode_data(args, splits)
    batches = batching.GlobalBatches(train_set, args.batch_size, args.seed)
    # Every micro-batch, of every step and of the eval, is (micro, --max-length), the stages' given shape
    # (`pipeline_stage`), with the answer positions and their tokens as the last stage's target
    # (`batching.collate_pipeline`). The eval set every script takes, in groups of --batch-size examples (the
    # pipeline's shape); the last group is filled with rows that have no target tokens.
    eval_batch = functools.partial(batching.collate_pipeline, width=args.max_length, rows=args.batch_size)
    eval_batches = evaluation.micro_batches(val_set, args.eval_examples, args.batch_size, collate=eval_batch)
    eval_targets = sum(int((b["target"][:, 1] != data.IGNORE_INDEX).sum()) for b in eval_batches)

    # ---- model: every rank loads the whole frozen base (the tiny model: built from the seed) and builds the whole
    # LoRA adapter from the seed (the same weights and adapter init as the single-GPU run), then keeps its stages.
    # At 4B that fits. A model whose bf16 weights exceed one GPU (Qwen3-32B on 24 GB) would be built on the meta
    # device, each rank loading only its stages' weights; until then the planner refuses pp-ft for it.
    # Checkpointing: each decoder layer recomputes its activations in backward; the stages call the layers
    # directly, and a layer applies the checkpointing itself (transformers' GradientCheckpointingLayer).
    model = prepare.load_lora_model(args, dtype, device, len(tokenizer))
    checkpoint.seed_dropout(args.seed, stream=rank)  # each rank runs other layers: masks of their own
    # --compile: each decoder layer, before the stages take them; eager under a zero-bubble schedule (cli.eager_because)
    compiled = compilation.compile_layers(model, args.compile, eager_because=cli.eager_because(args))
    config = model.config
    model = lora.adapters_compute_in(model, dtype)  # bf16 compute (autocast), fp32 weights: as single-gpu-ft
    counts = models.parameter_counts(model)
    adapter_config = model.peft_config["default"]
    ranks.print0(f"parameters: {counts['trainable']:,} trainable (LoRA), {counts['frozen']:,} frozen")

    # ---- pipeline: a Stage per stage id, wrapped in a PipelineStage that owns its point-to-point buffers
    lm = model.base_model.model
    modules = [
        Stage(lm, sid * per_stage, per_stage, first=sid == 0, last=sid == n_stages - 1).train() for sid in stage_ids
    ]
    del model, lm  # the layers of other ranks' stages are freed here
    metrics.release_cached_memory(device)  # and their blocks go back to the driver
    stages = [pipeline_stage(m, sid, n_stages, device, args, config) for m, sid in zip(modules, stage_ids)]
    has_first, has_last = stages[0].is_first, stages[-1].is_last
    last_rank = next(r for r in range(world) if n_stages - 1 in rank_stages(r, world, args.schedule))

    # The loss of one micro-batch: its token-loss sum over the step's global target tokens, from the lm_head at
    # the answer positions of the last stage's output. The schedule sums what loss_fn returns into the gradients,
    # micro-batch by micro-batch; scale_grads=False stops it dividing them by m as well (its default assumes a
    # per-micro-batch mean loss).
    denominator = [1.0]

    def loss_fn(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = modules[-1].logits(hidden, target[:, 0])
        return batching.token_loss_sum(logits, target[:, 1]) / denominator[0]

    # The bubble's clock: every forward, loss and backward the schedule runs on this rank, timed as compute.
    timer_actions = pipeline_timing.ActionTimer(stages, device)
    schedule = SCHEDULES[args.schedule](
        stages if len(stages) > 1 else stages[0],
        n_microbatches=accum,
        loss_fn=timer_actions.timed_loss(loss_fn, n_stages - 1),
        scale_grads=False,
    )
    recorder = comm.CommRecorder(device)
    comm.record_stage_sends(stages, recorder)

    trainable = [p for m in modules for p in m.parameters() if p.requires_grad]  # this rank's stages only
    optimizer, scheduler = optim.adamw_cosine(trainable, args)

    # This rank's LoRA weights under the full model's adapter keys (global layer indices, unique across stages).
    named = [(n, p, m.first_layer) for m in modules for n, p in m.named_parameters() if p.requires_grad]
    adapter = {checkpoint.global_adapter_key(n, first): p for n, p, first in named}

    # ---- resume: each rank reads back its stages' LoRA weights, their optimizer state and its RNG (rank<r>.pt)
    start_step = 0
    if resume_from is not None:
        state = checkpoint.read_state(resume_from, ())
        if state.get("schedule") != args.schedule:  # another schedule deals the layers into other stages
            raise errors.RunError(
                f"{resume_from} was written with --schedule {state.get('schedule')}; resume it with it"
            )
        start_step = checkpoint.load_per_rank(resume_from, adapter, optimizer, scheduler)

    pipeline = {
        "schedule": args.schedule,
        "ranks": world,
        "stages": n_stages,
        "stages_per_rank": n_stages // world,
        "layers_per_stage": per_stage,
        "microbatches": accum,
    }
    log = rundir.start_log(
        args, run_dir, device, train_stats, counts, accum, start_step, resume_from, config, pipeline=pipeline
    )

    # torch's eval() fails on the V schedules: it still runs their backward actions, and a rank's two stages then
    # "can't steal_bwd_input" from each other. They evaluate with whole steps instead, their gradients dropped.
    v_shaped = args.schedule in ("zbv", "dualpipev")

    def eval_loss() -> float:
        # Forward only (a step on the V schedules), through the same pipeline; the loss returns plain sums here.
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        denominator[0] = 1.0
        for m in modules:
            m.eval()
        for b in eval_batches:
            losses: list[torch.Tensor] = []
            with torch.set_grad_enabled(v_shaped), lora.compute_autocast(device, dtype):
                b = batching.to_device(b, device)
                run_eval = schedule.step if v_shaped else schedule.eval
                run_eval(*([b["input_ids"]] if has_first else []), target=b["target"], losses=losses)
            if has_last:
                loss_sum += torch.stack(losses).detach().sum()
        for m in modules:
            m.train()
        optimizer.zero_grad(set_to_none=True)  # the V schedules' eval steps' gradients
        recorder.take()  # the eval's sends are not the training step's traffic
        dist.broadcast(loss_sum, src=last_rank)
        return loss_sum.item() / eval_targets

    # ---- train
    last_step = args.max_steps if args.stop_after is None else args.stop_after
    timeline: dict | None = None
    with StepProfiler(args.profile_steps, run_dir, device, rank, start_step=start_step) as profiler:
        for step in range(start_step, last_step):
            metrics.reset_peak_memory(device)
            denominator[0] = batches.n_target(step)  # target tokens of the whole global batch
            batch = batching.collate_pipeline([batches.data[i] for i in batches.indices(step)], args.max_length)
            batch = batching.to_device(batch, device)
            losses: list[torch.Tensor] = []
            with metrics.StepTimer(device) as timer:
                timer_actions.start()
                # The schedule splits the batch into m micro-batches along dim 0 and runs its forwards and
                # backwards in its order; the first stage reads the input ids, the last the targets. It runs
                # the stages' forwards in this thread, so autocast around it reaches them. return_outputs=False:
                # the last stage would otherwise keep every micro-batch's output to merge them, unused here.
                inputs = [batch["input_ids"]] if has_first else []
                target = batch["target"] if has_last else None
                with lora.compute_autocast(device, dtype):
                    schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
                timer_actions.stop()
                # The whole model's gradient norm: each rank holds its stages' share, summed across the ranks.
                grad_norm = optim.clip_grads_over_ranks(trainable, args.max_grad_norm)
                lr = optim.optimizer_step(optimizer, scheduler)  # AdamW on this rank's stages; the rate it ran at
            # The loss lives on the last stage: broadcast it on the device, then the step's one host sync for
            # every device scalar the metrics need.
            loss = torch.stack(losses).detach().sum() if has_last else torch.zeros((), device=device)
            dist.broadcast(loss, src=last_rank)
            loss, grad_norm = metrics.host_values(loss, grad_norm)
            # Busy = inside a stage's forward, loss or backward; idle = the rest of the schedule's run (waiting,
            # transfers). Python numbers from every rank: an object collective, over gloo on CUDA too.
            step_events, busy, pipe_time, forwards = timer_actions.read()
            every = [None] * world
            dist.all_gather_object(every, (busy, pipe_time, forwards, recorder.take()))
            row = log.row(
                step=step + 1,
                loss=loss,
                grad_norm=grad_norm,
                lr=lr,
                target_tokens=denominator[0],
                lengths=batches.lengths(step),  # real tokens of the global batch: known on the host
                seconds=timer.seconds,
                # the sends, busy / idle time, bubble, stage forwards of every rank
                **pipeline_timing.pipeline_step(every),
            )
            if (step + 1) % args.eval_every == 0 or step + 1 == args.max_steps:
                row["eval_loss"] = eval_loss()
            log.log(row)
            if step + 1 == last_step:  # the last step's actions, every rank's, for the timeline figure
                events = [None] * world
                dist.all_gather_object(events, step_events)
                timeline = {"ranks": world, "stages": n_stages, "microbatches": accum, "events": events}
            if (step + 1) % args.save_every == 0 or step + 1 == args.stop_after:
                checkpoint.save_per_rank(run_dir, step + 1, adapter, optimizer, scheduler, args, schedule=args.schedule)
            profiler.step(step + 1)
    log.close()

    # ---- save: one stock PEFT adapter for the whole model: rank 0 gathers every stage's LoRA weights, already
    # under the full model's keys (global layer indices)
    finished = last_step == args.max_steps
    if finished:
        checkpoint.save_gathered_adapter(run_dir / "adapter", adapter, adapter_config)
    if rank != 0:
        return
    if timeline is not None:
        (run_dir / "timeline.json").write_text(json.dumps(timeline))
    # The bubble's theory, equal-cost stages and free transfers: (p-1)/(m+p-1) for GPipe and 1F1B (Huang et al.
    # 2019, arXiv 1811.06965); for the multi-stage schedules, the action order they run, with equal F, I, W times
    # (ftkit.pipeline_timing.schedule_bubble): (p-1)/(v*m+p-1) for interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2),
    # (p-1)/(3*v*m+p-1) for the zero-bubble ones, ZB-H1's (p-1)(T_F+T_B-T_W) per stage (Qi et al. 2023, Table 2).
    order = schedule.pipeline_order if len(stages) > 1 else None  # GPipe's and 1F1B's run from a loop of their own
    theory = (world - 1) / (accum + world - 1) if order is None else pipeline_timing.schedule_bubble(order)
    rows = log.rows
    summary = log.run_summary(
        last_step,
        # The memory model knows GPipe's and 1F1B's in-flight micro-batches. No schedule keeps more than GPipe
        # does (at most m micro-batches' activations per layer), so GPipe's figure bounds the others.
        predicted=metrics.predicted_memory(
            config,
            args,
            "pp",
            world_size=world,
            pp_schedule="1f1b" if args.schedule == "1f1b" else "gpipe",
            num_microbatches=accum,
        ),
        note=metrics.memory_note(device, "(predicted: the busiest stage; beyond 1F1B: GPipe's, an upper bound) "),
        compile=compilation.compile_report(compiled),
        **pipeline_timing.bubble_summary(rows, world, theory, order, timeline),
        # Each micro-batch crosses every boundary between ranks once forward (activations) and once backward
        # (their gradients): micro x --max-length x hidden x bytes, 2 (stages - 1) m times per step (fewer on
        # the V schedules, whose middle boundary lies inside one rank).
        activation_bytes_per_microbatch=args.micro_batch_size * args.max_length * config.hidden_size * dtype.itemsize,
        **comm.summarize(rows),
        comm_note=comm.NOTES["pp-ft"],
        packing=getattr(args, "padded_why", "off (--no-packing)"),
    )
    rundir.finish(args, run_dir, summary, finished)


if __name__ == "__main__":
    ranks.launch(main)
