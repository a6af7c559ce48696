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
- Links, per direction, from datasheets: PCIe 4.0 x16 32 GB/s, of which 25 GB/s is taken as achievable;
  NVLink 4 on H100 SXM 450 GB/s (900 GB/s both directions). Bandwidth terms only (no latency).
- Compute, for scale: 4 x params FLOPs per token for a frozen-base LoRA step (forward 2N, input-gradient 2N;
  ftkit/metrics.py's MFU convention), at 40% of an H100's 989 TFLOP/s dense bf16.
"""

from __future__ import annotations

import argparse

from ftkit.comm import ring_wire_bytes
from ftkit.memory import QWEN3_4B

BF16 = 2
LINKS = {"PCIe 4.0 x16 (25 GB/s)": 25e9, "NVLink 4 (450 GB/s)": 450e9}


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
    compute = 4 * s.n_params() * args.tokens / (0.4 * 989e12)
    per_token_tp = s.layers * 4 * ring_wire_bytes("all_reduce", s.hidden * BF16, n)
    print(f"Qwen3-4B, {n} GPUs, {args.tokens} tokens per micro-batch, bf16; bytes sent per GPU per micro-batch")
    print(f"  TP (all-reduce)         {tp / 1e9:8.3f} GB")
    print(f"  TP+SP (AG + RS)         {sp / 1e9:8.3f} GB")
    print(f"  FSDP (weights, fwd+bwd) {fsdp / 1e9:8.3f} GB")
    print(f"  break-even: TP sends less than FSDP below {fsdp / per_token_tp:,.0f} tokens per micro-batch")
    print(f"  compute at 40% MFU on an H100: {compute * 1e3:.0f} ms")
    for link, bw in LINKS.items():
        print(f"  {link:<24} TP/TP+SP {tp / bw * 1e3:7.1f} ms (on the critical path)   FSDP {fsdp / bw * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
