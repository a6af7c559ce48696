"""The repository stands on its own: nothing in it points at the development folder that sat beside the
checkout on the project's machines, which a fresh clone does not have; the README's commands are ones the
scripts accept; its CPU walkthrough commands run as written; the README stays a front page; and the links of the
README and the reference pages (ftkit/README.md, assets/README.md) lead to files and headings that exist."""

from __future__ import annotations

import json
import re
import runpy
import shutil
import subprocess
import sys
from dataclasses import dataclass

import parity
import pytest
from conftest import ROOT

# Spelled in two parts so that this file does not match itself.
OUTSIDE = "../" + "shared"
EXPERIMENTS = ("single-gpu-ft", "ddp-ft", "fsdp-ft", "tp-ft", "tp-sp-ft", "pp-ft", "fsdp-tp-ft", "cp-ft")


def repository_text_files() -> list[str]:
    """Tracked files, and new ones git would track (not ignored), that exist in the working tree and are text."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    files = []
    for name in filter(None, listed.split("\0")):
        path = ROOT / name
        if path.is_file() and b"\0" not in path.read_bytes():  # deleted ones and binaries (.gz, .png) left out
            files.append(name)
    return files


def test_nothing_refers_to_the_shared_folder():
    # Run records (devlogs/runs/) keep the --data path they were measured with: a record, not an instruction.
    # That folder held the same 137 QMSum meetings, byte for byte, that the package ships.
    files = [f for f in repository_text_files() if not f.startswith("devlogs/runs/")]
    assert "README.md" in files and "ftkit/data.py" in files
    hits = [
        f"{name}:{n}: {line.strip()}"
        for name in files
        for n, line in enumerate((ROOT / name).read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if OUTSIDE in line
    ]
    assert not hits, f"{len(hits)} reference(s) to {OUTSIDE}, which a clone does not have:\n" + "\n".join(hits)


def readme_train_commands() -> list[list[str]]:
    """Every `uv run python|torchrun ... experiments/<x>/train.py FLAGS` command the README shows (code blocks and
    the experiment table), as the train.py's argument list."""
    commands = []
    for line in (ROOT / "README.md").read_text().splitlines():
        for text in re.findall(r"`(uv run [^`]+)`", line) or ([line] if line.lstrip().startswith("uv run") else []):
            words = text.split("#")[0].split()
            scripts = [i for i, w in enumerate(words) if re.fullmatch(r"experiments/[\w-]+/train\.py", w)]
            if scripts:
                commands.append(words[scripts[0] :])
    return commands


def test_every_readme_train_command_parses(monkeypatch):
    """The README's train.py commands name scripts that exist and flags their parsers accept, resolved as a run
    would resolve them (scale defaults, range checks). Running them all verbatim costs minutes each; every one is
    run with smaller flags by its technique's tests."""
    commands = readme_train_commands()
    assert {c[0] for c in commands} >= {f"experiments/{e}/train.py" for e in EXPERIMENTS}, commands
    assert sum("--smoke" in c for c in commands) >= len(EXPERIMENTS)  # the CPU walkthrough of each
    modules = {}
    for script, *flags in commands:
        module = modules.setdefault(script, runpy.run_path(str(ROOT / script)))
        monkeypatch.setattr(sys, "argv", [script, *flags])
        try:
            args = module["parse_args"]()
        except SystemExit as e:
            pytest.fail(f"README: `{script} {' '.join(flags)}` is refused by its parser (exit {e.code})")
        assert args.experiment == script.split("/")[1] and args.max_steps > 0


def readme_walkthrough_commands() -> dict[str, list[str]]:
    """The README's CPU walkthrough command of each experiment (`uv run ... experiments/<x>/train.py --smoke`), as
    its words."""
    commands = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        for text in re.findall(r"`(uv run [^`]+)`", line) or ([line] if line.lstrip().startswith("uv run") else []):
            words = text.split("#")[0].split()
            script = next((w for w in words if re.fullmatch(r"experiments/[\w-]+/train\.py", w)), None)
            if script and "--smoke" in words:
                name = script.split("/")[1]
                assert commands.setdefault(name, words) == words, f"two walkthrough commands for {name}"
    return commands


# Steps the walkthrough runs here of its 30. --stop-after and --output-dir change nothing in a run (they are the
# flags --resume lets differ): the steps run are the walkthrough's own, and the run ends as an interrupted one,
# with its checkpoint and the command that continues it. The 30 steps in full cost ~33 s per experiment on 2 cores,
# more than the suite's budget; every script's complete runs, evals and adapters are tested with smaller flags.
WALK_STEPS = 2


@dataclass
class Walked:
    returncode: int
    stdout: str  # the script's (rank 0's, under torchrun)
    stderr: str


def walk(words: list[str], out) -> Walked:
    """Run one walkthrough command with --output-dir and --stop-after added. `uv run python script FLAGS` runs
    verbatim, through uv. `uv run torchrun --nproc_per_node=N script FLAGS` runs the same torchrun
    (torch.distributed.run) on the same script and flags, launched from the suite's fork server: torch is imported
    there once, not in N + 1 new interpreters per command (~10 s each on 2 cores). Any other torchrun option would
    be dropped by that, so the command may have no other."""
    extra = ["--output-dir", str(out), "--stop-after", str(WALK_STEPS)]
    at = next(i for i, w in enumerate(words) if re.fullmatch(r"experiments/[\w-]+/train\.py", w))
    if "torchrun" not in words:
        argv = [shutil.which("uv") if w == "uv" else w for w in words] + extra
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
        print(f"$ {' '.join(argv)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        return Walked(proc.returncode, proc.stdout, proc.stderr)
    launcher = words[:at]
    assert launcher[:3] == ["uv", "run", "torchrun"] and len(launcher) == 4, launcher
    nproc = int(re.fullmatch(r"--nproc_per_node=(\d+)", launcher[3]).group(1))
    launch = parity.torchrun(words[at], *words[at + 1 :], *extra, nproc=nproc)
    print(launch.report()[-5000:])
    return Walked(launch.returncode, launch.ranks.get(0, {}).get("stdout", ""), launch.report())


@pytest.fixture(scope="module")
def walkthroughs(tmp_path_factory) -> dict[str, tuple[Walked, object]]:
    assert shutil.which("uv"), "the README's commands start with `uv run`: install uv (pip install uv) to run them"
    commands = readme_walkthrough_commands()
    assert set(commands) == set(EXPERIMENTS), commands
    base = tmp_path_factory.mktemp("walkthrough")
    return {name: (walk(words, base / name), base / name) for name, words in commands.items()}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_readme_walkthrough_command_runs_as_written(walkthroughs, name):
    proc, out = walkthroughs[name]
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())["args"]
    # The walkthrough's configuration: the --smoke defaults, which the posts' CPU figures use.
    assert config["model"] == "tiny" and config["data"] == "qmsum-ami" and config["max_steps"] == 30
    assert [r["step"] for r in parity.metrics(out)] == list(range(1, WALK_STEPS + 1))
    assert (out / "checkpoints" / f"step-{WALK_STEPS}").is_dir() and not (out / "adapter").exists()
    assert f"experiments/{name}/train.py --resume {out}" in proc.stdout, proc.stdout[-2000:]


def test_readme_walkthroughs_take_the_same_steps(walkthroughs):
    """The walkthroughs' defaults are one configuration (global batch 8, micro-batch 2, fp32, seed 0, dropout 0), so
    their steps are the same steps: DDP's QLoRA equals the single-process QLoRA, and the five bf16-LoRA techniques
    (fp32 in --smoke) equal each other, per step, to the parity bar."""
    runs = {name: out for name, (proc, out) in walkthroughs.items() if proc.returncode == 0}
    assert set(runs) == set(EXPERIMENTS), "a walkthrough failed; see test_readme_walkthrough_command_runs_as_written"
    assert parity.compare_losses(runs["ddp-ft"], runs["single-gpu-ft"]) <= parity.LOSS_TOL
    for name in ("tp-ft", "tp-sp-ft", "pp-ft", "fsdp-tp-ft"):
        assert parity.compare_losses(runs[name], runs["fsdp-ft"]) <= parity.LOSS_TOL, name


def test_fsdp_tp_walkthrough_sends_what_its_summary_says_with_checkpointing(walkthroughs):
    """The walkthrough runs fsdp-tp-ft with activation checkpointing (the --smoke default), which tests/test_fsdp_tp.py
    turns off: the recompute repeats the TP forward all-reduces, and transformers' checkpointing makes the embedding
    output require grad, so layer 0's q/k/v all-reduce their input gradients too. The summary's theory says so."""
    proc, out = walkthroughs["fsdp-tp-ft"]
    assert proc.returncode == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["config"]["grad_checkpointing"] and s["mesh"] == {"dp": 2, "tp": 2}
    assert s["theory_comm_tp_bytes_per_step"] == s["comm_tp_bytes_per_step"] > 0
    for row in parity.metrics(out):
        assert row["comm"]["all_gather"]["bytes"] == s["theory_all_gather_bytes"]


def test_tp_sp_walkthrough_sends_what_its_summary_says_with_checkpointing(walkthroughs):
    """The walkthrough runs tp-sp-ft with checkpointing (tests/test_tp.py turns it off): the recompute repeats each
    block's forward all-gather and the attention's reduce-scatter (it stops before the MLP's exit, whose output
    nothing saves), and the embedding output requires grad, so layer 0's attention reduce-scatters its input
    gradient too. Its summary's theory, kind by kind, is what was recorded."""
    proc, out = walkthroughs["tp-sp-ft"]
    assert proc.returncode == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["config"]["grad_checkpointing"] and s["sequence_parallel"]
    steps = len(parity.metrics(out))
    by_kind = {kind: t["bytes"] / steps for kind, t in s["comm"].items()}
    assert s["theory_comm_by_kind_per_step"] == pytest.approx(by_kind, rel=1e-12)
    assert s["theory_comm_bytes_per_step"] == pytest.approx(s["comm_bytes_per_step"], rel=1e-12) and by_kind


def test_the_reference_configuration_is_the_scripts_defaults():
    """The README's reference configuration table, against the defaults the scripts resolve (cli.REAL and the
    common parser), so the configuration every post refers to cannot drift from the code."""
    from ftkit import cli

    text = (ROOT / "README.md").read_text().split("## The reference configuration", 1)[1].split("\n## ", 1)[0]
    table = dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", text, re.M))
    real, parser = cli.REAL, cli.common_parser("x", experiment="x")
    defaults = {a.dest: a.default for a in parser._actions}
    assert table["model"] == f"`{real['model']}`"
    assert table["sequence length (`--max-length`)"] == f"{real['max_length']} tokens"
    assert table["global batch (`--batch-size`)"].startswith(f"{real['batch_size']} sequences")
    assert table["micro-batch (`--micro-batch-size`)"].startswith(f"{real['micro_batch_size']} packed rows")
    lora = f"rank {defaults['lora_rank']}, alpha {defaults['lora_alpha']:g}, dropout {real['lora_dropout']}"
    assert table["LoRA"].startswith(lora)
    assert table["precision"].startswith(f"{real['dtype']} compute")
    assert table["activation checkpointing"].startswith("on") and defaults["grad_checkpointing"] is True
    lr, warmup = re.fullmatch(r"AdamW, lr ([\d.e-]+), (\d+) warmup steps.*", table["optimizer"]).groups()
    assert (float(lr), int(warmup)) == (real["lr"], real["warmup_steps"])
    assert f"clipped at {defaults['max_grad_norm']}, {real['max_steps']} steps" in table["optimizer"]
    assert table["seed"] == str(defaults["seed"])


# ------------------------------------------------------------------------------------ the front page and its links
# README.md is the front page; the reference material lives on the pages of what it documents.
PAGES = ("README.md", "ftkit/README.md", "assets/README.md")
FRONT_PAGE_WORDS = 2000


def test_the_readme_is_a_front_page():
    """At most 2,000 words, as `wc -w README.md` counts them: the reference material goes to ftkit/README.md and
    assets/README.md."""
    words = len((ROOT / "README.md").read_text().split())
    assert words <= FRONT_PAGE_WORDS, f"README.md has {words} words; move reference material to the pages it documents"


def prose(text: str) -> str:
    """The text outside fenced code blocks, with inline code spans blanked (a link or a heading inside code is
    not one)."""
    return re.sub(r"`[^`\n]*`", "``", re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.M | re.S))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text (code spans' contents kept, links as their text), lower case,
    punctuation but hyphens and underscores dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path) -> set[str]:
    """Every heading anchor of a markdown file, numbered as GitHub numbers repeats (slug, slug-1, ...)."""
    seen: dict[str, int] = {}
    found = set()
    text = re.sub(r"^```.*?^```[^\n]*$", "", path.read_text(), flags=re.M | re.S)
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", text, re.M):
        slug = github_slug(heading)
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(page: str, only_to: tuple[str, ...] | None = None) -> list[str]:
    """The relative links of one markdown file that lead nowhere: a file or folder that does not exist, or a
    #anchor that is no heading of the markdown file it names. `only_to`: check only links into these files."""
    source = ROOT / page
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)(?: \"[^\"]*\")?\)", prose(source.read_text())):
        if re.match(r"[a-z][\w+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve() if path else source
        if only_to is not None and resolved not in {(ROOT / p).resolve() for p in only_to}:
            continue
        if not resolved.exists():
            broken.append(f"{page}: {target}: no such file")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            broken.append(f"{page}: {target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    return broken


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_resolves(page):
    broken = broken_links(page)
    assert not broken, "\n".join(broken)


def test_the_posts_and_devlogs_links_to_the_readmes_resolve():
    """Posts and devlogs link to sections of the README and the reference pages; a section that moves must take
    its links with it."""
    pages = sorted(str(p.relative_to(ROOT)) for d in ("blogs", "devlogs") for p in (ROOT / d).glob("*.md"))
    assert pages
    broken = [b for page in pages for b in broken_links(page, only_to=PAGES)]
    assert not broken, "\n".join(broken)


def test_the_link_check_finds_a_broken_link_and_a_missing_heading(tmp_path, monkeypatch):
    """The check above can fail: a page with a link to a missing file and one to a missing heading."""
    import test_readme

    (tmp_path / "doc").mkdir()
    (tmp_path / "doc" / "other.md").write_text("# Which technique? The planner\n\n## Runs\n\n## Runs\n")
    (tmp_path / "doc" / "page.md").write_text(
        "[ok](other.md#which-technique-the-planner) [ok](other.md#runs-1) [ok](#a-heading)\n"
        "[gone](missing.md) [no heading](other.md#runs-2) [web](https://example.com/x.md)\n"
        "`[in code](missing-too.md)`\n\n```\n[in a block](missing-three.md)\n# not a heading\n```\n\n# A heading\n"
    )
    monkeypatch.setattr(test_readme, "ROOT", tmp_path)
    assert test_readme.broken_links("doc/page.md") == [
        "doc/page.md: missing.md: no such file",
        "doc/page.md: other.md#runs-2: no heading #runs-2 in doc/other.md",
    ]
