"""A GPU figure in a post or a devlog says where it was measured, and points at the run it came from.

The convention (issue 44): a paragraph that states a GPU measurement says "measured on <GPU>" (or "measured on a
GPU", then names the GPU), names the torch version and the configuration, and points at its run in
`devlogs/runs/` (a path or a markdown link; `runs/...` from a devlog). Here every such paragraph's run must exist
and hold a run (summary.json, metrics.jsonl, a .jsonl, report.md, a run's .json), and where the run records its device
(summary.json's `hardware.gpu`, env.txt's nvidia-smi line, a .jsonl's `device`), that is the GPU the paragraph
names; and a paragraph that gives figures and cites a run that recorded a GPU says "measured on". Predictions are
labelled as such ("predicted", "the planner's model") and cite no run; a "measured on" that points at no run
fails here. Reads files only."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
from conftest import ROOT

DOCS = sorted((ROOT / "blogs").glob("*.md")) + sorted((ROOT / "devlogs").glob("*.md"))
RUNS = ROOT / "devlogs" / "runs"
GPU = r"(?:NVIDIA\s+)?(H100|H200|A100|L40S|L4|RTX\s?\d{4}|V100|T4|MI\d{3}X?)\b"
CLAIM = re.compile(
    r"(?<!not )(?<!never )measured on (?:(?:an?|one|the|that|this|two|\d+ x)\s+)?(?:(GPU)\b|" + GPU + ")", re.I
)
NAMED = re.compile(GPU)
RUN_PATH = re.compile(r"(?<![\w/])(?:\.\./)?(?:devlogs/)?runs/[\w.*/-]+")
TORCH = re.compile(r"torch \d+\.\d+")
CONFIG = re.compile(r"LoRA|finetune|reference configuration|qwen3-4b-shape", re.I)
BREAK = re.compile(r"\n\s*\n|\n(?=\s*(?:[-*] |\d+\. |#|\|))")


def paragraphs(doc: Path) -> list[tuple[int, str]]:
    """(line, text) for each paragraph: split at blank lines, list items, headings and table rows."""
    text, found, pos = doc.read_text(), [], 0
    for m in [*BREAK.finditer(text), None]:
        end = m.start() if m else len(text)
        found.append((text[:pos].count("\n") + 1, text[pos:end]))
        pos = m.end() if m else end
    return [(line, " ".join(p.split())) for line, p in found if p.strip()]


def claims() -> list[tuple[str, int, str, str]]:
    """(doc, line, GPU named, paragraph) for every "measured on <GPU>" in the posts and devlogs."""
    found = []
    for doc in DOCS:
        for line, para in paragraphs(doc):
            for m in CLAIM.finditer(para):
                named = m.group(2) or next((g.group(1) for g in NAMED.finditer(para, m.end())), "")
                found.append((f"{doc.parent.name}/{doc.name}", line, named, para))
    return found


def run_paths(para: str) -> list[str]:
    return sorted({m.group(0).rstrip(".,;:") for m in RUN_PATH.finditer(para)})


def resolve(path: str) -> list[Path]:
    """The files or folders a cited path names (from devlogs/runs/ on; `*` globs), README.md as its folder."""
    rel = path[path.index("runs/") + len("runs/") :].split("#")[0].rstrip("/")
    hits = sorted(RUNS.glob(rel)) if "*" in rel else [RUNS / rel] if rel else []
    return [p.parent if p.name == "README.md" else p for p in hits if p.exists()]


@functools.cache
def holds_a_run(p: Path) -> bool:
    if p.is_file():
        return p.suffix in {".json", ".jsonl", ".md", ".txt", ".tsv"}
    return any(
        next(p.rglob(name), None) for name in ("summary.json", "metrics.jsonl", "*.jsonl", "report.md", "*.json")
    )


@functools.cache
def recorded_gpus(p: Path) -> set[str]:
    """Every GPU name the run records about itself."""
    gpus = set()
    files = [p] if p.is_file() else [*p.rglob("summary.json"), *p.rglob("env.txt"), *p.rglob("*.jsonl")]
    for f in files:
        if f.name == "summary.json":
            gpu = (json.loads(f.read_text()).get("hardware") or {}).get("gpu")
            gpus |= {gpu} if gpu else set()
        elif f.name == "env.txt":
            gpus |= set(re.findall(r"^(NVIDIA [^,\n]+),", f.read_text(), re.M))
        elif f.suffix == ".jsonl":
            with f.open() as lines:
                first = lines.readline()
            device = json.loads(first).get("device") if first.startswith("{") else None
            gpus |= {device} if isinstance(device, str) and device.startswith("NVIDIA") else set()
    return gpus


def same_gpu(named: str, recorded: str) -> bool:
    return named.replace(" ", "").lower() in recorded.replace(" ", "").lower()


FIGURE = re.compile(r"\d[\d,.]*\s?(?:tokens/s|GiB|MiB|ms\b|s per step|s a step|% MFU)")


def test_a_paragraph_citing_a_gpu_run_with_figures_says_measured_on():
    """The other way round: a paragraph that gives figures (tokens/s, GiB, ms, ...) and cites a run that recorded
    a GPU follows the convention, so its GPU figures are checked above."""
    loose = []
    for doc in DOCS:
        for line, para in paragraphs(doc):
            if CLAIM.search(para) or not FIGURE.search(para):
                continue
            gpus = {gpu for path in run_paths(para) for p in resolve(path) for gpu in recorded_gpus(p)}
            if gpus:
                loose.append(f"{doc.parent.name}/{doc.name}:{line} ({', '.join(sorted(gpus))}): {para[:120]}")
    assert not loose, "GPU figures without 'measured on <GPU>':\n" + "\n".join(loose)


def test_the_convention_is_used():
    docs = {doc for doc, _, _, _ in claims()}
    assert any(d.startswith("blogs/") for d in docs) and any(d.startswith("devlogs/") for d in docs), docs


@pytest.mark.parametrize("doc, line, named, para", claims(), ids=lambda x: str(x)[:30])
def test_a_gpu_measurement_names_its_gpu_torch_configuration_and_run(doc, line, named, para):
    where = f"{doc}:{line}"
    assert named, f"{where}: 'measured on' names no GPU model (H100, H200, ...): {para[:200]}"
    assert TORCH.search(para), f"{where}: a GPU measurement names its torch version ('torch 2.11'): {para[:200]}"
    assert CONFIG.search(para), f"{where}: a GPU measurement names its configuration (LoRA, QLoRA, ...)"
    paths = run_paths(para)
    assert paths, f"{where}: 'measured on {named}' points at no run in devlogs/runs/: {para[:200]}"
    runs = {path: [p for p in resolve(path) if holds_a_run(p)] for path in paths}
    missing = [path for path, found in runs.items() if not found]
    assert not missing, f"{where}: {missing} name no run (summary.json, metrics.jsonl, .jsonl, report.md)"
    recorded = {gpu for found in runs.values() for p in found for gpu in recorded_gpus(p)}
    assert not recorded or any(same_gpu(named, gpu) for gpu in recorded), (
        f"{where}: the paragraph says {named}, its runs record {sorted(recorded)}"
    )
