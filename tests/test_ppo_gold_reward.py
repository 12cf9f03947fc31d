"""benchmark/ppo_gold_reward.py: the gold score of token rows, its judge by hand, and a smoke run of both rewards."""

import csv
import dataclasses
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from datasets import load_from_disk

from conftest import REPO, WORLD, run_python

sys.path.insert(0, str(REPO / "benchmark"))
import ppo_gold_reward as gold_reward  # noqa: E402
import tiny_report  # noqa: E402
import tiny_world  # noqa: E402

POST = ("SUBREDDIT: r/relationships\n\nTITLE: My landlord cancelled my lease\n\nPOST: So last week my landlord "
        "cancelled my lease. It was rainy.\n\nThen my sister borrowed my car without even asking.\n\nTL;DR:")


def test_gold_scores_of_left_padded_rows_are_the_judges_scores_of_the_texts():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(WORLD / "pythia-tiny")
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    query = tokenizer(POST).input_ids
    good, invented = " landlord cancelled lease; sister borrowed car", " landlord cancelled lease; my uncle sold my boat"
    rows = []
    for summary in (good, invented):
        response = tokenizer(summary).input_ids + [eos]
        rows.append([pad] * 3 + query + response + [pad] * (12 - len(response)))  # left-padded query, padded response
    import torch

    scores = gold_reward.gold_scores(tokenizer, torch.tensor(rows), pad, 3 + len(query))
    assert scores == [tiny_world.gold_score(POST, good.strip()), tiny_world.gold_score(POST, invented.strip())]
    assert scores[0] > scores[1]  # the invented fact costs: the judge did read the post


def test_reference_mean_gold_is_the_mean_judge_score_of_the_references():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(WORLD / "pythia-tiny")
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    references = [" landlord cancelled lease; sister borrowed car", " my uncle sold my boat"]
    query = tokenizer(POST).input_ids
    train = {"query_token": [[pad] * 2 + query, [pad] * 2 + query],  # left-padded queries, right-padded references
             "reference_response_token": [(tokenizer(r).input_ids + [eos] + [pad] * 12)[:12] for r in references]}
    expected = sum(tiny_world.gold_score(POST, r.strip()) for r in references) / 2
    assert gold_reward.reference_mean_gold(tokenizer, train) == pytest.approx(expected, abs=1e-9)
    assert tiny_world.gold_score(POST, references[0].strip()) != tiny_world.gold_score(POST, references[1].strip())


def test_job_root_resolves_the_main_jobs_relative_paths_in_its_own_checkout(tmp_path):
    """A main job run in another clone (its args.json: models/tiny/...) resolves there, not in this checkout."""
    main_job = {"output_dir": "models/tiny/ppo_1", "sft_model_path": "models/tiny/sft_1", "batch_size": 64}
    (tmp_path / "clone" / "models" / "tiny" / "sft_1").mkdir(parents=True)
    root = gold_reward.job_root(str(tmp_path / "clone" / "models" / "tiny"), main_job)
    assert root == str(tmp_path / "clone")
    flags = gold_reward.ppo_flags(main_job, 1, "/out", "run", 1, root=root)
    assert flags[flags.index("--sft_model_path") + 1] == str(tmp_path / "clone" / "models" / "tiny" / "sft_1")
    assert gold_reward.job_root("/elsewhere/clone/models/tiny", main_job) == "/elsewhere/clone"
    assert gold_reward.job_root("/elsewhere/clone/models/tiny/", main_job) == "/elsewhere/clone"
    assert gold_reward.job_root("/tmp/m5", {"output_dir": "/tmp/m5/ppo_5"}) == gold_reward.ROOT  # absolute paths
    assert gold_reward.job_root("/tmp/other", main_job) == gold_reward.ROOT  # no such relative part: this checkout
    flags = gold_reward.ppo_flags(main_job, 1, "/out", "run", 1, root="/elsewhere/clone")
    # models/tiny/sft_1 does not exist under /elsewhere/clone: kept as given (a Hub id would be too)
    assert flags[flags.index("--sft_model_path") + 1] == "models/tiny/sft_1"


def test_judge_counts_wins_and_a_tie_as_half():
    good, worse = "landlord cancelled lease; sister borrowed car", "landlord cancelled lease"
    rows = [{"query": POST, "response": good, "reference": worse},  # win
            {"query": POST, "response": worse, "reference": worse},  # tie: 1/2
            {"query": POST + " ", "response": worse, "reference": good}]  # loss
    judged = gold_reward.judge(rows)
    assert (judged["wins"], judged["judged"], judged["win_rate"]) == (1.5, 3, 0.5)
    assert judged["ci"] == pytest.approx(tiny_report.wilson_interval(1.5, 3))
    assert gold_reward.judge(rows[:2])["win_rate"] == 0.75  # a win and a tie
    assert judged["words"] == pytest.approx((6 + 3 + 3) / 3)
    assert judged["mistakes"] == tiny_report.mistake_profile([(r["query"].strip(), r["response"]) for r in rows],
                                                              tiny_world)
    # against another table, matched by the stripped query: `good` against `good` ties, `worse` against `good` loses
    other = [{"query": POST, "response": good}]
    assert (gold_reward.judge(rows[:1], other)["wins"], gold_reward.judge(rows[:1], other)["judged"]) == (0.5, 1)
    assert (gold_reward.judge(rows[1:], other)["wins"], gold_reward.judge(rows[1:], other)["judged"]) == (0, 2)
    assert gold_reward.judge(rows, [])["judged"] == 0  # no post in common: nothing judged


def test_smoke_run_with_both_rewards(tiny_tldr, tmp_path):
    """The untuned base model as SFT, a fresh RM from it, one update of each reward: the gold run's scores are the
    gold judge's, the RM run's are not, and the report lists both."""
    import ppo
    import reward

    models = tmp_path / "models"
    shutil.copytree(WORLD / "pythia-tiny", models / "sft_1")
    reward.reward_model_from_sft(str(WORLD / "pythia-tiny")).save_pretrained(models / "reward_1")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # reward.py saves the SFT tokenizer beside the RM
        shutil.copy(WORLD / "pythia-tiny" / name, models / "reward_1" / name)
    main_job = {f.name: f.default for f in dataclasses.fields(ppo.Args) if f.default is not dataclasses.MISSING}
    main_job.update(base_model=str(WORLD / "pythia-tiny"), query_dataset=str(tiny_tldr / "sft"),
                    sft_model_path=str(models / "sft_1"), reward_model_path=str(models / "reward_1"), seed=1,
                    response_length=8, batch_size=8, local_micro_batch_size=4, local_rollout_forward_batch_size=8,
                    local_eval_batch_size=16, num_eval_samples=16, num_updates=1, run_name="no_such_run")
    (models / "ppo_1").mkdir()
    (models / "ppo_1" / "args.json").write_text(json.dumps(main_job))
    with open(models / "sft_1" / "eval_validation.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, ["query", "response", "reference"])
        writer.writeheader()
        writer.writerow({"query": POST, "response": "landlord cancelled lease", "reference": "sister borrowed car"})
    result = run_python([sys.executable, str(REPO / "benchmark" / "ppo_gold_reward.py"), "--models", str(models),
                         "--gold_updates", "1", "--normalised_gold_updates", "1", "--rm_updates", "1",
                         "--eval_every", "1"], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    out = models / "ppo_gold_reward"
    # Detail 15's shift for the gold judge: the train references' mean gold score, from their texts
    train = load_from_disk(str(tiny_tldr / "sft"))["train"]
    shift = sum(tiny_world.gold_score(row["query"].strip(), row["reference_response"].replace("<|endoftext|>", "").strip())
                for row in train) / len(train)
    assert "gold reward less the train references' mean gold score, " + f"{shift:.4f}" in (
        out / "normalised_gold_1" / "ppo.log").read_text()
    for name, offset in (("gold_1", 0.0), ("normalised_gold_1", shift), ("rm_1", None)):
        rows = list(csv.DictReader(open(out / name / "ppo" / "eval_validation.csv")))
        assert len(rows) == 16
        gold = [tiny_world.gold_score(row["query"].strip(), row["response"].strip()) for row in rows]
        matches = [abs(float(row["score"]) - (g - (offset or 0.0))) < 1e-5 for row, g in zip(rows, gold)]
        assert all(matches) if offset is not None else not all(matches), name
    report = (out / "report.md").read_text()
    assert "| PPO, gold reward | gold | 1 |" in report and "| PPO, RM reward | RM | 1 |" in report
    assert "| PPO, normalised gold reward | normalised gold | 1 |" in report
    assert "| SFT | - | 0 |" in report
    assert report.count("| update | reward score |") == 3  # a curve per run here (the main job's run is not there)

    # --zero_critic_head: the RM's reward, the critic's head zeroed (not the reward model's: its scores still differ)
    result = run_python([sys.executable, str(REPO / "benchmark" / "ppo_gold_reward.py"), "--models", str(models),
                         "--gold_updates", "--rm_updates", "1", "--eval_every", "1", "--zero_critic_head"], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "the critic's head zeroed: every first value is 0" in (out / "rm_1_zero_critic" / "ppo.log").read_text()
    rows = list(csv.DictReader(open(out / "rm_1_zero_critic" / "ppo" / "eval_validation.csv")))
    assert len({row["score"] for row in rows}) > 1
    report = (out / "report.md").read_text()
    assert "| PPO, RM reward, critic head zeroed | RM | 1 |" in report and "| PPO, gold reward" not in report
    assert (out / "curves.png").stat().st_size > 0

    # --ppo_flags: ppo.py flags after the main job's, here the value clip; the run's own folder and label
    result = run_python([sys.executable, str(REPO / "benchmark" / "ppo_gold_reward.py"), "--models", str(models),
                         "--gold_updates", "--rm_updates", "1", "--ppo_flags", "--cliprange_value 1000"], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    ran = json.loads((out / "rm_1_flags" / "ppo" / "args.json").read_text())
    assert ran["cliprange_value"] == 1000 and ran["cliprange"] == main_job["cliprange"]
    assert "| PPO, RM reward, --cliprange_value 1000 | RM | 1 |" in (out / "report.md").read_text()


def test_ppo_flags_repeat_every_setting_of_the_main_job(tmp_path):
    """ppo_flags, read back by ppo.py's own parser: a main job whose every setting differs from ppo.py's default runs
    again with each of them (booleans included), but for what this script sets (updates, folders, evaluations) and
    ppo.py's speed-only or bookkeeping flags."""
    import tyro

    import ppo

    own = {"exp_name", "run_name", "track", "wandb_project_name", "wandb_entity", "output_dir", "push_to_hub",
           "hf_entity", "save_every", "resume", "stop_after_updates", "stop_after_minutes", "total_episodes",
           "eval_every", "eval_test", "fast_sampling", "compile_training", "gradient_checkpointing", "offload",
           "length_groups"}  # set here, or not a setting of the algorithm
    main_job = {}
    for field in dataclasses.fields(ppo.Args):
        if field.name in own or "Suppress" in str(field.type):  # derived by ppo.py
            continue
        default, kind = field.default, str(field.type)
        main_job[field.name] = (not default if isinstance(default, bool) else default + 3 if isinstance(default, int)
                                else default * 3 + 0.5 if isinstance(default, float) else 7 if "int" in kind
                                else f"/main/{field.name}")
    main_job["num_updates"] = 7
    flags = gold_reward.ppo_flags(main_job, 5, "/out", "run", 2, root=str(tmp_path))
    parsed = tyro.cli(ppo.Args, args=flags, use_underscores=True)
    assert {key: getattr(parsed, key) for key in main_job if key != "num_updates"} == {
        key: value for key, value in main_job.items() if key != "num_updates"}
    assert (parsed.total_episodes, parsed.output_dir, parsed.run_name, parsed.eval_every) == (
        5 * main_job["batch_size"], "/out", "run", 2)


def test_report_of_faked_runs_by_hand(tmp_path, monkeypatch):
    """ppo_gold_reward.main with ppo.py faked (each run writes its validation samples and its periodic evaluations):
    each run's command and episodes, the win rates against the references and against SFT, the curves' updates (episodes
    / batch), RM and gold scores and words, and the plot's start at SFT's win rate, each against the gold judge."""
    good, worse, bad = ("landlord cancelled lease; sister borrowed car", "landlord cancelled lease",
                        "my uncle sold my boat")
    posts = [POST, POST.replace("My landlord cancelled my lease", "Landlord trouble")]

    def table(response: str, score: float) -> list:
        return [{"query": post, "response": response, "reference": worse, "score": str(score),
                 "reference_score": "0.5"} for post in posts]

    def write(path, rows: list) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as file:
            writer = csv.DictWriter(file, list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)

    models, runs = tmp_path / "models", tmp_path / "runs"
    main_job = {"batch_size": 64, "lr": 1e-4, "kl_coef": 0.05, "response_length": 8, "eval_temperature": 0.01,
                "num_updates": 2, "run_name": "main_run"}
    (models / "ppo_1").mkdir(parents=True)
    (models / "ppo_1" / "args.json").write_text(json.dumps(main_job))
    write(models / "sft_1" / "eval_validation.csv", table(bad, 0.0))  # SFT loses to the references
    write(models / "ppo_1" / "eval_validation.csv", table(good, 0.0))  # the main job wins
    write(runs / "main_run" / "samples_validation_64.csv", table(bad, 3.0))
    write(runs / "main_run" / "samples_validation_128.csv", table(good, 4.0))
    commands = []

    def fake_ppo(command, cwd, stdout, stderr):
        commands.append(command)
        flag = lambda name: command[command.index(name) + 1]  # noqa: E731
        write(Path(flag("--output_dir")) / "eval_validation.csv", table(good, 0.0))
        write(Path(cwd) / "runs" / flag("--run_name") / f"samples_validation_{flag('--total_episodes')}.csv",
              table(good, 9.0))
        return SimpleNamespace(returncode=0)

    plotted = []
    monkeypatch.setattr(gold_reward.subprocess, "run", fake_ppo)
    monkeypatch.setattr(gold_reward, "plot", lambda curves, start, path: plotted.append((list(curves), start)))
    monkeypatch.setattr(sys, "argv", ["ppo_gold_reward.py", "--models", str(models), "--runs_dir", str(runs),
                                      "--gold_updates", "1", "--normalised_gold_updates", "--rm_updates", "3"])
    gold_reward.main()
    assert commands[0][1:3] == [str(REPO / "benchmark" / "ppo_gold_reward.py"), "ppo"]  # ppo.py, the gold reward
    assert commands[1][1] == str(REPO / "ppo.py")  # the RM run: ppo.py itself
    assert [command[command.index("--total_episodes") + 1] for command in commands] == ["64", "192"]
    report = (models / "ppo_gold_reward" / "report.md").read_text()
    gold = lambda response: tiny_world.gold_score(POST, response)  # noqa: E731
    assert gold(good) > gold(worse) > gold(bad)
    words = lambda text: len(tiny_world.words(text))  # noqa: E731
    ci_win, ci_loss = (tiny_report.wilson_interval(wins, 2) for wins in (2, 0))
    fmt = lambda ci: f"[{ci[0]:.3f}, {ci[1]:.3f}]"  # noqa: E731
    assert f"| SFT | - | 0 | 0.000 {fmt(ci_loss)} | - |" in report
    for label, updates in (("PPO, the main job", 2), ("PPO, gold reward", 1), ("PPO, RM reward", 3)):
        assert f"| {label} | {'gold' if 'gold' in label else 'RM'} | {updates} | 1.000 {fmt(ci_win)} | " \
               f"1.000 {fmt(ci_win)} |" in report, label  # they win against the references and against SFT
    mean_gold = lambda response: sum(tiny_world.gold_score(p, response) for p in posts) / 2  # noqa: E731
    assert (f"| 1 | 3.000 | {mean_gold(bad):.3f} | 0.000 | {words(bad):.1f} |\n"
            f"| 2 | 4.000 | {mean_gold(good):.3f} | 1.000 | {words(good):.1f} |") in report  # the main job's curve
    assert f"| 1 | 9.000 | {mean_gold(good):.3f} | 1.000 | {words(good):.1f} |" in report  # the gold run's
    assert f"| 3 | 9.000 | {mean_gold(good):.3f} | 1.000 | {words(good):.1f} |" in report  # the RM run's
    assert plotted == [(["RM reward, 2 updates (the main job)", "gold reward, 1 update", "RM reward, 3 updates"], 0.0)]
