"""Summaries from a model for held-out meeting spans, and their ROUGE against the references."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from ftkit import cli, data, errors, models, ranks, rundir


def infer_parser(description: str, experiment: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.set_defaults(experiment=experiment)
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny model of a --smoke training run")
    p.add_argument(
        "--run",
        type=Path,
        default=None,
        help="training run directory (its config.json says model, data and seed; its adapter/ is "
        "loaded) [default: runs/<experiment>[-smoke]/latest]",
    )
    p.add_argument("--adapter", type=Path, default=None, help="PEFT adapter folder [default: <run>/adapter]")
    p.add_argument("--split", choices=["val", "test"], default="test")
    p.add_argument("--num-examples", type=int, default=None, help="held-out spans to summarize [20; smoke: 4]")
    p.add_argument("--max-new-tokens", type=int, default=None, help="summary length bound [160; smoke: 32]")
    return p


def run_config(args: argparse.Namespace) -> dict:
    run_dir = args.run or rundir.experiment_root(args) / "latest"
    cfg_path = run_dir / "config.json"
    if not cfg_path.exists():
        train = f"experiments/{args.experiment}/train.py" + (" --smoke" if args.smoke else "")
        raise errors.RunError(f"no training run at {run_dir} (no config.json): train one first ({train}) or pass --run")
    adapter = args.adapter or run_dir / "adapter"
    if not (adapter / "adapter_config.json").exists():
        raise errors.RunError(f"no PEFT adapter at {adapter}: the run did not finish (resume it) or pass --adapter")
    check_adapter(adapter)
    cfg = json.loads(cfg_path.read_text())["args"]
    cfg.update(run_dir=str(run_dir), adapter=str(adapter))
    return cfg


def check_adapter(adapter: Path) -> None:
    """Read the adapter's two files before the base model loads: a truncated or damaged one is a clear error here,
    not a library traceback after minutes of loading."""
    import safetensors.torch

    try:
        json.loads((adapter / "adapter_config.json").read_text())
        safetensors.torch.load_file(adapter / "adapter_model.safetensors")
    except Exception as e:
        raise errors.CheckpointError(
            f"{adapter}: corrupt or unreadable adapter ({type(e).__name__}: {e}); train again, or pass --adapter "
            "with another run's adapter/"
        ) from e


def held_out(examples: Sequence[data.Example], n: int, task: str = "all", fits=None) -> list[data.Example]:
    """The first n examples of the run's --task in the dataset's order (deterministic): span-level ones first
    for `all`, whole meetings where there are no spans; with `fits`, only those it accepts (a whole meeting is
    never trimmed, so one longer than the run's --max-length cannot be summarized)."""
    examples = [ex for ex in examples if ex.kind in data.TASKS[task]]
    spans = [ex for ex in examples if ex.kind == "span"]
    chosen = (ex for ex in spans or examples if fits is None or fits(ex))
    return [ex for _, ex in zip(range(n), chosen)]


@torch.no_grad()
def summarize(model, tokenizer, formatter: data.ChatFormatter, examples, max_new_tokens: int, device) -> list[str]:
    """Greedy, deterministic, at most max_new_tokens; one example at a time, so no padding enters a prompt."""
    outputs = []
    for ex in examples:
        prompt = formatter.prompt_ids(ex, reserve=max_new_tokens)
        if prompt is None:
            outputs.append("")
            continue
        ids = torch.tensor([prompt], device=device)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=formatter.eos_id,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else formatter.eos_id,
        )
        outputs.append(tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True).strip())
    return outputs


def rouge(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean ROUGE-1/2/L F1 (rouge-score, Porter stemming), in percent."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    scores = [scorer.score(ref, pred) for pred, ref in zip(predictions, references)]
    return {k: 100 * sum(s[k].fmeasure for s in scores) / max(1, len(scores)) for k in ("rouge1", "rouge2", "rougeL")}


def load_for_inference(cfg: dict, device: torch.device):
    """(tokenizer, formatter, examples, base model) exactly as the training run built them."""
    models.fetch(cfg["model"])  # the run's base model: on this machine too, or a ModelError that says what to do
    splits = data.load_splits(cfg["data"], cfg.get("data_revision"))
    tokenizer = models.load_tokenizer(cfg["model"], data.corpus(splits["train"]), models.recorded_tokenizer(cfg))
    formatter = data.ChatFormatter(tokenizer, cfg["max_length"])
    dtype = cli.torch_dtype(cfg["dtype"])
    base = models.load_model(
        cfg["model"],
        quant=cfg.get("quant", "none"),
        dtype=dtype,
        device=device,
        seed=cfg["seed"],
        vocab_size=len(tokenizer),
    )
    base.config.use_cache = True
    base.eval()
    return tokenizer, formatter, splits, base


def report(examples, references, base_out, tuned_out, run_dir: Path, split: str) -> dict:
    for i, (ex, ref, b, t) in enumerate(zip(examples, references, base_out, tuned_out)):
        print(f"\n=== {i + 1}. [{ex.meeting_id}] {ex.query}")
        print(f"--- reference:\n{ref}\n--- base model:\n{b}\n--- finetuned:\n{t}")
    scores = {"base": rouge(base_out, references), "finetuned": rouge(tuned_out, references)}
    print(f"\nROUGE F1 (%) on {len(references)} {split} examples")
    print(f"{'model':<10} {'ROUGE-1':>8} {'ROUGE-2':>8} {'ROUGE-L':>8}")
    for name, s in scores.items():
        print(f"{name:<10} {s['rouge1']:8.2f} {s['rouge2']:8.2f} {s['rougeL']:8.2f}")
    result = {
        "split": split,
        "examples": [
            {"meeting_id": ex.meeting_id, "query": ex.query, "reference": r, "base": b, "finetuned": t}
            for ex, r, b, t in zip(examples, references, base_out, tuned_out)
        ],
        "rouge": scores,
    }
    out = run_dir / f"infer-{split}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"written: {out}")
    return result


def infer_main(description: str, experiment: str, finetuned, add_flags=None, check=None) -> None:
    """Every experiment's infer.py: the base model rebuilt exactly as the training run built it (its config.json),
    held-out spans summarized greedily by the base, then by `finetuned(base, cfg, args, device)` (the script's own
    step: how its run's result is loaded), ROUGE for both, written to <run>/infer-<split>.json. `add_flags(parser)`
    adds the script's flags; `check(args, cfg)` refuses bad input before the model loads. Bad input ends with one
    line (exit 2), not a traceback."""
    torch.manual_seed(0)
    try:
        p = infer_parser(description.splitlines()[0], experiment=experiment)
        if add_flags:
            add_flags(p)
        args = p.parse_args()
        args.num_examples = args.num_examples or (4 if args.smoke else 20)
        args.max_new_tokens = args.max_new_tokens or (32 if args.smoke else 160)
        device = ranks.device_for(args)
        cfg = run_config(args)
        if check:
            check(args, cfg)
        tokenizer, formatter, splits, base = load_for_inference(cfg, device)

        def fits(ex) -> bool:
            return formatter.prompt_ids(ex, reserve=args.max_new_tokens) is not None

        examples = held_out(splits[args.split], args.num_examples, cfg.get("task", "all"), fits)
        base_out = summarize(base, tokenizer, formatter, examples, args.max_new_tokens, device)
        model = finetuned(base, cfg, args, device)
        tuned_out = summarize(model, tokenizer, formatter, examples, args.max_new_tokens, device)
        report(examples, [ex.answer for ex in examples], base_out, tuned_out, Path(cfg["run_dir"]), args.split)
    except (errors.RunError, errors.CheckpointError, errors.DataError, errors.ModelError) as e:
        ranks.fail(str(e))
