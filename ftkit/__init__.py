"""Shared plumbing for the finetuning experiments."""

import logging
import warnings

# Two warnings of the libraries, about their own code, that a reader of a run's output cannot act on: filtered here,
# once, by their exact text, since every script imports ftkit.
# - peft (0.21) reads transformers' `is_gradient_checkpointing` when it wraps a model, which transformers 5.2x
#   deprecates with a FutureWarning (ftkit calls the new names: `models.checkpoint_activations`).
# - bitsandbytes (0.50), imported on a CPU with AVX512-BF16, tries to load an optional CPU 4-bit kernel from the
#   hub's kernels-community (through the `kernels` package, which is not installed) and logs that it fell back to
#   its own kernel. The record is dropped only if ftkit is imported before bitsandbytes is (peft imports it).
warnings.filterwarnings(
    "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning, module="transformers"
)


class _DropKernelsCommunityFallback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropKernelsCommunityFallback())
