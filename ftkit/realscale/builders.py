"""The model as each script builds it, from the script's own code, at Qwen3-4B's shape: `build` (on the meta
device; sharded by fsdp-ft's `shard_model`, tp-ft's plan or tp-sp-ft's `parallelize`), `materialise` (fake
storage), pp-ft's stage and schedule (`pipeline`) and ddp-ft's DDP wrapper (`wrap_ddp`)."""

from __future__ import annotations

from unittest import mock

import torch

from ftkit import batching, cli, comm, lora, models
from ftkit.realscale.nf4 import linear4bit_layers, pack_meta, quantize_fake, quantize_meta, settings_4bit


def build(technique: str, script, args, world: int, device: torch.device, layers: int | None = None):
    """The model as the script builds it, on the meta device (shapes only), and for FSDP sharded by the script's
    own `shard_model`, for TP by its own `lora_aware_plan`, for TP+SP by its own `parallelize`; (model, parameter
    counts: the whole model's). cp: the model with cp-ft's attention, every rank the whole of it."""
    dtype = cli.torch_dtype(args.dtype)
    shape = {} if layers is None else {"num_hidden_layers": layers}
    with mock.patch.dict(models.QWEN3_4B_CONFIG, shape):
        model = models.load_model(  # cp-ft's attention: its `cp_attention`, registered when its script was loaded
            args.model,
            quant="none",
            dtype=dtype,
            device=torch.device("meta"),
            seed=args.seed,
            attn="cp" if technique == "cp" else "sdpa",
        )
    if technique == "fsdp":  # as experiments/fsdp-ft/train.py: (a 4-bit base,) checkpointing, PEFT, then FSDP2
        if args.quant == "nf4":
            quantize_meta(model, dtype)
        if args.grad_checkpointing:
            lora.checkpoint_activations(model, checkpointing=args.checkpointing)
        model = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
        counts = models.parameter_counts(model)
        if args.quant == "nf4":
            pack_meta(model)  # the script shards the loaded (quantized) weights: their packed uint8 codes
        script.shard_model(model, args, device, world)
    elif technique == "tp":  # as experiments/tp-ft/train.py: checkpointing, PEFT, then each layer's plan
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        if args.grad_checkpointing:
            lora.checkpoint_activations(model, checkpointing=args.checkpointing)
        model = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
        model = lora.adapters_compute_in(model, dtype)
        counts = models.parameter_counts(model)
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
        for layer in model.base_model.model.model.layers:
            parallelize_module(layer, mesh, script.lora_aware_plan())
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
    elif technique == "cp":  # as experiments/cp-ft/train.py: the whole bf16 base, checkpointing, PEFT
        if args.grad_checkpointing:
            lora.checkpoint_activations(model, checkpointing=args.checkpointing)
        model = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
        model = lora.adapters_compute_in(model, dtype)
        counts = models.parameter_counts(model)
    elif technique == "pp":  # as experiments/pp-ft/train.py (prepare.load_lora_model): checkpointing, PEFT; its stages
        # are cut from the model once it has storage (`pipeline`), as the script cuts them from the loaded model
        if args.grad_checkpointing:
            lora.checkpoint_activations(model, checkpointing=args.checkpointing)
        model = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
        model = lora.adapters_compute_in(model, dtype)
        counts = models.parameter_counts(model)
    elif technique == "tp-sp":  # as experiments/tp-sp-ft/train.py: checkpointing, PEFT, then its parallel linears
        import torch.distributed as dist

        if args.grad_checkpointing:
            lora.checkpoint_activations(model, checkpointing=args.checkpointing)
        model = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
        counts = models.parameter_counts(model)
        script.parallelize(model, world, 0, dist.group.WORLD, args.sequence_parallel)
    else:  # as experiments/single-gpu-ft and ddp-ft/train.py
        if args.quant == "nf4":
            quantize_meta(model, dtype)
        model = lora.freeze_base(model, args.checkpointing, reentrant=getattr(args, "reentrant_checkpointing", False))
        model = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
        model = lora.adapters_compute_in(model, dtype)
        counts = models.parameter_counts(model)
    return model, counts


def materialise(model, device: torch.device) -> list[torch.Tensor]:
    """Storage (fake, inside FakeTensorMode) for every parameter and buffer, and the RoPE frequencies, a
    non-persistent buffer that to_empty leaves uninitialised, recomputed as the scripts do; a 4-bit base's
    projections quantized (`quantize_fake`), whose constants it returns."""
    for module in linear4bit_layers(model):  # to_empty replaces a Params4bit with a plain tensor: keep its settings
        if not hasattr(module, "settings_4bit"):
            module.settings_4bit = settings_4bit(module.weight)
    model.to_empty(device=device)
    # to_empty gives each module its own new tensor, so a parameter two modules share (the tied embedding and
    # lm_head) comes out as two: tie them again, as loading ties them. (FSDP2 keeps one shard for a shared one.)
    model.base_model.model.tie_weights()
    inner = model.base_model.model.model
    inner.rotary_emb = type(inner.rotary_emb)(inner.config).to(device)
    return quantize_fake(model)


def pipeline(script, model, args, world: int, device: torch.device, microbatches: int, denominator: int):
    """This rank's stage of experiments/pp-ft/train.py, cut from the model by the script's own `stage_layout`,
    `rank_stages` and `Stage`, in a PipelineStage, and the script's schedule (`SCHEDULES`) over it with pp-ft's loss
    function, built as the script builds them; (the Stage module, the PipelineStage, the schedule). Call after
    `materialise`: the Stage keeps the model's rotary embedding, which materialise replaces with one whose
    frequencies are computed.

    The PipelineStage is the script's own (`pipeline_stage`), given its metadata (input_args, output_args), so no
    shapes are inferred: that would exchange them with the neighbour stages over the group, and the fake group
    delivers nothing.

    Once an output's send completes, the stage drops its reference to it (backward starts from its autograd node),
    but only for an output whose type is exactly torch.Tensor; a FakeTensor, a subclass, would be kept until its
    backward, one [micro, seq, hidden] tensor per micro-batch in flight that a run on the GPU frees. Here it is
    judged as the plain tensor it stands for (the later checks, DDP and a dw_builder, do not apply: this stage has
    neither). The last stage sends no output: it keeps each one until its micro-batch's backward, as on the GPU
    (pp-ft asks for no merged output, which would keep them to the step's end)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensor

    config = model.config
    n_stages, per_stage = script.stage_layout(config.num_hidden_layers, world, args.schedule)
    [sid] = script.rank_stages(dist.get_rank(), world, args.schedule)  # GPipe, 1F1B: one stage a rank (PP_SCHEDULES)
    module = script.Stage(model.base_model.model, sid * per_stage, per_stage, first=sid == 0, last=sid == n_stages - 1)
    stage = script.pipeline_stage(module.train(), sid, n_stages, device, args, config)
    releasable = stage._output_slot_is_releasable

    def releasable_as_a_plain_tensor(output) -> tuple[bool, str]:
        if type(output) is FakeTensor and not stage.is_last:
            return True, ""
        return releasable(output)

    stage._output_slot_is_releasable = releasable_as_a_plain_tensor

    def loss_fn(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # pp-ft's loss_fn (a closure in its main), restated: the lm_head at the answer positions of the last
        # stage's output, the token-loss sum over the global batch's target tokens.
        logits = module.logits(hidden, target[:, 0])
        return batching.token_loss_sum(logits, target[:, 1]) / denominator

    schedule = script.SCHEDULES[args.schedule](stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return module, stage, schedule


class NoBucketRebuild:
    """DDP's reducer, as DDP's Python side calls it, with the bucket rebuild answered "not rebuilt"."""

    def __init__(self, reducer):
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str):
        return getattr(self._reducer, name)


def wrap_ddp(model, args, recorder: comm.CommRecorder, stand_ins: list[str]):
    """experiments/ddp-ft/train.py's DDP wrapper, built on fake tensors, its buckets' all-reduces recorded as
    `comm.register_ddp_hook` records them."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrapped = DDP(
        model,
        device_ids=None,
        bucket_cap_mb=args.bucket_cap_mb,
        find_unused_parameters=args.find_unused_parameters,
        gradient_as_bucket_view=args.gradient_as_bucket_view,
        static_graph=args.static_graph,
        **comm.ddp_no_forward_buffer_sync(),
        init_sync=False,  # no check or broadcast of the parameters across ranks: fake tensors have no data to send
    )

    def hook(state, bucket):  # the fake group's all-reduce future carries no tensor: return the bucket as it is
        buffer = bucket.buffer()
        recorder.completed("all_reduce", recorder.issued("all_reduce", comm.nbytes(buffer)))
        future = torch.futures.Future()
        future.set_result(buffer)
        return future

    wrapped.register_comm_hook(None, hook)
    # After the first backward DDP rebuilds its buckets in the order the gradients arrived, copying them in C++,
    # which cannot read a fake tensor: the buckets stay in their first order (the same bytes).
    wrapped.reducer = NoBucketRebuild(wrapped.reducer)
    # DDP's reducer keeps one flat fp32 bucket copy of the trainable gradients for the whole run (none with
    # --gradient-as-bucket-view, where the gradients are views into the buckets). Its C++ constructor allocates them
    # before the tracker starts; the tracker registers them when a backward first writes them (they are an op's
    # output it has not seen), and counts them from then on.
    buckets = 0 if args.gradient_as_bucket_view else comm.nbytes([p for p in model.parameters() if p.requires_grad])
    stand_ins.append(
        "DDP is built without its start-up check and broadcast of the parameters across ranks (init_sync=False: "
        "fake tensors have no data); its comm hook records each bucket's bytes as ftkit/comm.py's does and returns "
        "the bucket as it is (the fake group's all-reduce future carries no tensor); the buckets are not rebuilt in "
        f"the gradients' arrival order after the first backward (a C++ copy of their data); its buckets ({buckets:,} "
        "bytes: one fp32 copy of the trainable gradients) are allocated at construction, before the memory tracker "
        "starts, and tracked from the first optimizer step's synchronising backward, which writes them, as 'Temp': "
        "the second step, which holds all the first one did and them, is the peak"
    )
    return wrapped
