"""The --model names and the hub: which models need no download (the two random-init ones), which --model is a
folder and which a hub id, and the hub client's errors said as what to do. Checked from the command line alone,
before any download or process group (`models.fetch`)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from ftkit.errors import ModelError

TINY = "tiny"


QWEN3_4B_SHAPE = "qwen3-4b-shape"


QWEN3_4B = "Qwen/Qwen3-4B"


# What to do when a model's files cannot be had: ways to the weights, and the two models that need none.
WITHOUT_WEIGHTS = (
    f"--model {QWEN3_4B_SHAPE} (Qwen3-4B's shape, random weights) for speed and memory runs, or --model {TINY} with "
    "--smoke for the CPU walkthrough"
)


def _looks_like_path(model: str) -> bool:
    """A --model that is meant as a folder: written as a path (/, ., ~, more than one slash), or a path whose first
    folder exists here. Anything else is taken for a hub id (owner/name), as transformers takes it."""
    parts = Path(model).parts
    return model.startswith(("/", ".", "~")) or model.count("/") > 1 or (len(parts) > 1 and Path(parts[0]).is_dir())


def check_model(model: str) -> None:
    """Refuse, from the command line alone (no network), a --model that is neither 'tiny', 'qwen3-4b-shape', a model
    folder nor a well-formed hub id: a typo'd path would otherwise be taken for a hub id and fail in the hub client."""
    if model in (TINY, QWEN3_4B_SHAPE):
        return
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(
                f"--model {model}: the folder has no config.json, so it is not a transformers model folder (one that "
                "save_pretrained or a hub download writes: config.json, *.safetensors, the tokenizer's files)"
            )
        return
    if path.exists():
        raise ModelError(f"--model {model}: a file, not a model folder (config.json, *.safetensors, tokenizer files)")
    if _looks_like_path(model):
        missing = next(p for p in reversed([path, *path.parents]) if not p.exists())
        raise ModelError(
            f"--model {model}: no such model folder ({missing} does not exist). Give the folder that holds the "
            f"model's config.json and weights, a hub id such as {QWEN3_4B}, or {WITHOUT_WEIGHTS}"
        )
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError as e:
        raise ModelError(
            f"--model {model}: neither a local folder nor a hub id ({e}). A hub id is owner/name, such as "
            f"{QWEN3_4B}; or give a model folder, or {WITHOUT_WEIGHTS}"
        ) from e


@contextlib.contextmanager
def hub_errors(model: str):
    """The hub client's errors while getting `model`'s files (raised by huggingface_hub, or by transformers around
    them as an OSError), as a ModelError that says what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        yield
    except (HFValidationError, OSError) as e:
        if Path(model).expanduser().exists():  # a local folder's own error (a missing or broken file), not the hub's
            raise
        hub = (GatedRepoError, RepositoryNotFoundError, LocalEntryNotFoundError)
        cause = e  # transformers raises an OSError of its own from the hub's error: find the hub's
        while cause is not None and not isinstance(cause, hub):
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, GatedRepoError):
            say = (
                f"a gated model on the hub, which this login may not use: accept its terms at "
                f"https://huggingface.co/{model}, then log in here with that account (hf auth login, or set HF_TOKEN)"
            )
        elif isinstance(cause, RepositoryNotFoundError):
            say = (
                f"no such model on the hub (or a private one this login cannot see): check the spelling (a hub id is "
                f"owner/name, such as {QWEN3_4B}; a local model is given as its folder's path), or log in with an "
                f"account that can see it (hf auth login, or set HF_TOKEN); or {WITHOUT_WEIGHTS}"
            )
        elif isinstance(cause, LocalEntryNotFoundError):
            why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached from here"
            say = (
                f"not in the hub cache ({constants.HF_HUB_CACHE}, under HF_HOME) and {why}. Download it once where "
                f"the hub can be reached (hf download {model}) into this HF_HOME, or copy such a cache here and point "
                f"HF_HOME at it; HF_HUB_OFFLINE=1 then uses the cached copy. Or {WITHOUT_WEIGHTS}"
            )
        else:
            first_line = (str(e).strip().splitlines() or [""])[0]
            say = (
                f"cannot be had from the hub ({type(e).__name__}: {first_line}). A hub model is downloaded into the "
                f"hub cache ({constants.HF_HUB_CACHE}, under HF_HOME); HF_HUB_OFFLINE=1 uses a cached copy; a gated "
                f"one needs hf auth login. Or {WITHOUT_WEIGHTS}"
            )
        raise ModelError(f"--model {model}: {say}") from e
