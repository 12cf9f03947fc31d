"""benchmark/sweep_report.py: the sweep's Figure 1 from the folders launch.sh fills, on a made-up sweep of two model
sizes x three seeds whose numbers are known: means and sample stds by hand, runs not complete left out and listed,
judge models never mixed, sizes from a saved model's safetensors header."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmark"))

import sweep_report  # noqa: E402

SMALL, LARGE = "EleutherAI/pythia-1b-deduped", "EleutherAI/pythia-2.8b-deduped"
SEEDS = ("44413", "55513", "66613")


def write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def judge_results(seed: str, rates: dict, model: str = "judge-a", **extra) -> dict:
    """results.json as judge.py writes it, for {method: win rate vs the references} and ppo/dpo head to head."""
    runs = {}
    for method, (rate, against_sft) in rates.items():
        runs[f"{method}__seed{seed}"] = {"method": method, "seed": seed, "vs": "reference", "n": 100,
                                         "win_rate": rate}
        if against_sft is not None:
            runs[f"{method}__seed{seed}_vs_sft__seed{seed}"] = {"method": method, "seed": seed,
                                                                "vs": f"sft__seed{seed}", "n": 90,
                                                                "win_rate": against_sft}
    runs["empty__seed1"] = {"method": "empty", "seed": seed, "vs": "reference", "n": 0, "win_rate": None}
    return {"judge": "openai", "model": model, "prompt_version": "v1", "temperature": 1.0, "seed": int(seed),
            "runs": runs, "this_run": {"stopped": None}, "failures": [], **extra}


# win rates vs the references (and head to head vs SFT) of each (model, seed)
RATES = {
    (SMALL, "44413"): {"sft": (0.30, None), "ppo": (0.50, 0.70), "dpo": (0.40, 0.60)},
    (SMALL, "55513"): {"sft": (0.34, None), "ppo": (0.56, 0.74), "dpo": (0.44, 0.62)},
    (SMALL, "66613"): {"sft": (0.32, None), "ppo": (0.53, 0.72), "dpo": (0.48, 0.64)},
    (LARGE, "44413"): {"sft": (0.40, None), "ppo": (0.70, 0.80), "dpo": (0.60, 0.70)},
    (LARGE, "55513"): {"sft": (0.44, None), "ppo": (0.74, 0.84), "dpo": (0.62, 0.72)},
}


@pytest.fixture
def sweep(tmp_path):
    """models/<model>/<stage>_<seed>: every stage complete but LARGE seed 66613 (SFT done, the RM still training,
    no judge) and LARGE seed 55513's PPO (running: no eval_metrics.json, though its judge folder is complete)."""
    root = tmp_path / "models"
    for model in (SMALL, LARGE):
        for i, seed in enumerate(SEEDS):
            run = root / model
            write(run / f"sft_{seed}" / "eval_metrics.json", {"validation": {"rougeL": 0.40 + 0.01 * i}})
            if (model, seed) == (LARGE, "66613"):
                (run / f"reward_{seed}" / "checkpoints" / "update_100").mkdir(parents=True)
                continue
            write(run / f"reward_{seed}" / "eval_metrics.json",
                  {"eval/rm/validation/accuracy": 0.60 + 0.02 * i, "eval/rm/validation_cnndm/accuracy": 0.55})
            write(run / f"dpo_{seed}" / "eval_metrics.json", {"eval/dpo/validation/accuracy": 0.58 + 0.02 * i})
            if (model, seed) != (LARGE, "55513"):
                write(run / f"ppo_{seed}" / "eval_metrics.json",
                      {"validation": {"score": 1.0 + i, "reference_score": 0.5, "eos_fraction": 0.9}})
            else:
                (run / f"ppo_{seed}" / "checkpoints").mkdir(parents=True)
            write(run / f"judge_{seed}" / "results.json", judge_results(seed, RATES[(model, seed)]))
    return root


def run_report(root: Path, out: Path, *flags) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmark" / "sweep_report.py"), "--out_root", str(root),
                           "--out", str(out), *flags], capture_output=True, text=True, timeout=120)


def table_row(text: str, model: str, method: str, section: str) -> list:
    """The cells of `section`'s row for (model, method)."""
    part = text.split(f"## {section}")[1].split("\n## ")[0]
    rows = [line.strip("|").split(" | ") for line in part.splitlines() if line.startswith(f"| {model} | ")]
    matches = [[cell.strip() for cell in row] for row in rows if row[2].strip() == method]
    assert len(matches) == 1, (model, method, part)
    return matches[0]


def test_sweep_report_means_and_stds_by_hand(sweep, tmp_path):
    result = run_report(sweep, tmp_path / "out" / "sweep")
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "out" / "sweep.md").read_text()
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 10_000
    assert not list((tmp_path / "out").glob("*partial*"))
    # SMALL PPO: (0.50 + 0.56 + 0.53) / 3 = 0.53; sample std sqrt((0.03^2 + 0.03^2 + 0) / 2) = 0.03
    assert table_row(text, SMALL, "ppo", "Figure 1") == [
        SMALL, "1.00B", "ppo", "3", "0.530", "0.030", "44413: 0.500, 55513: 0.560, 66613: 0.530"]
    # SMALL DPO: (0.40 + 0.44 + 0.48) / 3 = 0.44, std 0.04; LARGE SFT over its two judged seeds: 0.42, std 0.028
    assert table_row(text, SMALL, "dpo", "Figure 1")[4:6] == ["0.440", "0.040"]
    assert table_row(text, LARGE, "sft", "Figure 1")[2:6] == ["sft", "2", "0.420", "0.028"]
    # head to head against SFT: LARGE PPO seed 44413 alone (0.80): seed 55513's PPO is training again, so its judge's
    # verdicts (0.84, and 0.74 against the references) describe a run that is no longer there
    assert table_row(text, LARGE, "ppo", "Head to head against SFT")[3:5] == ["1", "0.800"]
    assert table_row(text, LARGE, "ppo", "Figure 1")[3:5] == ["1", "0.700"]
    assert table_row(text, LARGE, "dpo", "Figure 1")[3:5] == ["2", "0.610"]  # its DPO is complete: both seeds
    assert "| sft |" not in text.split("## Head to head against SFT")[1].split("\n## ")[0]
    assert "empty" not in text  # a run with no decided pair has no win rate
    # rows by size, methods in the paper's order
    figure = text.split("## Figure 1")[1].split("\n## ")[0]
    order = [(line.split(" | ")[0].strip("| "), line.split(" | ")[2]) for line in figure.splitlines()
             if line.startswith("| EleutherAI")]
    assert order == [(SMALL, "sft"), (SMALL, "ppo"), (SMALL, "dpo"), (LARGE, "sft"), (LARGE, "ppo"), (LARGE, "dpo")]
    # the stages' metrics: RM accuracy SMALL (0.60 + 0.62 + 0.64) / 3 = 0.62; LARGE two seeds (0.60 + 0.62) / 2 = 0.61;
    # LARGE's PPO score only seed 44413's (1.0), the running one left out
    metrics = text.split("## The stages' own metrics")[1].split("\n## ")[0]
    header = [cell.strip() for cell in metrics.splitlines()[2].strip("|").split(" | ")]
    cells = {line.split(" | ")[0].strip("| "): [c.strip() for c in line.strip("|").split(" | ")]
             for line in metrics.splitlines() if line.startswith("| EleutherAI")}
    assert cells[SMALL][header.index("RM accuracy")] == "0.620 (3)"
    assert cells[LARGE][header.index("RM accuracy")] == "0.610 (2)"
    assert cells[LARGE][header.index("PPO RM score")] == "1.000 (1)"
    assert cells[SMALL][header.index("SFT ROUGE-L")] == "0.410 (3)"
    # what is not complete, each named
    missing = text.split("## Missing or not complete")[1]
    for expected in (f"{LARGE}/reward_66613: not complete (no eval_metrics.json)",
                     f"{LARGE} seed 66613: no judge_66613 folder", f"{LARGE}/ppo_55513: not complete",
                     f"{LARGE}/judge_55513: ppo__seed55513 left out: ppo_55513 is not complete (training again?)"):
        assert expected in missing, missing
    assert "checkpoints" not in missing  # a run's own folders are no runs


def test_incomplete_and_foreign_judges_are_left_out_and_mixed_judges_refused(sweep, tmp_path):
    stopped = sweep / SMALL / "judge_55513" / "results.json"
    write(stopped, judge_results("55513", RATES[(SMALL, "55513")], this_run={"stopped": "429 insufficient_quota"}))
    retry = sweep / SMALL / "judge_66613" / "results.json"
    write(retry, judge_results("66613", RATES[(SMALL, "66613")], failures=[{"asked_by_rerun": True}]))
    result = run_report(sweep, tmp_path / "a")
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "a.md").read_text()
    assert table_row(text, SMALL, "ppo", "Figure 1")[3:6] == ["1", "0.500", "-"]  # seed 44413 alone
    assert "judge_55513: left out, not complete: its last run stopped (429 insufficient_quota)" in text
    assert "judge_66613: left out, not complete: 1 failed rows that a rerun asks again" in text
    # another judge model in one folder: refused, named, until --judge_model picks one
    write(sweep / LARGE / "judge_44413" / "results.json", judge_results("44413", RATES[(LARGE, "44413")], model="judge-b"))
    result = run_report(sweep, tmp_path / "b")
    assert result.returncode != 0 and "2 judge models (judge-a, judge-b)" in result.stderr
    assert "--judge_model judge-a" in result.stderr and not (tmp_path / "b.md").exists()
    result = run_report(sweep, tmp_path / "b", "--judge_model", "judge-a")
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "b.md").read_text()
    assert table_row(text, LARGE, "sft", "Figure 1")[3:5] == ["1", "0.440"]  # seed 55513 alone
    assert f"{LARGE}/judge_44413: left out, judged by `judge-b`, not `judge-a`" in text


def test_a_run_trained_again_after_its_judge_and_a_linked_model_folder(sweep, tmp_path):
    """A stage that finished after its seed's judge wrote results.json (trained again) leaves that judge's verdicts on
    it out, named; a model folder that is a symbolic link (to scratch space) is read like any other."""
    import os

    judged = (sweep / SMALL / "judge_44413" / "results.json").stat().st_mtime
    os.utime(sweep / SMALL / "dpo_44413" / "eval_metrics.json", (judged + 60, judged + 60))
    (tmp_path / "scratch").mkdir()
    (sweep / LARGE).rename(tmp_path / "scratch" / "large")
    (sweep / LARGE).symlink_to(tmp_path / "scratch" / "large", target_is_directory=True)
    result = run_report(sweep, tmp_path / "c")
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "c.md").read_text()
    assert table_row(text, SMALL, "dpo", "Figure 1")[3:5] == ["2", "0.460"]  # (0.44 + 0.48) / 2, 44413 left out
    assert table_row(text, SMALL, "ppo", "Figure 1")[3:5] == ["3", "0.530"]
    assert (f"{SMALL}/judge_44413: dpo__seed44413 left out: dpo_44413 finished after it was judged: judge it again"
            in text)
    assert table_row(text, LARGE, "sft", "Figure 1")[3:5] == ["2", "0.420"]  # found through the link


def test_bad_inputs_are_named(tmp_path):
    result = run_report(tmp_path / "nowhere", tmp_path / "r")
    assert result.returncode != 0 and "is not a folder" in result.stderr
    (tmp_path / "empty").mkdir()
    result = run_report(tmp_path / "empty", tmp_path / "r")
    assert result.returncode != 0 and "no <stage>_<seed> run folder below" in result.stderr
    write(tmp_path / "m" / "tiny" / "sft_1" / "eval_metrics.json", {})
    (tmp_path / "m" / "tiny" / "sft_1" / "eval_metrics.json").write_text("{torn")
    result = run_report(tmp_path / "m", tmp_path / "r")
    assert result.returncode != 0 and "sft_1/eval_metrics.json is not JSON" in result.stderr
    assert not list(tmp_path.glob("r*"))


def test_model_size_from_safetensors_headers_then_the_name(tmp_path):
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(tmp_path / "model.safetensors"))
    assert sweep_report.safetensors_parameters(str(tmp_path)) == 17
    shards = tmp_path / "sharded"
    shards.mkdir()
    save_file({"a": torch.zeros(3, 4)}, str(shards / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(2, 5), "c": torch.zeros(7)}, str(shards / "model-00002-of-00002.safetensors"))
    write(shards / "model.safetensors.index.json", {"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                                   "b": "model-00002-of-00002.safetensors",
                                                                   "c": "model-00002-of-00002.safetensors"}})
    assert sweep_report.safetensors_parameters(str(shards)) == 12 + 10 + 7
    assert sweep_report.model_size("m", {"1": {"sft": str(shards)}}) == 29
    assert sweep_report.model_size("EleutherAI/pythia-6.9b-deduped", {"1": {"sft": str(tmp_path / "none")}}) == 6.9e9
    assert sweep_report.model_size("EleutherAI/pythia-160m", {}) == 160e6
    assert sweep_report.model_size("tiny", {}) is None
    assert sweep_report.size_label(6.9e9) == "6.90B" and sweep_report.size_label(581_000) == "0.58M"
