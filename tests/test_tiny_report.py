"""benchmark/tiny_report.py: its pure helpers against hand-computed values, and the report on hand-made
artifacts (the numbers land in report.md, a stage that did not run reads "not run", the figures are written)."""

import csv
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
from conftest import run_python

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmark"))
sys.path.insert(0, str(REPO))

import tiny_report  # noqa: E402
import tiny_world  # noqa: E402


def write(path: Path, payload) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload) if not isinstance(payload, str) else payload)


def write_csv(path: Path, rows: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


# ------------------------------------------------------------------------------------------------
# Pure helpers
# ------------------------------------------------------------------------------------------------
def test_wilson_interval_by_hand():
    # 8 / 10: p = 0.8, z^2 = 3.841459; centre (0.8 + 0.192073) / 1.384146 = 0.716740,
    # half 1.959964 * sqrt(0.016 + 0.009604) / 1.384146 = 0.226578
    low, high = tiny_report.wilson_interval(8, 10)
    assert (low, high) == pytest.approx((0.490162, 0.943318), abs=1e-6)
    low, high = tiny_report.wilson_interval(0, 10)  # z^2 / (n + z^2) = 3.841459 / 13.841459
    assert low == pytest.approx(0.0, abs=1e-12) and high == pytest.approx(0.277533, abs=1e-6)
    assert all(math.isnan(x) for x in tiny_report.wilson_interval(0, 0))


def test_digits_apart_by_hand():
    assert tiny_report.digits_apart(104 / 231, 0.10, 0.45) == 4  # 0.4502: 3 decimals would print the bar, 0.450
    assert tiny_report.digits_apart(0.70004, 0.70) == 5 and tiny_report.digits_apart(0.699, 0.70) == 3
    assert tiny_report.digits_apart(0.45, 0.45) == 3  # equal: nothing to tell apart
    assert tiny_report.digits_apart(0.45000001, 0.45) == 6  # at most 6 decimals
    assert tiny_report.digits_apart(0.6 - 0.4, 0.20) == 3  # 0.19999999999999996: float rounding, not a difference
    assert tiny_report.digits_apart(0.0004, 0.0, digits=2) == 4


def judged_run(wins, judged):
    """A judged run as findings() reads it: its posts judged, win rate and Wilson interval."""
    low, high = tiny_report.wilson_interval(wins, judged)
    return {"n": judged, "win_rate": wins / judged, "ci_low": low, "ci_high": high}


@pytest.fixture
def any_posts(monkeypatch):
    """Bars judged on runs of any size (the tests of the 256-post rule itself leave it at 256)."""
    monkeypatch.setattr(tiny_report, "MIN_POSTS", 1)


def test_fig1_bars_need_256_judged_posts():
    """A bar whose win rates rest on fewer than 256 judged posts does not hold, and says which run is short; one more
    post makes it hold. Bars of other runs are not touched."""
    art = {"judge": {"sft": judged_run(77, 256), "ppo": judged_run(150, 256), "dpo": judged_run(100, 255)},
           "head_to_head": {}, "rm": {}, "dpo": {}, "rm_rows": {}, "judged": {}, "curve": [], "timings": []}
    rows = {row["finding"]: (row["measured"], row["holds"]) for row in tiny_report.findings(art)}
    assert rows["Fig. 1: SFT loses to the references"][1] is True
    assert rows["Fig. 1: RLHF (PPO) beats SFT"] == ("PPO - SFT = +0.285", True)
    assert rows["Fig. 1: DPO beats SFT"] == ("DPO 0.392 [0.334, 0.453]; DPO judged on 255 posts, fewer than 256", False)
    art["judge"]["dpo"] = judged_run(100, 256)
    assert next(r for r in tiny_report.findings(art) if r["finding"] == "Fig. 1: DPO beats SFT")["holds"] is True
    art["judge"]["sft"] = judged_run(76, 255)  # SFT short: each of the four bars it enters fails, PPO's own holds
    holds = {row["finding"]: row["holds"] for row in tiny_report.findings(art)}
    assert [holds[f] for f in ("Fig. 1: SFT loses to the references", "Fig. 1: RLHF (PPO) beats SFT",
                               "Fig. 1: ... beyond the noise", "Fig. 1: DPO beats SFT")] == [False] * 4
    assert holds["Fig. 1: PPO is at least even with the references"] is True


def test_findings_show_the_decimals_that_decide_a_bar(any_posts):
    """A number that would print as its bar, or as the number it is compared with, is printed with more decimals, and
    a gain of exactly the bar meets it despite float rounding."""
    art = {"judge": {"sft": judged_run(104, 231), "ppo": judged_run(6, 10), "dpo": judged_run(1040, 2309)},
           "head_to_head": {},
           "rm": {"eval/rm/validation/accuracy": 0.69996, "eval/rm/validation_cnndm/accuracy": 0.61},
           "dpo": {"eval/dpo/validation/accuracy": 0.69994}, "rm_rows": {}, "judged": {}, "curve": [], "timings": []}
    rows = {row["finding"]: (row["measured"], row["holds"]) for row in tiny_report.findings(art)}
    assert rows["Fig. 1: SFT loses to the references"] == ("0.4502 [0.387, 0.515]", False)
    assert rows["Fig. 1: DPO beats SFT"][0].startswith("DPO 0.4504 [") and rows["Fig. 1: DPO beats SFT"][0].endswith(
        "] (SFT 0.4502)")
    assert rows["Fig. 4: the RM learns the labels"] == ("0.69996", False)
    assert rows["Fig. 4: the RM transfers to news (CNN/DM)"] == ("0.610", True)
    assert rows["Fig. 6: DPO's implicit reward is the weaker RM"] == ("DPO 0.6999, RM 0.7000", True)
    art["judge"] = {"sft": judged_run(4, 10), "ppo": judged_run(6, 10)}  # PPO - SFT is 0.2 exactly
    rows = {row["finding"]: (row["measured"], row["holds"]) for row in tiny_report.findings(art)}
    assert rows["Fig. 1: RLHF (PPO) beats SFT"] == ("PPO - SFT = +0.200", True)
    assert rows["Fig. 1: PPO is at least even with the references"][0].startswith("0.600 [")
    # PPO's lower bound against SFT's upper one (4/10 and 6/10 overlap: not beyond the noise)
    assert rows["Fig. 1: ... beyond the noise"] == ("PPO's lower bound 0.313, SFT's upper bound 0.687", False)


def test_findings_at_their_bars_exactly(any_posts):
    """Each bar's comparison at equality: "at least" holds (SFT at 0.45, PPO at 0.50, the RM at 0.70, CNN/DM at
    0.60), "beats" and "weaker" do not (DPO at SFT's win rate, DPO's accuracy at the RM's)."""
    art = {"judge": {"sft": judged_run(45, 100), "ppo": judged_run(50, 100), "dpo": judged_run(45, 100)},
           "head_to_head": {},
           "rm": {"eval/rm/validation/accuracy": 0.70, "eval/rm/validation_cnndm/accuracy": 0.60},
           "dpo": {"eval/dpo/validation/accuracy": 0.70}, "rm_rows": {}, "judged": {}, "curve": [], "timings": []}
    holds = {row["finding"]: row["holds"] for row in tiny_report.findings(art)}
    assert holds["Fig. 1: SFT loses to the references"] is True
    assert holds["Fig. 1: PPO is at least even with the references"] is True
    assert holds["Fig. 1: DPO beats SFT"] is False
    assert holds["Fig. 4: the RM learns the labels"] is True
    assert holds["Fig. 4: the RM transfers to news (CNN/DM)"] is True
    assert holds["Fig. 6: DPO's implicit reward is the weaker RM"] is False
    art["judge"]["sft"] = judged_run(10, 100)  # the band's other end
    assert next(row for row in tiny_report.findings(art) if row["finding"].startswith("Fig. 1: SFT"))["holds"] is True
    # PPO's lower bound at SFT's upper bound exactly: the CIs touch, PPO is not beyond the noise
    art["judge"] = {"sft": {"n": 256, "win_rate": 0.25, "ci_low": 0.2, "ci_high": 0.375},
                    "ppo": {"n": 256, "win_rate": 0.5, "ci_low": 0.375, "ci_high": 0.625}}
    holds = {row["finding"]: row["holds"] for row in tiny_report.findings(art)}
    assert holds["Fig. 1: ... beyond the noise"] is False and holds["Fig. 1: RLHF (PPO) beats SFT"] is True


def test_findings_judge_the_direction_of_a_gain(any_posts):
    """PPO far below SFT is no gain (PPO - SFT is negative, whatever its size); over-optimisation names the update where
    gold peaks, update 0 (SFT) included: PPO that only loses gold peaks at 0."""
    art = {"judge": {"sft": judged_run(45, 100), "ppo": judged_run(15, 100)}, "head_to_head": {}, "rm": {}, "dpo": {},
           "rm_rows": {}, "judged": {}, "timings": [],
           "curve": [{"update": 0, "gold": 2.5, "rm": None}, {"update": 5, "gold": 2.0, "rm": 0.5},
                     {"update": 10, "gold": 1.0, "rm": 1.5}]}
    rows = {row["finding"]: (row["measured"], row["holds"]) for row in tiny_report.findings(art)}
    assert rows["Fig. 1: RLHF (PPO) beats SFT"] == ("PPO - SFT = -0.300", False)
    curve = next(measured for finding, (measured, _) in rows.items() if finding.startswith("Over-optimisation"))
    assert curve == "gold peaks at update 0 (2.500); at the last, update 10: gold 1.000, RM score 1.500"


def test_fig8_finding_holds_only_where_ppo_is_above_sft_in_every_compared_bucket():
    """The Fig. 8 row of the findings on judged rows with >= 30 summaries of each policy per bucket: PPO above SFT in
    both compared buckets holds; the same rows with the policies' roles exchanged (SFT above PPO) do not."""
    row = lambda preferred, ours: dict(preferred=preferred, ours_words=ours, other_words=10)  # noqa: E731
    better = [row("ours", 10)] * 30 + [row("reference", 10)] * 10 + [row("ours", 20)] * 20 + [row("reference", 20)] * 10
    worse = [row("ours", 10)] * 20 + [row("reference", 10)] * 20 + [row("ours", 20)] * 10 + [row("reference", 20)] * 20
    art = {"judge": {}, "head_to_head": {}, "rm": {}, "dpo": {}, "rm_rows": {}, "curve": [], "timings": [],
           "judged": {"sft": worse, "ppo": better}}
    fig8 = lambda: next(r for r in tiny_report.findings(art) if r["finding"].startswith("Fig. 8"))  # noqa: E731
    assert (fig8()["measured"], fig8()["holds"]) == ("PPO above in 2 of 2 ([-0.15, +0.15), [+0.45, +0.75))", True)
    art["judged"] = {"sft": better, "ppo": worse}
    assert (fig8()["measured"], fig8()["holds"]) == (
        "PPO above in 0 of 2 ([-0.15, +0.15), [+0.45, +0.75)); not above in [-0.15, +0.15), [+0.45, +0.75)", False)
    # a bucket where neither policy has 30 summaries is neither judged nor listed as one-sided
    art["judged"] = {"sft": worse + [row("ours", 40)] * 5, "ppo": better + [row("reference", 40)] * 5}
    assert fig8()["holds"] is True and "with 30 of one policy only" not in fig8()["measured"]


def test_time_is_judged_unless_a_stage_was_resumed():
    """tiny.sh's rows: a stage kept from an earlier start was timed whole and counts; one resumed from a checkpoint
    timed only its rest, so the total is shown but not judged against the budget."""
    others = [(stage, 0.0) for stage in tiny_report.JOB_STAGES if stage not in ("preprocess", "sft")]
    art = {"judge": {}, "head_to_head": {}, "rm": {}, "dpo": {}, "rm_rows": {}, "judged": {}, "curve": [],
           "timings": [("tiny world", 900.0), ("preprocess (an earlier start)", 30.0), *others, ("sft", 100.0)]}
    time = lambda: next(row for row in tiny_report.findings(art) if row["finding"].startswith("Time"))  # noqa: E731
    assert (time()["measured"], time()["holds"]) == ("2 min 10 s", True)  # the world's build apart
    art["timings"][-1] = ("sft", 690.0)  # 12 min exactly: at the bar, which holds
    assert (time()["measured"], time()["holds"]) == ("12 min 0 s", True)
    art["timings"][-1] = ("sft", 691.0)
    assert time()["holds"] is False
    art["timings"][-1] = ("sft", 100.0)
    art["timings"] += [("reward (resumed)", 700.0)]
    assert (time()["measured"], time()["holds"]) == ("13 min 50 s (not judged: reward (resumed): continued from a "
                                                     "checkpoint, so timed only in part)", None)
    art["timings"] = [("reward (resumed) (an earlier start)", 10.0)]  # kept later: still resumed
    assert time()["holds"] is None
    # A report of a run that stopped after the RM: its stages' time is no verdict on the whole job.
    art["timings"] = [("preprocess", 15.0), ("sft: base model", 9.0), ("sft", 68.0), ("reward", 243.0)]
    assert (time()["measured"], time()["holds"]) == (
        "5 min 35 s (not judged: no time for dpo, ppo, judge (gold): the job did not run whole)", None)


def test_the_report_knows_every_stage_tiny_sh_runs():
    """The time bar holds only when every stage of the job has its row: the names are tiny.sh's own."""
    script = (REPO / "benchmark" / "tiny.sh").read_text()
    assert tuple(re.findall(r'\bstage "([^"]+)"', script)) == tiny_report.JOB_STAGES


def test_ppo_sample_tables_refuse_another_runs_folder(tmp_path, capsys):
    """The curve over PPO updates reads runs/<run_name>/: a folder rewritten by another run of the same name (its last
    table is not this run's eval_validation.csv) gives no curve, with a note, rather than that run's curve."""
    (tmp_path / "models" / "ppo_1").mkdir(parents=True)
    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "models" / "ppo_1" / "args.json").write_text(json.dumps({"run_name": "r", "batch_size": 2, "num_updates": 2}))
    for episode, response in ((2, "a"), (4, "b")):
        (tmp_path / "runs" / "r" / f"samples_validation_{episode}.csv").write_text(f"query,response\nq,{response}\n")
    (tmp_path / "models" / "ppo_1" / "eval_validation.csv").write_text("query,response\nq,b\n")
    tables, batch = tiny_report.ppo_sample_tables(str(tmp_path / "models"), 1, str(tmp_path / "runs"))
    assert sorted(tables) == [2, 4] and batch == 2 and tables[4] == [{"query": "q", "response": "b"}]
    (tmp_path / "models" / "ppo_1" / "eval_validation.csv").write_text("query,response\nq,c\n")
    assert tiny_report.ppo_sample_tables(str(tmp_path / "models"), 1, str(tmp_path / "runs")) == ({}, None)
    assert "holds another PPO run's samples" in capsys.readouterr().err


def test_length_buckets_by_hand():
    rows = [dict(ours_words=o, other_words=r, preferred=p) for o, r, p in [
        (10, 10, "ours"),  # log 1 = 0 -> [-0.15, 0.15)
        (20, 10, "reference"),  # log 2 = 0.693 -> [0.45, 0.75)
        (5, 10, "ours"),  # -0.693 -> [-0.75, -0.45)
        (10, 10, "tie"),  # a sample of [-0.15, 0.15), counting 1/2
        (7, 10, "malformed"), (7, 10, "unjudged"),  # judged by nobody: in no bucket
        (0, 10, "reference"),  # an empty summary counts as 1 word: log 0.1 = -2.303 -> [-inf, -0.75)
        (10, 5, "ours"),  # 0.693 -> [0.45, 0.75)
        (13, 10, "other"),  # log 1.3 = 0.262 -> [0.15, 0.45), a loss against another run
    ]]
    buckets = tiny_report.length_buckets(rows)
    assert [(b["low"], b["high"]) for b in buckets] == list(zip(tiny_report.LENGTH_EDGES[:-1], tiny_report.LENGTH_EDGES[1:]))
    assert [(b["wins"], b["n"]) for b in buckets] == [(0, 1), (1, 1), (0, 0), (1.5, 2), (0, 1), (1, 2), (0, 0)]
    assert [b["win_rate"] for b in buckets] == [0.0, 1.0, None, 0.75, 0.0, 0.5, None]
    # the report's table: the win rate over the bucket's judged summaries
    table = "\n".join(tiny_report.section_lengths({"judged": {"sft": rows}}))
    assert "| [-0.15, +0.15) | 0.750 (2) |" in table and "| [-0.45, -0.15) | n/a (0) |" in table


def test_fig8_comparison_by_hand():
    """Figure 8's check: buckets with >= 30 judged summaries of each policy (ties included) are judged, the others
    only shown; in the rates compared a tie counts 1/2."""
    row = lambda preferred, ours: dict(preferred=preferred, ours_words=ours, other_words=10)  # noqa: E731
    # log(10/10) = 0: both have 40, PPO 30 wins to SFT's 20 (above); log(20/10) = 0.69: both 30, PPO 10 to SFT's 15
    # (below); log(40/10) = 1.39: PPO 30 (12 wins), SFT 5 (4 wins: not above, one-sided); SFT's 50 ties at log 0
    # make its rate there (20 + 25) / 90 = 0.5
    sft = [row("ours", 10)] * 20 + [row("reference", 10)] * 20 + [row("ours", 20)] * 15 + [row("reference", 20)] * 15 \
        + [row("ours", 40)] * 4 + [row("reference", 40)] + [row("tie", 10)] * 50
    ppo = [row("ours", 10)] * 30 + [row("reference", 10)] * 10 + [row("ours", 20)] * 10 + [row("reference", 20)] * 20 \
        + [row("ours", 40)] * 12 + [row("reference", 40)] * 18
    assert tiny_report.fig8_comparison(sft, ppo) == {
        "compared": ["[-0.15, +0.15)", "[+0.45, +0.75)"], "below": ["[+0.45, +0.75)"],
        "one_sided_below": ["[+0.75, +inf) (PPO 0.400 of 30, SFT 0.800 of 5)"]}
    assert tiny_report.fig8_comparison(sft, None) is None
    # 28 decided and 2 ties make 30 samples: the bucket is judged, and PPO far below SFT there fails it
    sft = [row("ours", 10)] * 20 + [row("reference", 10)] * 8 + [row("tie", 10)] * 2
    ppo = [row("ours", 10)] * 10 + [row("reference", 10)] * 25
    assert tiny_report.fig8_comparison(sft, ppo) == {"compared": ["[-0.15, +0.15)"], "below": ["[-0.15, +0.15)"],
                                                     "one_sided_below": []}
    # PPO tying all 30 (0.5) is below SFT's 0.7 (20 wins and 2 ties of 30), though PPO lost none of them
    assert tiny_report.fig8_comparison(sft, [row("tie", 10)] * 30)["below"] == ["[-0.15, +0.15)"]
    # equal rates (15 of 30 each) are not "above"
    even = [row("ours", 10)] * 15 + [row("reference", 10)] * 15
    assert tiny_report.fig8_comparison(even, even)["below"] == ["[-0.15, +0.15)"]


def test_grouped_accuracy_by_hand():
    rows = [dict(batch="batch3", confidence="9.0", accuracy="1.0"), dict(batch="batch10", confidence="", accuracy="0.0"),
            dict(batch="batch3", confidence="2", accuracy="0.0"), dict(batch="batch10", confidence="9", accuracy="1.0"),
            dict(batch="batch3", confidence="10", accuracy="1.0")]
    # natural order (batch3 before batch10, 2 < 9 < 10); a row without a confidence is in no confidence group
    assert tiny_report.grouped_accuracy(rows, "batch") == [("batch3", 2 / 3, 3), ("batch10", 0.5, 2)]
    assert tiny_report.grouped_accuracy(rows, "confidence") == [("2", 0.0, 1), ("9", 1.0, 2), ("10", 1.0, 1)]


def test_length_reliance_by_hand():
    eos = "<|endoftext|>"
    row = lambda chosen, rejected, right: dict(chosen=chosen, rejected=rejected, accuracy=str(float(right)))  # noqa: E731
    rows = [row("a b" + eos, "a b c" + eos, True),  # chosen shorter (2 < 3 words, the EOS no word), model right
            row("a b c", "a", False),  # chosen longer, model wrong: it prefers the shorter
            row("x" + eos, "x y z", False),  # chosen shorter, model wrong
            row("a b", "c d", True)]  # same length: in no count
    # 3 pairs; labels chose the shorter in 2; the model prefers the shorter in rows 1 and 2
    assert tiny_report.length_reliance(rows) == {"pairs": 3, "labels_shorter": 2 / 3, "model_shorter": 2 / 3,
                                                 "chosen_shorter": (0.5, 2), "chosen_longer": (0.0, 1)}
    assert tiny_report.length_reliance([rows[0]])["chosen_longer"] == (None, 0)
    assert tiny_report.length_reliance([rows[3]]) is None and tiny_report.length_reliance([]) is None


def test_calibration_bins_by_hand():
    rows = [{"chosen_reward": str(m), "rejected_reward": "0.0", "accuracy": str(float(m > 0))}
            for m in (0.2, -0.3, 0.7, -1.2, 1.4)]
    bins = tiny_report.calibration_bins(rows, width=0.5)
    # |m| 0.2, 0.3 -> bin [0, 0.5): 1 of 2 right; 0.7 -> [0.5, 1): 1 of 1; 1.2, 1.4 -> [1, 1.5): 1 of 2
    assert [(lo, hi, n, acc) for lo, hi, n, acc, _ in bins] == [(0.0, 0.5, 2, 0.5), (0.5, 1.0, 1, 1.0), (1.0, 1.5, 2, 0.5)]
    # the stage's accuracy column decides, not the margin's sign: a pair of identical summaries counted 1/2
    rows.append({"chosen_reward": "0.1", "rejected_reward": "0.0", "accuracy": "0.5"})
    assert tiny_report.calibration_bins(rows, width=0.5)[0][2:4] == (3, 0.5)
    # ideal = sigmoid(bin centre): 1 / (1 + e^-0.25), 1 / (1 + e^-0.75), 1 / (1 + e^-1.25)
    assert [ideal for *_, ideal in bins] == pytest.approx([0.562177, 0.679179, 0.777300], abs=1e-6)


def test_overoptimisation_curve_by_hand():
    def gold(post, summary):  # a stand-in judge: words of the summary found in the post
        return float(sum(word in post.split() for word in summary.split()))

    row = lambda q, r, ref, s, rs: dict(query=q, response=r, reference=ref, score=s, reference_score=rs)  # noqa: E731
    tables = {
        128: [row(" a b c ", "a b", "a", "1.5", "0.5"), row("x y", "z", "x y", "-0.5", "0.0")],  # gold 2 vs 1, 0 vs 2
        64: [row("a b c", "a", "a", "0.25", "0.5"), row("x y", "x y", "z", "0.75", "0.0")],  # gold 1 vs 1 (tie), 2 vs 0
    }
    points = tiny_report.overoptimisation_curve(tables, batch_size=64, gold=gold)
    assert [p["update"] for p in points] == [1, 2] and [p["episode"] for p in points] == [64, 128]
    first, second = points
    assert (first["rm"], first["rm_reference"], first["gold"], first["gold_reference"]) == (0.5, 0.25, 1.5, 0.5)
    assert first["gold_win_rate"] == 0.75  # one win, one tie (1/2)
    assert (second["rm"], second["rm_reference"], second["gold"], second["gold_reference"]) == (0.5, 0.25, 1.0, 1.5)
    assert second["gold_win_rate"] == 0.5 and second["n"] == 2
    # scores equal but for the float rounding of their sums (3 x 4/5 - 0.6 against 3 x 3/5) are a tie, as judge.py's
    rounded = {"4 of 5 twice": 3 * 0.8 - 0.3 * 2, "3 of 5": 3 * 0.6, "worse": 1.0}
    assert rounded["4 of 5 twice"] != rounded["3 of 5"]
    tables = {64: [row("p", "4 of 5 twice", "3 of 5", "0", "0"), row("p", "4 of 5 twice", "worse", "0", "0"),
                   row("p", "worse", "3 of 5", "0", "0")]}
    (point,) = tiny_report.overoptimisation_curve(tables, batch_size=64, gold=lambda post, summary: rounded[summary])
    assert point["gold_win_rate"] == 0.5  # one win, one loss, one tie


def test_mistake_profile_by_hand():
    post = "My landlord cancelled my lease. I am so angry right now. I ate tacos."
    pairs = [(post, "landlord cancelled lease, i feel hurt"),  # all 3 facts' words + a feeling it never states
             (post, "sister cancelled lease, tacos tacos, i feel angry")]  # a wrong actor, a filler twice
    # summary 1: post keys {landlord, cancelled, lease, angry}: coverage 3/4, invented {hurt} 1 (a feeling), 6 words
    # summary 2: coverage {cancelled, lease, angry} 3/4, invented {sister} 1 (not a feeling), irrelevant 2,
    #            repetition 1 (tacos twice), 8 words; budget 6 + 2 x 4 = 14: no rambling
    profile = tiny_report.mistake_profile(pairs, tiny_world)
    assert profile == pytest.approx({"coverage": 0.75, "invented": 1.0, "invented_feelings": 0.5, "irrelevant": 1.0,
                                     "repetition": 0.5, "rambling": 0.0, "words": 7.0})
    assert tiny_report.mistake_profile([], tiny_world) == {}


def test_token_shift_by_hand():
    import torch

    before = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0], [0.0, 5.0, 4.0, 3.0]])
    after = torch.tensor([[0.0, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    shifts = tiny_report.token_shift(before, after, torch.tensor([1, 0, 0]))
    # row 0: e^1 / (e^2 + e^1 + e^0 + e^-1) = 2.718282 / 11.475217 = 0.236883, one token above it -> rank 2
    # row 1: uniform 0.25, none strictly above -> rank 1; after: e^3 / (e^3 + 3) = 20.085537 / 23.085537 = 0.870049
    # row 2: token 0 has the smallest logit: 1 / (1 + e^5 + e^4 + e^3) = 1 / 224.096846 = 0.004462, rank 4 -> shifted
    assert [s["p_before"] for s in shifts] == pytest.approx([0.236883, 0.25, 0.004462], abs=1e-6)
    assert [s["p_after"] for s in shifts] == pytest.approx([0.25, 0.870049, 0.25], abs=1e-6)
    assert [(s["rank_before"], s["shift"]) for s in shifts] == [(2, "marginal"), (1, "unshifted"), (4, "shifted")]
    # rank 3 is still "marginal" (ranks 2-3, Lin et al.)
    third = tiny_report.token_shift(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), torch.zeros(1, 4), torch.tensor([2]))
    assert [(s["rank_before"], s["shift"]) for s in third] == [(3, "marginal")]


# ------------------------------------------------------------------------------------------------
# The report on hand-made artifacts
# ------------------------------------------------------------------------------------------------
def judge_run(method: str, wins: int, n: int, low: float, high: float, vs: str = "reference") -> dict:
    return {"method": method, "seed": "3", "vs": vs, "n": n, "wins": wins, "win_rate": wins / n, "ci_low": low,
            "ci_high": high, "ties": 0, "mean_words": 15.0, "mean_other_words": 14.0}


POST = "SUBREDDIT: r/tifu\n\nTITLE: My landlord cancelled my lease\n\nPOST: My landlord cancelled my lease. I ate tacos.\n\nTL;DR:"


def make_run(models: Path, runs: Path, with_dpo: bool) -> None:
    """A tiny run of seed 3: SFT, base, RM, PPO (2 evaluations), judge (+ DPO), timings and the environment."""
    write(models / "environment.json", {"torch_threads": 2, "omp_num_threads": None, "cpu_count": 2,
                                        "python": "3.11.0", "versions": {"torch": "2.13.0", "transformers": "5.23.0"}})
    write(models / "base_3" / "eval_metrics.json", {"validation": {"loss": 4.6, "rouge1": 0.25, "rouge2": 0.125, "rougeL": 0.2}})
    write(models / "sft_3" / "eval_metrics.json", {"validation": {"loss": 0.7, "rouge1": 0.4125, "rouge2": 0.2, "rougeL": 0.375}})
    write_csv(models / "sft_3" / "eval_validation.csv", [
        dict(query=POST, response="landlord cancelled lease, tacos", reference="my landlord cancelled my lease")])
    write(models / "reward_3" / "eval_metrics.json", {
        "eval/rm/validation/accuracy": 0.6875, "eval/rm/validation/accuracy/split/valid1": 0.1,
        "eval/rm/validation/gold_accuracy": 0.71875, "eval/rm/validation_cnndm/accuracy": 0.640625})
    pair = lambda batch, confidence, chosen, rejected, texts: dict(  # noqa: E731
        batch=batch, confidence=confidence, chosen=texts[0], rejected=texts[1], chosen_reward=chosen,
        rejected_reward=rejected, accuracy=float(chosen > rejected))
    eos = "<|endoftext|>"  # summaries of 2 vs 3, 4 vs 2 and 2 vs 2 words
    write_csv(models / "reward_3" / "eval_validation.csv", [
        pair("batch11", "1.0", 0.2, 0.4, ("a b" + eos, "a b c" + eos)), pair("batch11", "9.0", 1.7, 0.1, ("a b c d", "a b")),
        pair("batch12", "9.0", 0.3, 0.0, ("a b", "c d"))])
    if with_dpo:
        write(models / "dpo_3" / "eval_metrics.json", {"eval/dpo/validation/accuracy": 0.65625,
                                                       "eval/dpo/validation_cnndm/accuracy": 0.59375})
    write(models / "ppo_3" / "eval_metrics.json", {"validation": {"score": 0.3125, "reference_score": -0.0625,
                                                                  "eos_fraction": 0.96875, "response_length": 19.0}})
    write(models / "ppo_3" / "args.json", {"run_name": "tiny_ppo_3", "batch_size": 64})
    for episode, response, score in ((320, "my landlord cancelled my lease", "0.5"), (640, "landlord tacos tacos", "1.25")):
        write_csv(runs / "tiny_ppo_3" / f"samples_validation_{episode}.csv", [
            dict(query=POST, response=response, reference="my landlord cancelled my lease", score=score, reference_score="0.0")])
    runs_json = {"base__seed3": judge_run("base", 0, 256, 0.0, 0.0148), "sft__seed3": judge_run("sft", 32, 256, 0.09, 0.17),
                 "ppo__seed3": judge_run("ppo", 64, 256, 0.2, 0.31),
                 "ppo__seed3_vs_sft__seed3": judge_run("ppo", 200, 256, 0.7, 0.8, vs="sft__seed3")}
    judged = lambda wins, losses: [dict(preferred="ours", ours_words=10, other_words=10)] * wins + [  # noqa: E731
        dict(preferred="reference", ours_words=20, other_words=10)] * losses
    write_csv(models / "judge_3" / "judged" / "sft__seed3.csv", judged(3, 2))
    write_csv(models / "judge_3" / "judged" / "ppo__seed3.csv", judged(4, 1))
    if with_dpo:
        runs_json["dpo__seed3"] = judge_run("dpo", 48, 256, 0.14, 0.24)
        runs_json["dpo__seed3_vs_sft__seed3"] = judge_run("dpo", 96, 256, 0.32, 0.43, vs="sft__seed3")
    write(models / "judge_3" / "results.json", {"model": "tiny_world.gold_score", "runs": runs_json})
    write(models / "timings.tsv", "stage\tseconds\ntiny world\t1800\npreprocess\t29\nsft: base model\t0\nsft\t97\n"
          "reward\t110\ndpo\t0\nppo\t64\njudge (gold)\t0\n")


def test_environment_line_names_the_cpu_when_recorded():
    # The CPU changes the numbers as the thread count does (torch's kernels follow its vector instructions):
    # a run that recorded it says so; an older environment.json without it reads as before.
    env = {"torch_threads": 2, "omp_num_threads": None, "cpu_count": 2, "versions": {"torch": "2.13.0"}}
    assert tiny_report.environment_line(env).startswith(
        "Environment: **2 torch threads** (OMP_NUM_THREADS=unset), 2 CPU cores, torch 2.13.0. ")
    line = tiny_report.environment_line({**env, "cpu": "AMD EPYC (family 25, model 17)", "cpu_capability": "AVX512"})
    assert "2 CPU cores (AMD EPYC (family 25, model 17); torch kernels for AVX512), torch 2.13.0. " in line
    assert "The thread count and the CPU change the numbers" in line
    # 4 threads on 2 cores: each number in its place
    assert tiny_report.environment_line({**env, "torch_threads": 4}).startswith(
        "Environment: **4 torch threads** (OMP_NUM_THREADS=unset), 2 CPU cores, ")


def test_tiny_sh_records_the_cpu_it_ran_on(tmp_path):
    # tiny.sh's own environment snippet, run as it is: the keys the report reads are there.
    script = (REPO / "benchmark" / "tiny.sh").read_text()
    snippet = script[script.index('python -c "\nimport json'):script.index('> "$MODELS/environment.json"')]
    # one thread for torch's kernels: that is the count recorded (not the inter-op pool, which follows the cores)
    result = run_python(["bash", "-c", snippet.replace("python", sys.executable, 1)], timeout=300,
                        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    env = json.loads(result.stdout)
    assert env["cpu"] and env["cpu_capability"] in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "SVE256", "NEON")
    assert env["torch_threads"] == 1 and env["omp_num_threads"] == "1" and "torch" in env["versions"]
    # the versions that change tokens or numbers are part of tiny.sh's job key too (a resume must be bit for bit)
    assert {"tokenizers", "numpy", "transformers", "datasets", "accelerate"} <= set(env["versions"])


def test_report_has_every_finding_and_the_figure(tmp_path):
    models, world, runs = tmp_path / "models", tmp_path / "world", tmp_path / "runs"
    make_run(models, runs, with_dpo=True)
    write(world / "world.json", {"noise_ceiling": {"validation": 0.8355, "validation_cnndm": 0.8427}})
    result = run_python([sys.executable, str(REPO / "benchmark" / "tiny_report.py"), "--models", str(models),
                         "--seed", "3", "--world", str(world), "--runs_dir", str(runs), "--no_tokens"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = (models / "report.md").read_text()
    assert report in result.stdout
    for row in ("**2 torch threads** (OMP_NUM_THREADS=unset), 2 CPU cores, torch 2.13.0, transformers 5.23.0",
                "| SFT | 0.125 | [0.090, 0.170] | 32 / 256 | 0 | 15.0 (14.0) |",
                "| PPO | 0.250 | [0.200, 0.310] | 64 / 256 | 0 | 15.0 (14.0) |",
                "| DPO | 0.188 | [0.140, 0.240] | 48 / 256 | 0 | 15.0 (14.0) |",
                "| PPO | 0.781 | [0.700, 0.800] | 200 / 256 | 0 | 15.0 (14.0) |",
                # Figure 8: 3 of 5 SFT wins at log ratio 0, its 2 losses at log 2; PPO 4 and 1
                # what the summaries get wrong: SFT keeps the 3 key words and copies 1 filler word (4 words); the
                # reference keeps them in 5 words
                "| SFT | 1.000 | 0.00 | 0.00 | 1.00 | 0.00 | 0.00 | 4.0 |",
                "| the references | 1.000 | 0.00 | 0.00 | 0.00 | 0.00 | 0.00 | 5.0 |",
                "| [-0.15, +0.15) | 1.000 (3) | 1.000 (4) |", "| [+0.45, +0.75) | 0.000 (2) | 0.000 (1) |",
                # over-optimisation: update 0 = SFT's samples (all 3 key words, 1 filler: 3 - 0.4), then PPO's:
                # a tie with the reference (3.0), then 1 of 3 key words, 2 fillers, 1 repeat: 1 - 0.8 - 0.3
                "| 0 | n/a (n/a) | 2.600 (3.000) | 0.000 |", "| 5 | 0.500 (0.000) | 3.000 (3.000) | 0.500 |",
                "| 10 | 1.250 (0.000) | -0.100 (3.000) | 0.000 |",
                "| RM | TL;DR validation | 0.688 | 0.836 | 0.719 |", "| RM | CNN/DM | 0.641 | 0.843 | n/a |",
                "| DPO (implicit reward) | TL;DR validation | 0.656 | 0.836 | n/a |",
                "| batch11 | 0.500 (2) |", "| batch12 | 1.000 (1) |", "| 1 | 0.000 (1) |", "| 9 | 1.000 (2) |",
                "| [0.0, 0.5) | 2 | 0.500 | 0.562 |", "| [1.5, 2.0) | 1 | 1.000 | 0.852 |",
                "| TL;DR validation | 0.688 | 0.656 |", "| CNN/DM | 0.641 | 0.594 |",
                # length: 2 pairs differ; the labels chose the shorter in 1, the RM prefers the longer in both
                "| RM | 2 | 0.500 | 0.000 | 0.000 (1) | 1.000 (1) |",
                "| base model (no training) | ROUGE-1 / 2 / L | 0.250 / 0.125 / 0.200 |",
                "| PPO | RM score: its samples / the references | 0.312 / -0.062 |",
                "| reward | 110 s |", "| tiny world | 1800 s |", "| **total** | **35 min 0 s** |"):
        assert row in report, row
    # the findings at a glance, each against its bar (make_run's numbers; Fig. 8 has too few comparisons)
    for row in ("| Fig. 1: SFT loses to the references | SFT's win rate in [0.10, 0.45] | 0.125 [0.090, 0.170] | yes |",
                "| Fig. 1: PPO is at least even with the references | PPO's win rate >= 0.50 | 0.250 [0.200, 0.310] | **no** |",
                "| Fig. 1: RLHF (PPO) beats SFT | PPO >= SFT + 0.20 | PPO - SFT = +0.125 | **no** |",
                "| PPO's CI above SFT's | PPO's lower bound 0.200, SFT's upper bound 0.170 | yes |",
                "| Fig. 1: DPO beats SFT | DPO's win rate > SFT's | DPO 0.188 [0.140, 0.240] | yes |",
                "| PPO against SFT, head to head (the gold judge) | shown, no bar | 0.781 [0.700, 0.800] | n/a |",
                "| DPO against SFT, head to head (the gold judge) | shown, no bar | 0.375 [0.320, 0.430] | n/a |",
                "| Fig. 4: the RM learns the labels | accuracy >= 0.70 | 0.688 | **no** |",
                "| Fig. 4: the RM transfers to news (CNN/DM) | accuracy >= 0.60 | 0.641 | yes |",
                "| shown, no bar | RM 0.000, labels 0.500; right 1.000 of the time where the chosen is the longer | n/a |",
                "| its accuracy < the RM's (TL;DR validation) | DPO 0.656, RM 0.688 | yes |",
                "| PPO above SFT in every length bucket with >= 30 of each | no bucket has 30 of each | n/a |",
                "| shown, no bar | gold peaks at update 5 (3.000); at the last, update 10: gold -0.100, RM score 1.250 | n/a |",
                "| Time: the main job on 2 CPU cores | <= 12 min of stages (a world's build apart) | 5 min 0 s | yes |"):
        assert row in report, row
    assert report.index("## The paper's findings here") < report.index("## Figure 1")
    saved = json.loads((models / "findings.json").read_text())
    assert saved["environment"]["torch_threads"] == 2  # for compare_worlds.py's row of where each run ran
    assert saved["seed"] == 3 and [row["holds"] for row in saved["findings"]] == [
        True, False, False, True, True, None, None, False, True, None, True, None, None, True]
    reference_table = report.split("## Figure 1")[1].split("Head to head")[0]
    assert "not run" not in report.replace("not computed", "") and "0.800" not in reference_table
    assert report.index("Head to head against SFT") < report.index("| PPO | 0.781 |")  # its own table
    for png in ("report.png",):
        data = (models / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_compare_worlds_puts_the_findings_side_by_side(tmp_path):
    """benchmark/compare_worlds.py: each run's findings.json in a column, the worlds where a finding holds counted;
    a folder without findings.json stops it with the command that writes one."""
    environments = {1: {"torch_threads": 2, "cpu": "AMD EPYC (family 25, model 17)", "cpu_capability": "AVX512"},
                    2: None}  # seed 2: a report from before the environment was recorded
    for seed, holds in ((1, [True, False]), (2, [True, True])):
        rows = [{"finding": "Fig. 1: SFT loses", "bar": "in [0.10, 0.45]", "measured": f"0.3{seed}", "holds": holds[0]},
                {"finding": "Fig. 6: DPO weaker", "bar": "below the RM", "measured": f"DPO 0.7{seed}", "holds": holds[1]}]
        write(tmp_path / f"m{seed}" / "findings.json",
              {"seed": seed, "world": "w", "environment": environments[seed], "findings": rows})
    out = tmp_path / "worlds.md"
    command = [sys.executable, str(REPO / "benchmark" / "compare_worlds.py"), str(tmp_path / "m1"), str(tmp_path / "m2")]
    result = run_python(command + ["--out", str(out)], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    table = out.read_text()
    assert f"| finding | bar | seed 1 ({tmp_path / 'm1'}) | seed 2 ({tmp_path / 'm2'}) | holds in |" in table
    assert "| Fig. 1: SFT loses | in [0.10, 0.45] | yes: 0.31 | yes: 0.32 | 2 of 2 |" in table
    assert "| Fig. 6: DPO weaker | below the RM | **no**: DPO 0.71 | yes: DPO 0.72 | 1 of 2 |" in table
    assert ("| where it ran (threads; CPU) | shown, no bar | 2 threads; AMD EPYC (family 25, model 17), AVX512 "
            "| not recorded | n/a |") in table
    # A world named twice (its folder again, or a table holding it) is one world: its bars count once, the later wins.
    twice = run_python(command + [str(tmp_path / "m1"), "--out", str(out)], timeout=120)
    assert twice.returncode == 0 and f"seed 1: seed 1 ({tmp_path / 'm1'}) replaces" in twice.stderr, twice.stderr
    assert "| Fig. 1: SFT loses | in [0.10, 0.45] | yes: 0.31 | yes: 0.32 | 2 of 2 |" in out.read_text()
    missing = run_python(command + [str(tmp_path / "m3")], timeout=120)
    assert missing.returncode == 1 and "m3/findings.json: not found" in missing.stderr
    assert "python benchmark/tiny_report.py --models" in missing.stderr


def test_compare_worlds_draws_the_numbers_of_the_findings_and_reads_its_own_tables_back(tmp_path):
    """compare_worlds.py --plot: the points are the findings' own numbers (tiny_report's findings of make_run, one run
    without DPO); a markdown file it wrote, read back, gives the same table, each seed's last column (a later run of a
    seed replaces an earlier one in a notebook); a file without its table is refused, named."""
    import compare_worlds

    cards = []
    for seed, with_dpo in ((3, True), (4, False)):
        models = tmp_path / f"m{seed}"
        make_run(models, tmp_path / f"runs{seed}", with_dpo=with_dpo)
        art = tiny_report.load_artifacts(str(models), 3, world=None, runs_dir=str(tmp_path / f"runs{seed}"))
        card = {"seed": seed, "world": "w", "environment": None, "findings": tiny_report.findings(art)}
        write(models / "findings.json", card)
        cards.append((f"seed {seed}", card))
    points = compare_worlds.world_points(cards)
    assert points["seeds"] == [3, 4]
    assert points["sft"] == [(0.125, 0.09, 0.17)] * 2 and points["ppo"] == [(0.25, 0.2, 0.31)] * 2
    assert points["dpo"] == [(0.188, 0.14, 0.24), None]  # 48 / 256 = 0.1875, as the report prints it; seed 4: no DPO
    assert points["gain"] == [0.125, 0.125] and points["gain_holds"] == [False, False]
    assert points["bars"] == {"sft": (0.10, 0.45), "ppo": 0.50, "gain": 0.20}
    # a world where PPO is even with the references but misses SFT + 0.20: the gain's own verdict is drawn
    row = lambda finding, bar, measured, holds: dict(finding=finding, bar=bar, measured=measured, holds=holds)  # noqa: E731
    hand = {"seed": 9, "findings": [
        row(compare_worlds.SFT, "SFT's win rate in [0.10, 0.45]", "0.400 [0.340, 0.460]", True),
        row(compare_worlds.PPO, "PPO's win rate >= 0.50", "0.550 [0.490, 0.610]", True),
        row(compare_worlds.GAIN, "PPO >= SFT + 0.20", "PPO - SFT = +0.150", False)]}
    hand_points = compare_worlds.world_points([("seed 9", hand)])
    assert hand_points["ppo"] == [(0.55, 0.49, 0.61)] and hand_points["dpo"] == [None]
    assert hand_points["gain"] == [0.15] and hand_points["gain_holds"] == [False]
    # the picture: each CI drawn from its low to its high end; the title counts the worlds at the gain's bar
    import matplotlib.pyplot as plt

    held = {**hand, "seed": 10, "findings": hand["findings"][:2] + [
        row(compare_worlds.GAIN, "PPO >= SFT + 0.20", "PPO - SFT = +0.250", True)]}
    closed = plt.close
    plt.close = lambda figure=None: None  # keep the figure to read it back
    try:
        compare_worlds.plot_worlds(cards + [("seed 9", hand), ("seed 10", held)], str(tmp_path / "p.png"))
        figure = plt.gcf()
    finally:
        plt.close = closed
    top, bottom = figure.axes
    assert bottom.get_title() == "PPO - SFT: at the bar on 1 of 4 worlds (filled)"
    sft_bars = top.containers[0].lines[2][0].get_segments()  # SFT's error bars, one segment per world
    assert [tuple(segment[:, 1]) for segment in sft_bars[:2]] == [pytest.approx((0.09, 0.17))] * 2
    plt.close(figure)

    script = [sys.executable, str(REPO / "benchmark" / "compare_worlds.py")]
    first = run_python(script + [str(tmp_path / "m3"), str(tmp_path / "m4"), "--out", str(tmp_path / "a.md")],
                       timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    written = (tmp_path / "a.md").read_text()
    again = run_python(script + [str(tmp_path / "a.md"), "--out", str(tmp_path / "b.md")], timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "b.md").read_text() == written  # read back: the same table, to the character
    # A notebook: the table, then a later run of seed 3 with another SFT; its column replaces the first
    later = written.replace("0.125 [0.090, 0.170]", "0.150 [0.100, 0.200]")
    assert later != written
    (tmp_path / "notebook.md").write_text(f"# Notes\n\n{written}\nSeed 3 again:\n\n{later}\nThe end.\n")
    drawn = run_python(script + [str(tmp_path / "notebook.md"), "--out", str(tmp_path / "c.md"), "--plot",
                                 str(tmp_path / "worlds.png")], timeout=120)
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    assert (tmp_path / "c.md").read_text() == later
    picture = (tmp_path / "worlds.png").read_bytes()
    assert picture.startswith(b"\x89PNG") and len(picture) > 10_000
    (tmp_path / "prose.md").write_text("# Only prose\n\n| a | b |\n|---|---|\n")
    refused = run_python(script + [str(tmp_path / "prose.md")], timeout=120)
    assert refused.returncode == 1 and f"{tmp_path / 'prose.md'}: no table of compare_worlds.py in it" in refused.stderr
    absent = run_python(script + [str(tmp_path / "absent.md")], timeout=120)
    assert absent.returncode == 1 and f"{tmp_path / 'absent.md'}: not found" in absent.stderr


def test_a_stage_that_did_not_run_reads_not_run(tmp_path):
    models = tmp_path / "models"
    make_run(models, tmp_path / "runs", with_dpo=False)
    (models / "ppo_3" / "eval_metrics.json").unlink()
    art = tiny_report.load_artifacts(str(models), 3, world=None, runs_dir=str(tmp_path / "runs"))
    assert art["dpo"] is None and art["ppo"] is None and set(art["judge"]) == {"base", "sft", "ppo"}
    report = tiny_report.render_markdown(art)
    assert "| DPO (implicit reward) | | not run | | |" in report
    assert "| PPO | RM score of its samples | not run |" in report
    assert "| DPO | not run | | | | |" in report
    assert "## Figure 6: DPO's implicit reward as a reward model (Detail 19)\n\nnot run" in report
    tiny_report.plot_report(art, str(tmp_path / "report.png"))
    assert (tmp_path / "report.png").stat().st_size > 10_000
    # a judged run with nothing decided (judge.py: win_rate null) reads as not run, not as a crash
    results = json.loads((models / "judge_3" / "results.json").read_text())
    results["runs"]["sft__seed3"].update(n=0, wins=0, win_rate=None, ci_low=None, ci_high=None)
    (models / "judge_3" / "results.json").write_text(json.dumps(results))
    undecided = tiny_report.render_markdown(tiny_report.load_artifacts(str(models), 3, world=None,
                                                                      runs_dir=str(tmp_path / "runs")))
    assert "| Fig. 1: SFT loses to the references | SFT's win rate in [0.10, 0.45] | not run | n/a |" in undecided
    # nothing at all: every finding reads "not run" or "not computed", and the figure is still drawn
    empty = tiny_report.load_artifacts(str(tmp_path / "nothing"), 1, world=None, runs_dir=str(tmp_path / "none"))
    markdown = tiny_report.render_markdown(empty)
    glance, sections = markdown.split("## Figure 1")
    # the findings at a glance: every row but the time's (no timings.tsv) reads "not run", none holds or fails
    assert glance.count("not run | n/a |") == 12 and "| no timings.tsv | n/a |" in glance and "yes" not in glance
    # win rates, what they get wrong, Fig. 8, curve, 4, 5, 6, other results
    assert sections.count("not run") == 4 + 1 + 1 + 1 + 1 + 1 + 1 + 3
    assert "Environment: not recorded" in markdown and "not computed" in markdown
    tiny_report.plot_report(empty, str(tmp_path / "empty.png"))


def test_a_file_cut_short_is_named_with_the_way_to_write_it_again(tmp_path):
    models = tmp_path / "models"
    make_run(models, tmp_path / "runs", with_dpo=True)
    (models / "environment.json").write_text("")  # e.g. the disk filled while tiny.sh wrote it
    with pytest.raises(SystemExit) as stopped:
        tiny_report.load_artifacts(str(models), 3, world=None, runs_dir=str(tmp_path / "runs"))
    assert str(stopped.value).startswith(f"{models / 'environment.json'}: not valid JSON (Expecting value")
    assert "bash benchmark/tiny.sh" in str(stopped.value)
    (models / "environment.json").unlink()  # not recorded at all is no error: the report says so
    assert tiny_report.load_artifacts(str(models), 3, world=None, runs_dir=str(tmp_path / "runs"))["environment"] is None


def test_token_view_probabilities_are_the_models(tmp_path):
    """compute_token_view on two tiny random models: each token's probability is the softmax of that
    model's logits at the position before it, over the tokens it can sample (a naive loop recomputes them)."""
    import torch
    from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(REPO / "assets" / "tiny_world" / "pythia-tiny")
    models = tmp_path / "models"
    config = GPTNeoXConfig(vocab_size=len(tokenizer) + 64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, eos_token_id=tokenizer.eos_token_id)
    for name, seed in (("sft_1", 0), ("ppo_1", 1)):
        torch.manual_seed(seed)
        GPTNeoXForCausalLM(config).save_pretrained(models / name)
        tokenizer.save_pretrained(models / name)
    rows = [dict(query=POST.replace("tifu", f"tifu{i}"), response=r, reference="my landlord cancelled my lease")
            for i, r in enumerate(("a", "b c", "d", "e f", "g"))]
    write_csv(models / "ppo_1" / "eval_validation.csv", rows)
    write_csv(models / "sft_1" / "eval_validation.csv", [dict(r, response="b c" if i == 1 else "x") for i, r in enumerate(rows)])
    view = tiny_report.compute_token_view(str(models), 1, n_posts=3)
    assert [post["ppo"] for post in view] == ["a", "d", "e f"]  # "b c" is SFT's summary too: skipped
    query = tokenizer(rows[3]["query"]).input_ids
    for post, name_before, name_after in [(view[2], "sft_1", "ppo_1")]:
        summary = tokenizer(" e f").input_ids + [tokenizer.eos_token_id]
        assert [t["token"] for t in post["tokens"]] == [tokenizer.decode([t]) for t in summary]
        for model_name, key in ((name_before, "p_before"), (name_after, "p_after")):
            model = GPTNeoXForCausalLM.from_pretrained(models / model_name).eval()
            for i, token in enumerate(summary):
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([query + summary[:i]])).logits[0, -1]
                allowed = [t for t in range(len(tokenizer)) if t != tokenizer.pad_token_id]
                probability = torch.softmax(logits[allowed], -1)[allowed.index(token)].item()
                assert post["tokens"][i][key] == pytest.approx(probability, rel=1e-4), (model_name, i)
    tiny_report.plot_tokens(view, str(tmp_path / "tokens.png"))
    assert (tmp_path / "tokens.png").stat().st_size > 10_000


def test_timings_reader_skips_the_header_and_keeps_names_with_spaces(tmp_path):
    write(tmp_path / "t.tsv", "stage\tseconds\nsft: base model\t14\njudge (gold)\t3\n")
    assert tiny_report.read_timings(str(tmp_path / "t.tsv")) == [("sft: base model", 14.0), ("judge (gold)", 3.0)]
    assert tiny_report.read_timings(str(tmp_path / "missing.tsv")) == []
