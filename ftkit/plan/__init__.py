"""Which technique for this job on these GPUs: predicted memory per GPU, step time and tokens/s for every
experiment and mesh shape the GPUs allow, and a recommendation with its reason.

    uv run python -m ftkit.plan --model Qwen/Qwen3-4B --gpus 2 --gpu rtx4090
    uv run python -m ftkit.plan --model Qwen/Qwen3-32B --gpus 16 --nodes 2 --link nvlink4 --inter-node-link ib-ndr \\
        --batch-size 64 --json

A model, not a measurement; every term is a formula in this repository or a stated assumption:
- Memory: `ftkit/memory.py`'s `predict` for the experiment's configuration (its quantization, the flags given
  here), times MEMORY_MARGIN, plus --reserve-gib for the CUDA context and NCCL buffers. The margin covers what the
  memory model leaves out: tests/test_plan.py checks it against the peaks tracked at Qwen3-4B's shape
  (devlogs/runs/realscale/).
- Compute: the MFU convention's FLOPs (`metrics.step_flops`, over the layout's rows: below) plus the
  forward that activation checkpointing recomputes, at --mfu of the GPU's dense bf16 peak (`ftkit/hardware.py`),
  split over the GPUs the experiment uses (with data parallelism, rank 0's rows: the fullest). 0.4 is an
  assumption (well-tuned dense training: PaLM reports 46.2%); single-gpu-ft measured 4.8% on an H100
  (devlogs/single-gpu-ft.md), whose step was bound by its host, not its GPU: the host model below (`--host h100-vm`)
  reproduces it.
- NF4 (QLoRA): every pass over a layer (forward, recomputed forward, backward) dequantizes its weights, reading
  the 4-bit weights and writing bf16 ones through the GPU's memory at its datasheet bandwidth.
- Communication: the alpha-beta model of a ring (bytes from `comm.ring_wire_bytes`, at --link-efficiency of the
  link's bandwidth, plus a latency per message), on the slowest link the group spans. Only what the technique
  cannot hide is added to the step:
  - DDP: the fp32 LoRA gradients' all-reduce, once per optimizer step, overlapped with the last micro-batch's
    backward (taken as half that micro-batch's compute);
  - FSDP: each micro-batch all-gathers the bf16 weights (with --quant nf4 the layers' packed 4-bit codes, 0.5 B per
    weight) twice (forward, backward), prefetched under the same micro-batch's compute, except the first layer's;
    the LoRA gradients' reduce-scatter like DDP's all-reduce;
  - TP (tp-ft, DTensor): per layer and micro-batch, the forward all-reduces of o_proj and down_proj and the
    backward all-reduces of the five column layers' inputs (q, k, v, gate, up), plus the forward ones again when
    checkpointing recomputes: 7 or 9 all-reduces of [micro, seq, hidden] on the critical path;
  - TP+SP (tp-sp-ft): Megatron's pairs, one per block entry and exit: 4 collectives per layer (5.5 with the
    recompute, which repeats the two entries' all-gathers and the attention exit's reduce-scatter but stops
    before the MLP's exit: `comm.tp_sp_collective_theory`), each all-gather + reduce-scatter or all-reduce, the
    same wire bytes, on the critical path;
  - PP (pp-ft, 1F1B): the bubble, (p - 1) / m of the compute (Narayanan et al. 2021, arXiv 2104.04473, Sec. 2.2),
    and the point-to-point activations of the fill and the drain (2 (p - 1) transfers; the steady state's are
    taken as hidden);
  - FSDP x TP on a 2-D mesh (fsdp-tp-ft): tp-ft's collectives inside a node, FSDP's gathers of the TP slices
    over the `dp` dimension, across nodes when there are several;
  - CP (cp-ft): per layer and micro-batch, K and V all-gathered (twice with checkpointing's recompute) and their
    gradients reduce-scattered, on the critical path (the script does not overlap them), then the LoRA gradients'
    all-reduce; each rank computes 1/cp of every sequence, its chunks balancing the causal attention. Planned on
    the "full" layout only (cp-ft trains whole meetings one a row, not the other scripts' packed rows).
Not modelled: kernel efficiency varying with shapes (one --mfu for all), the pipeline schedule's own overheads,
congestion.

The host and the batch layout (issue 30; `--host`, `--layout`, `--compile`). On an H100 the eager step was bound by
its host: the GPU computed 3.39 s of a 5.77 s step (devlogs/single-gpu-ft.md). With `--host h100-vm`:
- Host: each micro-batch costs the host the ops it dispatches (`HOST_OPS`: aten ops counted per micro-batch by
  assets/host_ops.py on a CPU as CUDA dispatches them, checked against the H100 profiles' op counts; for layers the
  script compiles, as on CUDA by default (`--compile`; not tp-sp-ft's, cp-ft's, 4-bit fsdp-ft's: techniques.compiled),
  the compiled layers' kernels and extern ops, inductor's CPU kernels standing in for Triton's: a prediction) times
  a cost per op calibrated on the committed H100 profile (`HOSTS`), plus, with NF4, a cost per 4-bit linear pass the
  op count does not carry (`NF4_PASS_S`, calibrated on the first H100 session's QLoRA/LoRA pair). A rank's host
  dispatches the ops of the layers it holds; what DDP, FSDP and DTensor add on the host is not counted.
- GPU: the FLOPs the kernels compute (padding and the recompute included, `micro_flops`) at the fraction of the
  peak the same profiled step's kernels reached while the GPU computed (`--mfu` overrides it).
- Step: the host runs ahead of the GPU (`queue`): a micro-batch costs max(host, GPU), the technique's exposed
  communication and bubble on top, as above.
- Layout: "auto" (the default) each script's own: "packed" where AMI's examples reach --max-length (up to 20,632
  tokens; pp-ft "fixed", its stages' one shape), "full" beyond, where --max-length is for longer data (cp-ft's
  whole meetings); "full" every row --max-length real tokens, as before issue 30; "padded", "packed", "masked" and
  "fixed" (one example per row, right-padded to --max-length) the AMI training examples (`AMI_LENGTHS`: in Qwen3's
  tokens, or with `--tokenizer tiny` the tiny tokenizer's, which the committed H100 runs tokenized) in the scripts'
  own global batches (`batching.GlobalBatches`, `batching.pack`) over an
  epoch: the step time is their median, tokens/s their real tokens over their time; memory counts the lm_head at
  the most answer positions a row holds (a packed row of 2,048 up to 446), not --answer-tokens.
Without `--host` the host costs nothing and the GPU computes at 40%: the GPU-only model above, on the scripts' layout,
whose numbers the posts quote. Every output with the host or an AMI layout is labelled a prediction and lists what it
assumes.

The layout each run fits (`--fit auto`, the default, as the scripts' on CUDA): the scripts choose their micro-batch
(a packed row of N tokens or --micro-batch-size rows) and checkpointing before the model loads, the fastest the
memory model says fits (ftkit/fit.py). The planner prices each experiment that does so at the layout its run would
choose, chosen as the run chooses it (`fitting.as_run_chooses`: the GPU's calibrated host and own link, whatever
--host and --link say here), so that the recommendation is what the run does; a layout flag or `--fit off` prices
every experiment at the flags' layout (the reference configuration's).

The modules, each of one concern:
- `settings`: the job and the GPUs (`Setting`), the Qwen3 models' config keys;
- `hosts`: the host's op counts and their calibration on the committed H100 runs;
- `layouts`: the batch layouts, the optimizer steps each gives as rank 0's micro-batches;
- `timing`: one step's time, the queue of host and GPU, the collectives, the bubble;
- `techniques`: every experiment and mesh the GPUs allow, and each one's row (memory, step time, tokens/s);
- `fitting`: --fit auto's choice of layout, a run's (ftkit/fit.py) and each planner row's;
- `recommendation`: the answer, the recommendation and its reason, what a prediction assumes;
- `__main__`: the command, `python -m ftkit.plan`.
"""
