"""--model that cannot be had (a missing folder, a malformed hub id, a hub model that is unknown, gated or out of
reach) ends with one line that says what to do (errors.ModelError: `error:` and exit code 2), before any process
group, never in the hub client's chained tracebacks. There is no network here: the hub's calls are faked to raise
its real exception types, built as the installed huggingface_hub builds them, or run for real in offline mode."""

from __future__ import annotations

import json
import runpy
import sys

import parity
import pytest
import torch
from conftest import ROOT, run_script

from ftkit import errors, models

TRAIN = "experiments/single-gpu-ft/train.py"
# Every way a run can be told what to use instead of the model it named.
HELP = ("--model qwen3-4b-shape", "--model tiny with --smoke")


def no_hub(monkeypatch) -> None:
    """The hub client fails the test if asked anything."""
    import huggingface_hub

    def asked(*args, **kwargs):
        raise AssertionError(f"the hub was asked for {args}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", asked)


def refused(model: str) -> str:
    with pytest.raises(errors.ModelError) as error:
        models.fetch(model)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"--model {model}: "), message
    return message


@pytest.mark.parametrize(
    "model, missing",
    [
        ("/no/such/dir", "/no does not exist"),
        ("./typo-model", "typo-model does not exist"),
        ("~/no-such-model/x", "no-such-model does not exist"),
        ("a/b/c", "a does not exist"),  # more than one slash: not a hub id
        ("models/qwen3-4b", "models/qwen3-4b does not exist"),  # models/ exists here: a path, partly there
    ],
)
def test_a_missing_model_folder_is_refused_as_a_path(model, missing, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    no_hub(monkeypatch)
    message = refused(model)
    assert "no such model folder" in message and missing in message, message
    assert all(h in message for h in HELP), message


def test_a_folder_that_is_not_a_model_is_refused(tmp_path, monkeypatch):
    no_hub(monkeypatch)
    assert "no config.json" in refused(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    assert "a file, not a model folder" in refused(str(tmp_path / "weights.bin"))


@pytest.mark.parametrize("model", ["bad..id", "owner/-name", "name.git"])
def test_a_malformed_hub_id_is_refused_without_asking_the_hub(model, monkeypatch):
    no_hub(monkeypatch)
    message = refused(model)
    assert "neither a local folder nor a hub id" in message and "owner/name" in message, message
    assert all(h in message for h in HELP), message


def test_models_that_can_be_had_pass_the_check_without_the_network(tmp_path, monkeypatch):
    no_hub(monkeypatch)
    (tmp_path / "config.json").write_text("{}")
    for model in (models.TINY, models.QWEN3_4B_SHAPE, str(tmp_path)):
        models.fetch(model)
    for model in (models.QWEN3_4B, "gpt2"):
        models.check_model(model)


def hub_response(status: int, model: str):
    """The HTTP response huggingface_hub builds its HTTP errors from (httpx2's, in huggingface_hub 2.x)."""
    import httpx2

    return httpx2.Response(status, request=httpx2.Request("GET", f"https://huggingface.co/api/models/{model}"))


def hub_error(kind: str, model: str) -> Exception:
    """The exception the hub client raises for `kind`, built as its constructor requires."""
    from huggingface_hub import errors

    if kind == "unknown":
        return errors.RepositoryNotFoundError(
            "404 Client Error. Repository Not Found", response=hub_response(404, model)
        )
    if kind == "gated":
        return errors.GatedRepoError(
            f"403 Client Error. Cannot access gated repo {model}", response=hub_response(403, model)
        )
    if kind == "offline":
        return errors.LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder")
    if kind == "invalid":
        return errors.HFValidationError(f"Repo id must use alphanumeric chars: '{model}'.")
    return OSError("[Errno 104] Connection reset by peer")


# What the message must say for each of the hub's errors.
SAYS = {
    "unknown": ("no such model on the hub", "check the spelling", "hf auth login", *HELP),
    "gated": ("gated", "https://huggingface.co/owner/name", "hf auth login"),
    "offline": ("not in the hub cache", "HF_HOME", "HF_HUB_OFFLINE=1", "hf download owner/name", *HELP),
    "invalid": ("cannot be had from the hub (HFValidationError", "HF_HOME", *HELP),
    "oserror": ("cannot be had from the hub (OSError: [Errno 104]", "HF_HOME", "HF_HUB_OFFLINE=1", *HELP),
}


@pytest.mark.parametrize("kind", sorted(SAYS))
def test_the_hubs_errors_say_what_to_do(kind, monkeypatch):
    import huggingface_hub

    raised = hub_error(kind, "owner/name")

    def snapshot_download(repo_id, **kwargs):
        raise raised

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    message = refused("owner/name")
    assert all(s in message for s in SAYS[kind]), message


@pytest.mark.parametrize("kind", ["gated", "offline", "unknown"])
def test_the_hubs_errors_inside_transformers_oserror_say_what_to_do(kind, monkeypatch):
    """transformers' from_pretrained raises an OSError of its own from the hub's error: the message still says what
    the hub's error means (model_config is what pp-ft and the tensor-parallel checks call before fetch)."""
    import transformers

    def from_pretrained(model, *args, **kwargs):
        try:
            raise hub_error(kind, model)
        except Exception as e:
            raise OSError(f"We couldn't connect to 'https://huggingface.co' to load the files of {model}.") from e

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    for load in (models.model_config, models.load_tokenizer):
        with pytest.raises(errors.ModelError) as error:
            load("owner/name")
        assert all(s in str(error.value) for s in SAYS[kind]), str(error.value)


def test_an_uncached_hub_model_offline_is_refused_by_the_real_hub_client(tmp_path, monkeypatch):
    """No fake: huggingface_hub's own snapshot_download, in offline mode with an empty cache."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    message = refused(models.QWEN3_4B)
    assert f"not in the hub cache ({tmp_path / 'hub'}" in message and "HF_HUB_OFFLINE is set" in message, message


@pytest.mark.parametrize(
    "script",
    [
        "experiments/ddp-ft/train.py",
        "experiments/fsdp-ft/train.py",
        "experiments/tp-ft/train.py",  # prepare.start_ranks
        "experiments/pp-ft/train.py",  # reads the model's config first, for its stage layout
        "experiments/fsdp-tp-ft/train.py",
    ],
)
def test_torchrun_scripts_refuse_the_model_before_the_process_group(script, tmp_path, monkeypatch):
    message = parity.refused(
        monkeypatch, script, "--smoke", "--model", "/no/such/dir", "--output-dir", str(tmp_path / "o"), world=2
    )
    assert "no such model folder" in message and not (tmp_path / "o").exists()


def test_an_unknown_hub_model_is_refused_before_the_process_group(tmp_path, monkeypatch):
    import huggingface_hub

    def snapshot_download(repo_id, **kwargs):
        raise hub_error("unknown", repo_id)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    argv = ("--smoke", "--model", "owner/name", "--output-dir", str(tmp_path / "o"))
    assert "no such model on the hub" in parity.refused(monkeypatch, "experiments/ddp-ft/train.py", *argv, world=2)


def test_infer_refuses_a_base_model_it_cannot_have(tmp_path, monkeypatch, capsys):
    """infer.py rebuilds the base model a training run named: gone from this machine, it is one line too."""
    from safetensors.torch import save_file

    run_dir = tmp_path / "run"
    (run_dir / "adapter").mkdir(parents=True)
    args = {"model": "/no/such/dir", "data": "qmsum-ami", "seed": 0, "max_length": 256, "dtype": "fp32"}
    (run_dir / "config.json").write_text(json.dumps({"args": args}))
    (run_dir / "adapter" / "adapter_config.json").write_text("{}")
    save_file({"w": torch.zeros(1)}, run_dir / "adapter" / "adapter_model.safetensors")
    script = "experiments/single-gpu-ft/infer.py"
    monkeypatch.setattr(sys, "argv", [script, "--smoke", "--run", str(run_dir)])
    with pytest.raises(SystemExit) as ended:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    stderr = capsys.readouterr().err
    assert ended.value.code == 2 and stderr.startswith("error: --model /no/such/dir: no such model folder"), stderr


def test_a_missing_model_folder_ends_with_one_line_not_a_traceback(tmp_path):
    """The whole script, as a reader runs it: exit code 2, one `error:` line, no traceback, no run directory."""
    proc = run_script(TRAIN, "--smoke", "--model", "/no/such/dir", "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --model /no/such/dir: no such model folder"), lines
    assert not (tmp_path / "o").exists()


def test_bitsandbytes_kernels_community_fallback_is_not_shown(caplog):
    """bitsandbytes logs it when imported on an AVX512-BF16 CPU (not this one, maybe): ftkit drops that record
    alone."""
    import logging

    import ftkit  # noqa: F401  (installs the filter)

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip "
            "install kernels` and the kernels >= 0.11.1",
            ModuleNotFoundError("No module named 'kernels'"),
        )
        logger.warning("another bitsandbytes warning")
    assert "gemm_4bit_forward" not in caplog.text and "another bitsandbytes warning" in caplog.text


def test_the_planner_refuses_a_model_that_cannot_be_had_in_one_line(capsys):
    from ftkit.plan.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["--model", "/no/such/dir", "--gpus", "2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "error: --model /no/such/dir: no such model folder" in err
    assert "Traceback" not in err
