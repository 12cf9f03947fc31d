"""benchmark/tiny_report.py on hand-made artifacts: the numbers land in report.md, a stage that did
not run reads "not run", and the figure is written. No model is loaded."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmark"))

import tiny_report  # noqa: E402


def write(path: Path, payload) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload) if not isinstance(payload, str) else payload)


def judge_run(method: str, wins: int, n: int, low: float, high: float, vs: str = "reference") -> dict:
    return {"method": method, "seed": "3", "vs": vs, "n": n, "wins": wins, "win_rate": wins / n, "ci_low": low,
            "ci_high": high, "ties": 0, "mean_words": 15.0, "mean_other_words": 14.0}


def make_run(models: Path, with_dpo: bool) -> None:
    """A tiny run of seed 3: SFT, base, RM, PPO, judge (+ DPO), timings and a world card."""
    write(models / "base_3" / "eval_metrics.json", {"validation": {"loss": 4.6, "rouge1": 0.25, "rouge2": 0.125, "rougeL": 0.2}})
    write(models / "sft_3" / "eval_metrics.json", {"validation": {"loss": 0.7, "rouge1": 0.4125, "rouge2": 0.2, "rougeL": 0.375}})
    write(models / "reward_3" / "eval_metrics.json", {
        "eval/rm/validation/accuracy": 0.6875, "eval/rm/validation/accuracy/split/valid1": 0.1,
        "eval/rm/validation/gold_accuracy": 0.71875, "eval/rm/validation_cnndm/accuracy": 0.640625})
    if with_dpo:
        write(models / "dpo_3" / "eval_metrics.json", {"eval/dpo/validation/accuracy": 0.65625,
                                                       "eval/dpo/validation_cnndm/accuracy": 0.59375})
    write(models / "ppo_3" / "eval_metrics.json", {"validation": {"score": 0.3125, "reference_score": -0.0625,
                                                                  "eos_fraction": 0.96875, "response_length": 19.0}})
    runs = {"base__seed3": judge_run("base", 0, 256, 0.0, 0.0148), "sft__seed3": judge_run("sft", 32, 256, 0.09, 0.17),
            "ppo__seed3": judge_run("ppo", 64, 256, 0.2, 0.31),
            "ppo__seed3_vs_sft__seed3": judge_run("ppo", 200, 256, 0.7, 0.8, vs="sft__seed3")}
    if with_dpo:
        runs["dpo__seed3"] = judge_run("dpo", 48, 256, 0.14, 0.24)
    write(models / "judge_3" / "results.json", {"model": "tiny_world.gold_score", "runs": runs})
    write(models / "timings.tsv", "stage\tseconds\npreprocess\t29\nsft\t97\nreward\t110\nppo\t64\n")


def test_report_has_every_stage_and_the_figure(tmp_path):
    models, world = tmp_path / "models", tmp_path / "world"
    make_run(models, with_dpo=True)
    write(world / "world.json", {"noise_ceiling": {"validation": 0.8355, "validation_cnndm": 0.8427}})
    result = subprocess.run([sys.executable, str(REPO / "benchmark" / "tiny_report.py"), "--models", str(models),
                             "--seed", "3", "--world", str(world)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = (models / "report.md").read_text()
    assert report in result.stdout
    for row in ("| base model (no training) | ROUGE-1 / 2 / L | 0.250 / 0.125 / 0.200 |",
                "| SFT | ROUGE-1 / 2 / L | 0.412 / 0.200 / 0.375 |",
                "| reward model | TL;DR validation accuracy vs the labels (noise ceiling 0.836) | 0.688 |",
                "| PPO | 0.781 | [0.700, 0.800] | 200 / 256 | 0 | 15.0 (14.0) |",
                "| reward model | TL;DR validation accuracy vs the gold judge | 0.719 |",
                "| reward model | CNN/DM accuracy vs the labels (noise ceiling 0.843) | 0.641 |",
                "| DPO (implicit reward) | TL;DR validation accuracy vs the labels (noise ceiling 0.836) | 0.656 |",
                "| DPO (implicit reward) | CNN/DM accuracy vs the labels (noise ceiling 0.843) | 0.594 |",
                "| PPO | RM score: its samples / the references | 0.312 / -0.062 |",
                "| PPO | samples with an EOS | 0.969 |",
                "| SFT | 0.125 | [0.090, 0.170] | 32 / 256 | 0 | 15.0 (14.0) |",
                "| PPO | 0.250 | [0.200, 0.310] | 64 / 256 | 0 | 15.0 (14.0) |",
                "| DPO | 0.188 | [0.140, 0.240] | 48 / 256 | 0 | 15.0 (14.0) |",
                "| reward | 110 s |", "| **total** | **5 min 0 s** |"):
        assert row in report, row
    reference_table = report.split("## Win rate")[1].split("## Head to head")[0]
    assert "not run" not in report and "0.800" not in reference_table  # the head-to-head PPO vs SFT is not a reference win rate
    assert report.index("## Head to head against SFT") < report.index("| PPO | 0.781 |")  # ... it has its own table
    png = (models / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_a_stage_that_did_not_run_reads_not_run(tmp_path):
    models = tmp_path / "models"
    make_run(models, with_dpo=False)
    (models / "ppo_3" / "eval_metrics.json").unlink()
    art = tiny_report.load_artifacts(str(models), 3, world=None)
    assert art["dpo"] is None and art["ppo"] is None and set(art["judge"]) == {"base", "sft", "ppo"}
    report = tiny_report.render_markdown(art)
    assert "| DPO (implicit reward) | accuracy | not run |" in report
    assert "| PPO | RM score of its samples | not run |" in report
    assert "| DPO | not run | | | | |" in report
    assert "noise ceiling" not in report  # no world card: no ceiling
    tiny_report.plot_report(art, str(tmp_path / "report.png"))
    assert (tmp_path / "report.png").stat().st_size > 10_000
    # nothing at all: every stage reads "not run", and the figure is still drawn
    empty = tiny_report.load_artifacts(str(tmp_path / "nothing"), 1, world=None)
    assert tiny_report.render_markdown(empty).count("not run") == 5 + 4  # 5 stage rows, 4 win-rate rows
    tiny_report.plot_report(empty, str(tmp_path / "empty.png"))


def test_timings_reader_skips_the_header_and_keeps_names_with_spaces(tmp_path):
    write(tmp_path / "t.tsv", "stage\tseconds\nsft: base model\t14\njudge (gold)\t3\n")
    assert tiny_report.read_timings(str(tmp_path / "t.tsv")) == [("sft: base model", 14.0), ("judge (gold)", 3.0)]
    assert tiny_report.read_timings(str(tmp_path / "missing.tsv")) == []
