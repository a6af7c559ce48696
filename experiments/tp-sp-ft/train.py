"""Tensor + sequence parallel LoRA, hand-rolled: Megatron-style column/row-parallel linears with LoRA built in.

Every rank holds 1/N of each projection (attention heads, MLP columns) and all ranks run the SAME micro-batches
together; activations between the blocks are split along the sequence, so the norms and the residual stream
of each rank cover 1/N of the tokens:
    uv run torchrun --nproc_per_node=2 experiments/tp-sp-ft/train.py                    # Qwen3-4B, 2 GPUs, NCCL
    uv run torchrun --nproc_per_node=2 experiments/tp-sp-ft/train.py --smoke --data ../shared/data/qmsum-ami
    uv run torchrun --nproc_per_node=2 experiments/tp-sp-ft/train.py --smoke --no-sequence-parallel  # plain TP

Tensor parallelism does not split the batch: the data-parallel degree is 1, so accumulation is
--batch-size / --micro-batch-size and every rank computes the loss of the whole global batch (no scaling by
the world size). The collectives are written out below as autograd Functions that cite the equations they
implement: Megatron-LM's f and g (Shoeybi et al. 2019, arXiv 1909.08053, Sec. 3, Fig. 3) and the sequence-parallel
all-gather / reduce-scatter pair (Korthikanti et al. 2022, arXiv 2205.05198, Sec. 4.2.2, Fig. 5). The model stays
a transformers Qwen3ForCausalLM: only its seven projections are replaced, in place, by parallel ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import get_cosine_schedule_with_warmup

from ftkit import comm, data, metrics, models, run
from ftkit.memory import ModelShape, predict

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output features (heads, MLP columns) split
ROW = ("o_proj", "down_proj")  # input features split; each rank adds its partial sum into the reduction


def parse_args():
    p = run.common_parser(__doc__.splitlines()[0], experiment="tp-sp-ft")
    g = p.add_argument_group("tensor parallel")
    g.add_argument(
        "--no-sequence-parallel",
        dest="sequence_parallel",
        action="store_false",
        help="plain Megatron TP: the activations between blocks replicated on every rank, f/g all-reduces",
    )
    g.add_argument("--merge", action="store_true", help="also write the base with the LoRA merged in (merged/)")
    g.add_argument(
        "--dump-grads",
        action="store_true",
        help="write the first step's LoRA gradients, reassembled to full shapes, to grads-step1.safetensors",
    )
    g.add_argument(
        "--dump-logits",
        action="store_true",
        help="after training, write the logits of the first eval micro-batch to logits.pt (for a one-device check)",
    )
    args = run.resolve(p.parse_args())
    if args.resume:
        raise run.RunError("--resume is not implemented for tp-sp-ft: start a new run")
    return args


def check_tp_degree(config, tp: int) -> None:
    """Heads and MLP columns are dealt out whole: the degree must divide the KV heads (and so the query heads,
    a multiple of them) and the intermediate size. Checked from the config, before any weight is loaded."""
    reasons = []
    for name, n in (
        ("key/value heads", config.num_key_value_heads),
        ("attention heads", config.num_attention_heads),
        ("intermediate size", config.intermediate_size),
    ):
        if n % tp:
            reasons.append(f"{n} {name}")
    if reasons:
        ok = [d for d in range(1, config.num_key_value_heads + 1) if config.num_key_value_heads % d == 0]
        raise run.RunError(
            f"tensor-parallel degree {tp} does not divide the model's {', '.join(reasons)}: each rank must hold "
            f"whole heads; use --nproc_per_node in {ok}"
        )


# ---- the collectives. The flat *_tensor collectives concatenate / split along dim 0, so the sequence dim (1 of
# [batch, seq, hidden]) is moved to the front and back. The results are made contiguous: a strided view would be
# copied by every linear that reads it, and each LoRA A would save its own copy for backward.


def _all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    xs = x.transpose(0, 1).contiguous()
    out = xs.new_empty((xs.shape[0] * dist.get_world_size(group), *xs.shape[1:]))
    dist.all_gather_into_tensor(out, xs, group=group)
    return out.transpose(0, 1).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    xs = x.transpose(0, 1).contiguous()
    out = xs.new_empty((xs.shape[0] // dist.get_world_size(group), *xs.shape[1:]))
    dist.reduce_scatter_tensor(out, xs, group=group)
    return out.transpose(0, 1).contiguous()


def _local_seq(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].contiguous()


class CopyToTP(torch.autograd.Function):
    """Megatron's f (Shoeybi et al. 2019, Fig. 3): identity forward, all-reduce backward. It enters a block whose
    first linears are column-parallel: each rank's Y_i = X A_i gives only its part of dL/dX = sum_i dL/dY_i A_i^T."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward. It leaves a block whose last linear is row-parallel:
    Z = sum_i Y_i B_i, each rank holding one partial product."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherSeqToTP(torch.autograd.Function):
    """Sequence parallel's g (Korthikanti et al. 2022, Sec. 4.2.2, Fig. 5): all-gather along the sequence forward,
    reduce-scatter backward. Replaces f: the block sees the whole sequence, each rank's partial dL/dX is summed
    over ranks and each keeps its own tokens' share, the same bytes as f's all-reduce in two halves."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class ReduceScatterSeqFromTP(torch.autograd.Function):
    """Sequence parallel's g-bar: reduce-scatter along the sequence forward, all-gather backward. Replaces g: the
    partial sums of the row-parallel linear are summed and each rank keeps its tokens only."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


class ScatterSeq(torch.autograd.Function):
    """Into the sequence-parallel region (before layer 0): keep this rank's tokens; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _local_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


class GatherSeq(torch.autograd.Function):
    """Out of the sequence-parallel region (after the final norm): all-gather; every rank then computes the same
    logits and loss, so the gradient arriving here is the same on every rank and backward keeps this rank's part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _local_seq(grad, ctx.group), None


# ---- the parallel linears, LoRA built in. PEFT computes y = x W^T + s * (x A^T) B^T (A: r x in, B: out x r).


def lora_dropout(peft_linear) -> torch.nn.Module:
    """PEFT's dropout module for the adapter's input (nn.Identity at --lora-dropout 0). Every rank seeded its RNG
    alike and runs the same ops, so the ranks draw the same mask for a replicated input: the column layers'
    replicas see the same dropped X, as one GPU's layer would."""
    return peft_linear.lora_dropout["default"]


class ColumnParallelLoRALinear(torch.nn.Module):
    """Y_i = X W_i^T + s (X A^T) B_i^T: W and B split by output rows, A whole on every rank (its rank-r output
    is needed in full by every slice of B). X arrives already replicated (after f / the SP all-gather).

    A's gradient s (dY_i B_i)^T X is only rank i's share of the sum over output slices: `sync_replicated_grads`
    all-reduces it once per optimizer step."""

    def __init__(self, peft_linear, tp: int, rank: int):
        super().__init__()
        self.weight = torch.nn.Parameter(peft_linear.base_layer.weight.detach().chunk(tp, 0)[rank].clone(), False)
        self.lora_A = torch.nn.Parameter(peft_linear.lora_A["default"].weight.detach().clone())
        self.lora_B = torch.nn.Parameter(peft_linear.lora_B["default"].weight.detach().chunk(tp, 0)[rank].clone())
        self.scaling = peft_linear.scaling["default"]
        self.dropout = lora_dropout(peft_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As PEFT does: the adapter computes in its own dtype (fp32 on a bf16 base), the sum is cast back.
        lora = F.linear(F.linear(self.dropout(x.to(self.lora_A.dtype)), self.lora_A), self.lora_B) * self.scaling
        return (F.linear(x, self.weight) + lora).to(x.dtype)


class RowParallelLoRALinear(torch.nn.Module):
    """Z = sum_i [X_i W_i^T + s (X_i A_i^T) B^T]: W and A split by input columns, B whole. LoRA is linear, so B
    is applied before the sum and the adapter rides on the base layer's one reduction (g, or g-bar under SP):
    no collective of its own. B's gradient s (X_i A_i^T)^T dZ is rank i's share: all-reduced once per step."""

    def __init__(self, peft_linear, tp: int, rank: int, exit_block):
        super().__init__()
        self.weight = torch.nn.Parameter(peft_linear.base_layer.weight.detach().chunk(tp, 1)[rank].clone(), False)
        self.lora_A = torch.nn.Parameter(peft_linear.lora_A["default"].weight.detach().chunk(tp, 1)[rank].clone())
        self.lora_B = torch.nn.Parameter(peft_linear.lora_B["default"].weight.detach().clone())
        self.scaling = peft_linear.scaling["default"]
        self.dropout = lora_dropout(peft_linear)
        self.exit_block = exit_block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = F.linear(F.linear(self.dropout(x.to(self.lora_A.dtype)), self.lora_A), self.lora_B) * self.scaling
        return self.exit_block((F.linear(x, self.weight) + lora).to(x.dtype))


def parallelize(model, tp: int, rank: int, group, sequence_parallel: bool) -> None:
    """Replace the seven projections of every decoder layer, in place, and put the block-entry collective in front
    of the attention and the MLP. The model stays a Qwen3ForCausalLM; `model` is the PEFT-wrapped one, whose
    LoRA initialisation (seeded like every other experiment's) the parallel linears take over."""
    if sequence_parallel:

        def enter(x):
            return GatherSeqToTP.apply(x, group)

        def exit_block(x):
            return ReduceScatterSeqFromTP.apply(x, group)
    else:

        def enter(x):
            return CopyToTP.apply(x, group)

        def exit_block(x):
            return ReduceFromTP.apply(x, group)

    for layer in model.base_model.model.model.layers:
        for block, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (layer.mlp, None)):
            for name in names or ("gate_proj", "up_proj", "down_proj"):
                old = getattr(block, name)
                if name in COLUMN:
                    setattr(block, name, ColumnParallelLoRALinear(old, tp, rank))
                else:
                    setattr(block, name, RowParallelLoRALinear(old, tp, rank, exit_block))
        # One entry collective per block, shared by q/k/v (by gate/up), as in Megatron: a pre-hook on the block.
        layer.self_attn.register_forward_pre_hook(
            lambda mod, args, kwargs: (args, {**kwargs, "hidden_states": enter(kwargs["hidden_states"])}),
            with_kwargs=True,
        )
        layer.mlp.register_forward_pre_hook(lambda mod, args: (enter(args[0]),))
    inner = model.base_model.model.model
    if sequence_parallel:
        # The embedding, the rotary cos/sin and the causal mask are computed for the whole sequence before layer 0;
        # the decoder stack then runs on this rank's tokens, and the final norm's output is gathered for lm_head.
        inner.layers[0].register_forward_pre_hook(lambda mod, args: (ScatterSeq.apply(args[0], group), *args[1:]))
        inner.norm.register_forward_hook(lambda mod, args, out: GatherSeq.apply(out, group))


def parallel_linears(model):
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLoRALinear, RowParallelLoRALinear)):
            yield name, module


def replicated_lora(model) -> list[torch.nn.Parameter]:
    """The LoRA tensors every rank holds whole but computes only a share of the gradient of."""
    return [m.lora_A if isinstance(m, ColumnParallelLoRALinear) else m.lora_B for _, m in parallel_linears(model)]


def sync_replicated_grads(params: list[torch.nn.Parameter], group) -> None:
    """Sum the ranks' shares of the replicated LoRA gradients: one all-reduce per optimizer step, over all of them
    (a flat buffer), as Megatron-LM does for the LayerNorm weights that sequence parallelism leaves replicated.
    Without it each rank would step with its share and the replicas would drift apart."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p.grad))


def full_lora(model, group, grads: bool = False) -> dict[str, torch.Tensor]:
    """The whole adapter (or its gradient) under PEFT's names for the unsharded model: the sharded tensors are
    all-gathered and concatenated along the dim they were split on (B's rows of a column layer, A's columns of a
    row layer). Every rank takes part; the result is the same on every rank."""
    tp = dist.get_world_size(group)
    out = {}
    for name, m in parallel_linears(model):
        key = f"{name}.lora_{{}}.weight"
        for which in ("A", "B"):
            p = getattr(m, f"lora_{which}")
            t = (p.grad if grads else p).detach()
            split_dim = 0 if isinstance(m, ColumnParallelLoRALinear) and which == "B" else None
            if isinstance(m, RowParallelLoRALinear) and which == "A":
                split_dim = 1
            if split_dim is not None:
                parts = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(parts, t.contiguous(), group=group)
                t = torch.cat(parts, dim=split_dim)
            out[key.format(which)] = t.cpu().contiguous()
    return out


class SavedActivations:
    """Bytes autograd saves for backward while some modules run (distinct storages, parameters excluded): one
    decoder layer's per-rank activation memory, and its two norms', measured on the first micro-batch."""

    def __init__(self, model, regions: dict[str, list[torch.nn.Module]]):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.active: set[str] = set()
        self.saved: dict[str, dict[int, int]] = {name: {} for name in regions}
        self.handles = []
        for name, modules in regions.items():
            for m in modules:
                self.handles.append(m.register_forward_pre_hook(lambda *_, n=name: self.active.add(n)))
                self.handles.append(m.register_forward_hook(lambda *_, n=name: self.active.discard(n)))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            for name in self.active:
                self.saved[name][storage.data_ptr()] = storage.nbytes()
        return t  # kept alive by the graph, so its address is not reused by another saved tensor

    def bytes(self) -> dict[str, int]:
        for h in self.handles:
            h.remove()
        return {name: sum(s.values()) for name, s in self.saved.items()}


def pad_to_multiple(mb: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """Sequence parallelism splits the sequence into equal parts: right-pad to a multiple of the TP degree. The
    padding is masked out of attention (mask 0) and of the loss (label -100), so the step is unchanged."""
    extra = -mb["input_ids"].shape[1] % multiple
    if extra == 0:
        return mb
    fill = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {k: F.pad(v, (0, extra), value=fill[k]) for k, v in mb.items()}


def main() -> None:
    args = parse_args()
    # ---- process group: one process per GPU; all of them form one tensor-parallel group.
    if "LOCAL_RANK" not in os.environ:
        raise run.RunError(
            "launch this script with torchrun, one process per GPU:\n    uv run torchrun --nproc_per_node=2 "
            + " ".join(sys.argv)
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    device = run.device_for(args, local_rank)
    if device.type == "cpu":  # the ranks on this machine share its cores instead of each taking all of them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    # TP does not split the batch: data-parallel degree 1, every rank runs every micro-batch.
    accum = data.accumulation_steps(args.batch_size, args.micro_batch_size, data_parallel=1)
    dtype = run.torch_dtype(args.dtype)
    run_dir, _ = run.on_rank0(run.resolve_run_dir, args)

    def print0(*text: str) -> None:
        if rank == 0:
            print(*text, flush=True)

    # ---- data: every rank builds the same global batches and runs all of them (rank 0 of a world of 1).
    splits = data.load_splits(args.data, args.data_revision)
    with run.rank0_first():
        tokenizer = models.load_tokenizer(args.model, data.corpus(splits["train"]))
    check_tp_degree(models.model_config(args.model, len(tokenizer)), tp)
    formatter = data.ChatFormatter(tokenizer, args.max_length)
    train_set, train_stats = formatter.encode_all(splits["train"])
    val_set, _ = formatter.encode_all(splits["val"])
    print0(f"train: {train_stats.describe()}")
    batches = data.GlobalBatches(train_set, args.batch_size, args.seed)
    eval_batches = [
        pad_to_multiple(mb, tp) for mb in run.eval_micro_batches(val_set, args.eval_examples, args.micro_batch_size)
    ]

    # ---- model: the whole bf16 base and the PEFT LoRA are built on every rank (the same seed, the same init),
    # then each rank keeps its slices. A real-size run would load only its shard; here clarity wins.
    with run.rank0_first():
        model = models.load_model(
            args.model, quant="none", dtype=dtype, device=device, seed=args.seed, vocab_size=len(tokenizer)
        )
    config = model.config
    if args.grad_checkpointing:
        # Non-reentrant: backward recomputes each layer, and with it the layer's forward collectives.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = models.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
    peft_config = model.peft_config["default"]
    n_lora = models.parameter_counts(model)["trainable"]  # the whole adapter, for the FLOP count
    # ---- tensor parallel: the projections become column/row-parallel linears holding this rank's slices. The
    # norms are untouched: frozen, replicated, and (under SP) run on this rank's tokens.
    parallelize(model, tp, rank, group, args.sequence_parallel)
    counts = models.parameter_counts(model)
    print0(f"parameters on this rank: {counts['trainable']:,} trainable (LoRA), {counts['frozen']:,} frozen")
    replicated = replicated_lora(model)
    replicated_bytes = sum(p.numel() * p.element_size() for p in replicated)

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)

    hardware = metrics.hardware(device, world_size=tp)
    run.on_rank0(
        run.init_run_dir,
        run_dir,
        args,
        {
            "args": run.args_dict(args),
            "versions": metrics.versions(),
            "hardware": hardware,
            "data": train_stats.as_dict(),
            "parameters": counts,
            "accumulation_steps": accum,
            "tensor_parallel": tp,
        },
        resume_step=None,
    )
    log = metrics.MetricsLog(run_dir, rank=rank, total_steps=args.max_steps, progress=args.progress)
    peak = metrics.peak_flops(device)
    recorder = comm.CommRecorder(device)

    def norm_sq(params: list[torch.nn.Parameter]) -> torch.Tensor:
        return sum((p.grad.float() ** 2).sum() for p in params)

    # Per-rank activation memory, measured on the first micro-batch in layer 1 (layer 0's input needs no gradient,
    # so it saves less): what SP divides by the TP degree is the norms' part.
    layer = model.base_model.model.model.layers[1]
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    saved = SavedActivations(model, {"layer": [layer], "norms": norms})
    measured_tokens = 0

    # ---- train
    model.train()
    activation_elems = 0  # elements of the block-boundary activations, for the comm theory in the summary
    for step in range(args.max_steps):
        metrics.reset_peak_memory(device)
        n_target = batches.n_target(step)  # the whole global batch's target tokens, on every rank
        loss_sum = torch.zeros((), device=device)
        seq_lens: list[int] = []
        with metrics.StepTimer(device) as timer:
            with comm.recording(recorder):  # the technique's traffic: the blocks' collectives + the LoRA sync
                for mb in batches.micro_batches(step, args.micro_batch_size):
                    mb = {k: v.to(device) for k, v in pad_to_multiple(mb, tp).items()}
                    measure = torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)
                    with contextlib.nullcontext() if measured_tokens else measure:
                        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
                    if not measured_tokens:
                        measured = saved.bytes()
                        local_seq = mb["input_ids"].shape[1] // (tp if args.sequence_parallel else 1)
                        measured_tokens = mb["input_ids"].shape[0] * local_seq
                    loss = data.token_loss_sum(logits, mb["labels"]) / n_target
                    loss.backward()  # the same loss on every rank: no scaling by the world size
                    loss_sum += loss.detach()
                    seq_lens += mb["attention_mask"].sum(1).tolist()
                    activation_elems += mb["input_ids"].numel() * config.hidden_size
                sync_replicated_grads(replicated, group)
            if args.dump_grads and step == 0:
                grads = full_lora(model, group, grads=True)
                if rank == 0:
                    safetensors.torch.save_file(grads, run_dir / "grads-step1.safetensors")
            # The global gradient norm: replicated tensors count once, the sharded ones summed over ranks (one
            # scalar all-reduce, outside the accounting like the metrics' own).
            sharded = [p for p in trainable if all(p is not q for q in replicated)]
            sq = norm_sq(sharded)
            dist.all_reduce(sq, group=group)
            grad_norm = (sq + norm_sq(replicated)).sqrt()
            clip = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
            torch.nn.utils.clip_grads_with_norm_(trainable, clip, grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        step_comm = recorder.take()
        flops = metrics.step_flops(seq_lens, config, n_lora)
        row = {
            "step": step + 1,
            "loss": loss_sum.item(),  # every rank computed the whole batch's loss
            "lr": scheduler.get_last_lr()[0],
            "grad_norm": grad_norm.item(),
            "target_tokens": n_target,
            "tokens": sum(seq_lens),
            "step_time_s": timer.seconds,
            "tokens_per_s": sum(seq_lens) / timer.seconds,
            "mfu": flops / (timer.seconds * peak * tp) if peak else None,
            "comm": step_comm,
            "activation_bytes": activation_elems * torch.finfo(dtype).bits // 8,
            **metrics.peak_memory(device),
        }
        activation_elems = 0
        if (step + 1) % args.eval_every == 0 or step + 1 == args.max_steps:
            sums = run.eval_loss_sums(model, eval_batches, device)  # the same on every rank
            row["eval_loss"] = (sums[0] / sums[1]).item()
        log.log(row)
    log.close()

    # ---- save: the shards reassembled into one stock PEFT adapter, and optionally the merged model
    adapter = full_lora(model, group)
    if args.dump_logits:
        model.eval()
        with torch.no_grad():
            mb = {k: v.to(device) for k, v in eval_batches[0].items()}
            logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        if rank == 0:
            torch.save({"batch": eval_batches[0], "logits": logits.cpu()}, run_dir / "logits.pt")
    if rank != 0:
        return
    (run_dir / "adapter").mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(adapter, run_dir / "adapter" / "adapter_model.safetensors", metadata={"format": "pt"})
    peft_config.save_pretrained(run_dir / "adapter")
    if args.merge:
        merge(args, run_dir, len(tokenizer), dtype)
    shape = ModelShape.from_config(config)
    predicted = predict(
        shape,
        technique="tp-sp" if args.sequence_parallel else "tp",
        quant="none",
        dtype=args.dtype,
        world_size=tp,
        lora_rank=args.lora_rank,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.max_length,
        grad_checkpointing=args.grad_checkpointing,
    ).as_dict()
    summary = {
        "status": "completed",
        "run_dir": str(run_dir),
        "config": run.args_dict(args),
        "versions": metrics.versions(),
        "hardware": hardware,
        "data": train_stats.as_dict(),
        "parameters": counts,
        "accumulation_steps": accum,
        "tensor_parallel": tp,
        "sequence_parallel": args.sequence_parallel,
        **log.summary(),
        # Theory per optimizer step: each decoder layer's two blocks enter with f (all-reduce in backward) or the
        # SP all-gather (reduce-scatter in backward) and leave with g (all-reduce in forward) or the SP
        # reduce-scatter (all-gather in backward), each on one activation [micro, seq, hidden]
        # (`activation_bytes` per step in the metrics: summed over micro-batches); checkpointing repeats the
        # forward ones in backward. Plus one all-reduce of the replicated LoRA gradients.
        "replicated_lora_grad_bytes": replicated_bytes,
        **comm.summarize(log.rows),
        "comm_note": "per optimizer step, every torch.distributed collective inside the step (ftkit/comm.py): "
        "bytes of the whole buffer (all-reduce tensor, all-gather output, reduce-scatter input); the metrics' "
        "own reductions and the adapter reassembly are not counted",
        "mfu_convention": metrics.MFU_CONVENTION,
        "peak_flops": peak,
        "memory_predicted": predicted,
        # Layer 1 on rank 0, first micro-batch: `tokens` is what this rank's norms and residual stream hold.
        "activations_measured": {**measured, "tokens": measured_tokens},
        "memory_note": "predicted: the memory model (ftkit/memory.py) at micro-batch x --max-length; measured on "
        "rank 0: "
        + (
            "CUDA peak allocated"
            if device.type == "cuda"
            else "process peak RSS, which also counts Python, "
            "libraries and data, so it is not comparable with the model's GPU bytes"
        ),
    }
    run.write_summary(run_dir, summary)
    print(f"run directory: {run_dir}\nadapter: {run_dir / 'adapter'}")


def merge(args, run_dir, vocab_size: int, dtype: torch.dtype) -> None:
    """Base + LoRA in one ordinary transformers checkpoint (merged/), built on the CPU from the reassembled
    adapter with PEFT's own merge, so it is exactly what `PeftModel.merge_and_unload` would give any user."""
    from peft import PeftModel

    base = models.load_model(
        args.model, quant="none", dtype=dtype, device=torch.device("cpu"), seed=args.seed, vocab_size=vocab_size
    )
    merged = PeftModel.from_pretrained(base, run_dir / "adapter").merge_and_unload()
    merged.save_pretrained(run_dir / "merged")
    (run_dir / "merged" / "ftkit.json").write_text(json.dumps({"model": args.model, "seed": args.seed}))


if __name__ == "__main__":
    code = 0
    try:
        main()
    except (run.RunError, data.DataError, run.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    # Leave without running the C++ static destructors (with gloo about 1 launch in 10 otherwise aborts at exit).
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
