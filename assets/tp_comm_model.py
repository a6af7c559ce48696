"""A stated model, not a measurement: bytes each GPU sends per micro-batch for LoRA on Qwen3-4B with 2 GPUs, tensor
(+ sequence) parallel vs FSDP, and what that costs on PCIe and on NVLink.

    uv run python assets/tp_comm_model.py [--tokens 2048] [--world 2]

- TP / TP+SP (experiments/tp-sp-ft): per decoder layer 4 collectives on one bf16 activation [tokens, hidden]:
  plain TP 4 all-reduces, each 2(N-1)/N of the buffer on the wire; SP 4 all-gathers + 4 reduce-scatters, each
  (N-1)/N: the same wire bytes (Korthikanti et al. 2022, arXiv 2205.05198, Sec. 4.2.2). They sit between
  matmuls that need their result: on the critical path.
- FSDP with a frozen bf16 base (experiments/fsdp-ft): every micro-batch all-gathers each layer's weights in
  forward and again in backward (reshard after forward), (N-1)/N of the weights each time; the LoRA gradients'
  reduce-scatter is small. These can be prefetched under the previous layer's compute.
- Links, per direction, from ftkit/hardware.py (each with its datasheet): PCIe 4.0 x16 31.5 GB/s, NVLink 4 on
  H100 SXM 450 GB/s, each at the planner's assumed 80% of it (ftkit/plan/settings.py's link_efficiency). Bandwidth
  terms only (no latency).
- Compute, for scale: 4 x params FLOPs per token for a frozen-base LoRA step (forward 2N, input-gradient 2N;
  ftkit/metrics.py's MFU convention), at the planner's assumed 40% of an H100 SXM's dense bf16 peak.
"""

from __future__ import annotations

import argparse

from ftkit import hardware
from ftkit.comm import ring_wire_bytes
from ftkit.memory import QWEN3_4B
from ftkit.plan import hosts, settings

BF16 = 2
LINKS = {"PCIe 4.0 x16": hardware.LINKS["pcie4"], "NVLink 4": hardware.LINKS["nvlink4"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (micro-batch x sequence)")
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()
    s, n = QWEN3_4B, args.world
    activation = args.tokens * s.hidden * BF16
    tp = s.layers * 4 * ring_wire_bytes("all_reduce", activation, n)
    sp = (
        s.layers * 4 * (ring_wire_bytes("all_gather", activation, n) + ring_wire_bytes("reduce_scatter", activation, n))
    )
    fsdp = 2 * ring_wire_bytes("all_gather", s.n_params() * BF16, n)
    compute = 4 * s.n_params() * args.tokens / (hosts.ASSUMED_MFU * hardware.gpu("h100-sxm").bf16_flops)
    per_token_tp = s.layers * 4 * ring_wire_bytes("all_reduce", s.hidden * BF16, n)
    print(f"Qwen3-4B, {n} GPUs, {args.tokens} tokens per micro-batch, bf16; bytes sent per GPU per micro-batch")
    print(f"  TP (all-reduce)         {tp / 1e9:8.3f} GB")
    print(f"  TP+SP (AG + RS)         {sp / 1e9:8.3f} GB")
    print(f"  FSDP (weights, fwd+bwd) {fsdp / 1e9:8.3f} GB")
    print(f"  break-even: TP sends less than FSDP below {fsdp / per_token_tp:,.0f} tokens per micro-batch")
    print(f"  compute at {hosts.ASSUMED_MFU:.0%} MFU on an H100 SXM: {compute * 1e3:.0f} ms")
    for name, link in LINKS.items():
        bw = link.bytes_per_s * settings.Setting.link_efficiency
        print(
            f"  {name} ({bw / 1e9:g} GB/s) TP/TP+SP {tp / bw * 1e3:7.1f} ms (on the critical path)   "
            f"FSDP {fsdp / bw * 1e3:7.1f} ms"
        )


if __name__ == "__main__":
    main()
