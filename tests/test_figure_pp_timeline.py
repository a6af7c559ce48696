"""assets/pp_timeline.png shows what the committed runs recorded: each row's boxes are its run's last step as the
script timed it (the stages the rank holds, every action once, none overlapping, their total the step's busy time),
its title's bubble is the summary's median over steps 2..N and its theory the closed formula, and the devlog's
bubble table is the one the script writes from the runs. Reads the run files only: nothing is drawn or run."""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
from collections import Counter

import pytest
from conftest import ROOT

from ftkit import cli

spec = importlib.util.spec_from_file_location("pp_timeline", ROOT / "assets" / "pp_timeline.py")
pp_timeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pp_timeline)
pp_ft = cli.load_experiment("pp-ft")  # rank_stages: which stages each rank holds
RUNS_SH = (ROOT / "assets" / "pp_runs.sh").read_text()


def metrics(run: str) -> list[dict]:
    text = (pp_timeline.RUNS / run / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line]


def test_the_figure_draws_the_runs_pp_runs_sh_draws():
    drawn = re.search(r"assets/pp_timeline\.py (.*?) --out assets/pp_timeline\.png", RUNS_SH, re.S).group(1)
    assert tuple(re.findall(r'"\$R/([\w-]+)"', drawn)) == pp_timeline.FIGURE_RUNS


@pytest.mark.parametrize("run", pp_timeline.FIGURE_RUNS)
def test_each_row_is_the_last_step_of_its_run(run):
    row = pp_timeline.panel(pp_timeline.RUNS / run)
    last = metrics(run)[-1]
    p, m, schedule = row["ranks"], row["microbatches"], row["schedule"]
    split = schedule in ("interleaved-zb", "zbv", "dualpipev")  # backward as I + W
    n_stages = p * row["stages_per_rank"]
    for rank in range(p):
        boxes = sorted((b for b in row["boxes"] if b["rank"] == rank), key=lambda b: b["start_ms"])
        held = pp_ft.rank_stages(rank, p, schedule)
        assert sorted({b["stage"] for b in boxes}) == sorted(held)
        for stage in held:
            kinds = Counter(b["kind"] for b in boxes if b["stage"] == stage)
            expected = {"F": m, **({"I": m, "W": m} if split else {"B": m})}
            if stage == n_stages - 1:
                expected["L"] = m  # the loss, on the last stage
            assert kinds == expected, (run, rank, stage)
            for kind in expected:
                assert sorted(b["microbatch"] for b in boxes if b["stage"] == stage and b["kind"] == kind) == list(
                    range(m)
                )
        # A rank runs one action at a time, and the boxes' total is the step's busy time in metrics.jsonl.
        for a, b in zip(boxes, boxes[1:]):
            assert a["start_ms"] + a["width_ms"] <= b["start_ms"] + 1e-9
        assert sum(b["width_ms"] for b in boxes) == pytest.approx(last["busy_s"][rank] * 1e3, rel=1e-9)
        assert boxes[-1]["start_ms"] + boxes[-1]["width_ms"] <= last["pipeline_time_s"][rank] * 1e3
    assert min(b["start_ms"] for b in row["boxes"]) == 0.0


@pytest.mark.parametrize("run", pp_timeline.FIGURE_RUNS)
def test_each_title_is_the_runs_bubble_and_the_formula(run):
    row = pp_timeline.panel(pp_timeline.RUNS / run)
    rows = metrics(run)
    # measured: the median over steps 2..N of the mean over ranks of idle / step
    assert row["bubble"] == pytest.approx(statistics.median(r["bubble"] for r in rows[1:]), abs=1e-12)
    for r in rows:
        per_rank = [idle / t for idle, t in zip(r["idle_s"], r["pipeline_time_s"])]
        assert r["bubble"] == pytest.approx(statistics.mean(per_rank), rel=1e-9)
    # theory: equal-cost actions, free transfers (Huang et al. 2019; Narayanan et al. 2021; Qi et al. 2023)
    p, m, v = row["ranks"], row["microbatches"], row["stages_per_rank"]
    formula = {
        "gpipe": (p - 1) / (m + p - 1),
        "1f1b": (p - 1) / (m + p - 1),
        "interleaved-1f1b": (p - 1) / (v * m + p - 1),
        "zbv": (p - 1) / (3 * v * m + p - 1),
    }[row["schedule"]]
    assert row["bubble_theory"] == pytest.approx(formula, abs=1e-9)
    config = json.loads((pp_timeline.RUNS / run / "summary.json").read_text())["config"]
    assert row["checkpointing"] == config["grad_checkpointing"] == (not run.endswith("-no-ckpt"))


# What blogs/pp.md compares, as it quotes it, and the run each figure is from: every compared run is a row of the
# figure, so the reader sees the panels the text compares (ZBV against interleaved 1F1B, both without checkpointing).
COMPARED = {
    "GPipe 0.198": "cpu-gpipe-m8",
    "1F1B 0.166": "cpu-1f1b-m8",
    "Without checkpointing, ZBV idles 0.167": "cpu-zbv-m8-no-ckpt",
    "interleaved 1F1B idles 0.207": "cpu-interleaved-m8-no-ckpt",
}


@pytest.mark.parametrize("quoted, run", COMPARED.items())
def test_the_figure_draws_the_runs_the_post_compares(quoted, run):
    post = " ".join((ROOT / "blogs" / "pp.md").read_text().split())
    assert quoted in post, quoted
    summary = json.loads((pp_timeline.RUNS / run / "summary.json").read_text())
    assert f"{summary['bubble']:.3f}" == quoted.rsplit(" ", 1)[1], (run, summary["bubble"])
    assert run in pp_timeline.FIGURE_RUNS, f"blogs/pp.md compares {run}, which the figure does not draw"


def test_the_compared_zero_bubble_pair_shares_its_checkpointing():
    config = {
        run: json.loads((pp_timeline.RUNS / run / "summary.json").read_text())["config"] for run in COMPARED.values()
    }
    assert (
        config["cpu-zbv-m8-no-ckpt"]["grad_checkpointing"] is config["cpu-interleaved-m8-no-ckpt"]["grad_checkpointing"]
    )


def test_the_devlogs_bubble_table_is_the_runs():
    table_runs = re.search(r"--table (.*?)$", RUNS_SH, re.S).group(1)
    runs = [pp_timeline.RUNS / name for name in re.findall(r'"\$R"/([\w-]+)', table_runs)]
    assert len(runs) == 11
    devlog = (ROOT / "devlogs" / "pp-ft.md").read_text()
    committed = devlog.split("<!-- bubble:begin -->\n")[1].split("\n<!-- bubble:end -->")[0]
    assert committed == pp_timeline.bubble_table(runs)


def test_devlog_without_table_runs_is_refused_before_the_devlog_is_touched(tmp_path, monkeypatch, capsys):
    devlog = tmp_path / "pp-ft.md"
    devlog.write_text("<!-- bubble:begin -->\n| a row |\n<!-- bubble:end -->\n")
    monkeypatch.setattr("sys.argv", ["pp_timeline.py", "--devlog", str(devlog), "--out", str(tmp_path / "f.png")])
    with pytest.raises(SystemExit):
        pp_timeline.main()
    assert "--table RUN_DIR" in capsys.readouterr().err
    assert "| a row |" in devlog.read_text()


def test_the_post_and_the_devlog_show_the_figure():
    for doc in ("blogs/pp.md", "devlogs/pp-ft.md"):
        assert "](../assets/pp_timeline.png)" in (ROOT / doc).read_text(), doc
