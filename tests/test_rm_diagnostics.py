"""benchmark/rm_diagnostics.py: its counting helpers by hand, its probe summaries, and a smoke run on the tiny world."""

import random
import re
import shutil
import sys
from types import SimpleNamespace

from conftest import REPO, WORLD, run_python

sys.path.insert(0, str(REPO / "benchmark"))
import rm_diagnostics as diag  # noqa: E402
import tiny_world  # noqa: E402


def test_pairwise_agreement_by_hand():
    # pairs (0,1): rm 0 > 1, gold 0 > 1 agree; (0,2): rm 0 < 2, gold 0 > 2 disagree; (1,2): gold tie, not counted
    assert diag.pairwise_agreement([2.0, 1.0, 3.0], [1.0, 0.0, 0.0]) == (1, 2)
    assert diag.pairwise_agreement([1.0, 1.0], [0.0, 1.0]) == (0, 0)  # an RM tie is not counted either
    assert diag.pairwise_agreement([0.0, 1.0, 2.0], [0.0, 1.0, 2.0]) == (3, 3)


def test_gold_terms_sum_to_the_gold_score():
    post = "So last week my landlord cancelled my lease.\n\nThen my sister borrowed my car.\n\nIt was rainy."
    for text in ("landlord cancelled lease", "landlord cancelled car; car car car; i feel hurt", "",
                 "sister borrowed car and it was rainy and " + "honestly i do not even know anymore " * 3):
        breakdown = tiny_world.gold_breakdown(post, text)
        terms = diag.gold_terms(breakdown, tiny_world)
        assert abs(sum(terms.values()) - breakdown["score"]) < 1e-9, text
    # an empty summary: no coverage, the empty term alone
    assert diag.gold_terms(tiny_world.gold_breakdown(post, ""), tiny_world) == {
        "coverage": 0.0, "invented": -0.0, "irrelevant": -0.0, "repetition": -0.0, "rambling": -0.0, "empty": -2.0}


def test_agreement_by_term_by_hand():
    terms = [{"coverage": 3.0, "invented": 0.0}, {"coverage": 1.5, "invented": -0.8},
             {"coverage": 3.0, "invented": -0.8}, {"coverage": 3.0, "invented": 0.0}]
    gold = [sum(t.values()) for t in terms]  # 3.0, 0.7, 2.2, 3.0
    rm = [1.0, 0.0, 2.0, 0.5]
    # (0,1): coverage differs by 1.5, invented by 0.8 -> coverage; rm 1 > 0, gold 3.0 > 0.7: agree
    # (0,2): invented decides; rm 1 < 2, gold 3.0 > 2.2: disagree
    # (0,3): gold tie, not counted; (1,2): coverage decides (1.5 vs 0): rm 0 < 2, gold 0.7 < 2.2: agree
    # (1,3): coverage decides; rm 0 < 0.5, gold 0.7 < 3.0: agree; (2,3): invented decides; rm 2 > 0.5, gold 2.2 < 3: no
    assert diag.agreement_by_term(rm, gold, terms) == {"coverage": (3, 3), "invented": (0, 2)}
    # the same pairs as pairwise_agreement, split by term
    assert sum(a for a, _ in diag.agreement_by_term(rm, gold, terms).values()) == diag.pairwise_agreement(rm, gold)[0]
    assert sum(t for _, t in diag.agreement_by_term(rm, gold, terms).values()) == diag.pairwise_agreement(rm, gold)[1]


def test_best_of_n_by_hand():
    rm, gold = [0.1, 0.9, 0.5, 2.0], [1.0, -1.0, 3.0, 0.5]
    assert diag.best_of_n(rm, gold, reference_score=0.5, n=1) == {"first": 1.0, "rm_best": 1.0, "gold_best": 1.0}
    # of the first 3: the RM picks sample 1 (gold -1 loses), the gold judge sample 2 (3 wins)
    assert diag.best_of_n(rm, gold, reference_score=0.5, n=3) == {"first": 1.0, "rm_best": 0.0, "gold_best": 1.0}
    # of 4: the RM picks sample 3, whose gold 0.5 ties the reference
    assert diag.best_of_n(rm, gold, reference_score=0.5, n=4)["rm_best"] == 0.5
    # the gold judge picks among the first n only: sample 3's gold 3 is past n = 2
    assert diag.best_of_n([0, 1, 0.5, 0.2], [-1, -1, -1, 3], reference_score=0.0, n=2)["gold_best"] == 0.0


def test_critic_start_td_by_hand():
    import torch

    values = torch.tensor([[-1.0, -2.0, -4.0, 9.0],  # EOS at 2: tokens 0 and 1 step -1 and -2; EOS 0.5 - (-4)
                           [0.5, 1.5, 7.0, 7.0]])  # EOS at 0: no earlier token; EOS -1 (the EOS trick's) - 0.5
    eos, tokens = diag.critic_start_td(values, torch.tensor([0.5, -1.0]), torch.tensor([2, 0]))
    assert eos == [4.5, -1.5]
    assert tokens == [-1.0, -2.0]
    # a row without EOS (index T - 1): every step up to the last one counts
    assert diag.critic_start_td(values[:1], torch.tensor([-1.0]), torch.tensor([3])) == ([-10.0], [-1.0, -2.0, 13.0])


def test_probe_summaries_change_one_thing_each():
    post = ("So last week my landlord cancelled my lease. It was rainy.\n\nThen my sister borrowed my car without "
            "even asking.\n\nEdit: to sum up, my landlord cancelled my lease and my sister borrowed my car.")
    made = diag.probe_summaries(post, random.Random(0), tiny_world)
    assert made["true"] == "landlord cancelled lease; sister borrowed car"  # each fact once, in order
    assert made["dropped"] == "landlord cancelled lease"
    assert made["added"].startswith(made["true"] + "; ")
    assert made["looped"] == made["true"] + "; sister borrowed car"
    true_score = tiny_world.gold_score(post, made["true"])
    for name in ("swapped", "dropped", "added", "looped"):  # each variant is worse by the gold judge
        assert tiny_world.gold_score(post, made[name]) < true_score, name
    swapped_words = set(made["swapped"].split()) - set(made["true"].split())
    assert len(swapped_words) == 1 and swapped_words <= set(tiny_world.ACTORS)
    assert diag.probe_summaries("My landlord cancelled my lease.", random.Random(0), tiny_world) is None


def test_feeling_probe_changes_only_the_feeling():
    facts = "So last week my landlord cancelled my lease.\n\nThen my sister borrowed my car without even asking."
    kind, true, other = diag.feeling_probe(facts + "\n\nI am so angry right now.", random.Random(0), tiny_world)
    assert kind == "wrong" and true == "landlord cancelled lease; sister borrowed car; i feel angry"
    assert other.rsplit(" ", 1)[0] == true.rsplit(" ", 1)[0] and other.split()[-1] in set(tiny_world.FEELINGS) - {"angry"}
    kind, true, other = diag.feeling_probe(facts, random.Random(0), tiny_world)  # the post states no feeling
    assert kind == "unstated" and true == "landlord cancelled lease; sister borrowed car"
    assert other.startswith(true + "; i feel ") and other.split()[-1] in tiny_world.FEELINGS
    for post in (facts + "\n\nI am so angry right now.", facts):  # the other is worse by the gold judge
        _, true, other = diag.feeling_probe(post, random.Random(1), tiny_world)
        assert tiny_world.gold_score(post, other) < tiny_world.gold_score(post, true)
    assert diag.feeling_probe("I am so angry right now.", random.Random(0), tiny_world) is None


def test_invented_by_kind_by_hand():
    post = "So last week my landlord cancelled my lease.\n\nI am so angry right now."
    # "sister" and "car" are not in the post (actor, object); "hurt" is a feeling it does not state
    made = diag.invented_by_kind(post, "landlord cancelled car; sister cancelled lease; i feel hurt", tiny_world)
    assert made == {"actor": 1, "verb": 0, "object": 1, "feeling": 1, "states_feeling": True, "feeling_right": False}
    assert sum(made[k] for k in ("actor", "verb", "object", "feeling")) == tiny_world.gold_breakdown(
        post, "landlord cancelled car; sister cancelled lease; i feel hurt")["invented"]
    assert diag.invented_by_kind(post, "landlord cancelled lease; i feel angry", tiny_world) == {
        "actor": 0, "verb": 0, "object": 0, "feeling": 0, "states_feeling": True, "feeling_right": True}
    assert diag.invented_by_kind(post, "landlord cancelled lease", tiny_world)["states_feeling"] is False


def test_smoke_run_writes_the_tables(tiny_tldr, tmp_path):
    """The untuned base model as the policy and a fresh RM from it: the script samples, scores and writes its tables."""
    import reward

    models = tmp_path / "models"
    shutil.copytree(WORLD / "pythia-tiny", models / "sft_1")
    reward.reward_model_from_sft(str(WORLD / "pythia-tiny")).save_pretrained(models / "reward_1")
    result = run_python([sys.executable, str(REPO / "benchmark" / "rm_diagnostics.py"), "--models", str(models),
                         "--data", str(tiny_tldr), "--num_prompts", "3", "--samples", "4", "--response_length", "44",
                         "--learnability_updates", "2"], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = (models / "rm_diagnostics.md").read_text()
    assert "On-policy agreement of the RM with the gold judge" in report
    total = int(re.search(r"over (\d+) pairs", report).group(1))
    by_term = report.split("| deciding term |")[1].split("\n\n")[0].splitlines()[2:]
    shares = [float(row.split(" | ")[1]) for row in by_term]
    # Pairs were counted (at most 3 posts x 6), each under one term. With 8 response tokens none was: no sample
    # ended, so every RM score was the EOS trick's -1 and the table stayed empty (44: tiny.sh's length).
    assert total > 0 and abs(sum(shares) - 1) < 0.01
    best_of_n = report.split("Probes:")[0]  # the best-of-n table: a row per n up to --samples
    assert [line.split(" |")[0] for line in best_of_n.splitlines() if line[:3] in ("| 1", "| 2", "| 4")] == [
        "| 1", "| 2", "| 4"]
    assert "3 validation posts, 4 samples each" in report
    assert "What the SFT policy's samples get wrong (12 samples)" in report
    start = report.split("PPO's critic at its start")[1].split("\n")[0]
    assert len(re.findall(r"\*\*-?\d+\.\d{3}\*\*", start)) == 2  # the EOS token's and the other tokens' mean TD error
    curve = report.split("| updates | swap accuracy |\n|---|---|\n")[1].splitlines()
    assert [row.split(" |")[0] for row in curve] == ["| 0", "| 2"]  # before training, and after the last update
    assert all(0.0 <= float(row.split("|")[2]) <= 1.0 for row in curve)



def test_reward_pair_rows_smoke_run_compares_every_layout(tiny_tldr, tmp_path):
    """benchmark/reward_pair_rows.py (the RM layouts' side-by-side speed) on the untuned base model: every layout,
    length groups included, with the last layer at the EOS columns only or at every column, gives the two-row rewards
    and gradients, then is timed; so is the scoring, whose fast path gives get_reward's rewards."""
    out = tmp_path / "reward_pair_rows.md"
    result = run_python([sys.executable, str(REPO / "benchmark" / "reward_pair_rows.py"), "--sft_model_path",
                         str(WORLD / "pythia-tiny"), "--label_dataset", str(tiny_tldr / "preference"), "--batch_size", "8",
                         "--rounds", "1", "--updates", "1", "--length_groups", "2", "3", "--query_dataset",
                         str(tiny_tldr / "sft"), "--scoring_rows", "16", "--out", str(out)], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    scoring = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| last layer at the EOS")]
    assert len(scoring) == 1 and float(scoring[0][3].rstrip(" |")) < 1e-4  # rewards_at_eos's scores are get_reward's
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| one row")]
    every = ", last layer at every column"
    assert [row[0] for row in rows] == ["| one row", "| one row" + every, "| one row, 2 length groups",
                                        "| one row, 2 length groups" + every, "| one row, 3 length groups",
                                        "| one row, 3 length groups" + every]
    for row in rows:  # max |reward difference| / max |gradient difference| against two rows
        assert all(float(value) < 1e-4 for value in row[5].rstrip(" |").split(" / ")), row
        assert row[4].endswith("x") == (every not in row[0]), row  # a fast layout against its plain form


def test_missing_inputs_are_named_with_their_flag(tmp_path):
    """A --data pointing at DATA/sft (or a missing model) stops at once, naming the flag and the folder it expected."""
    (tmp_path / "models" / "sft_1").mkdir(parents=True)
    (tmp_path / "data" / "sft").mkdir(parents=True)
    result = run_python([sys.executable, str(REPO / "benchmark" / "rm_diagnostics.py"), "--models",
                         str(tmp_path / "models"), "--data", str(tmp_path / "data" / "sft")], timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"--models {tmp_path / 'models'}: {tmp_path / 'models' / 'reward_1'} not found" in result.stderr
    assert f"--data {tmp_path / 'data' / 'sft'}: {tmp_path / 'data' / 'sft' / 'sft'} not found" in result.stderr
    assert "sft_1 not found" not in result.stderr
    assert "bash benchmark/tiny.sh" in result.stderr


def test_report_lines_by_hand():
    """The report's numbers from hand-made counts: agreement over all pairs, each deciding term's share and its own
    agreement (over its pairs, not all), the three best-of-n columns in their places, the feeling columns by whether
    the post states a feeling, the critic's TD means, each probe's share."""
    from types import SimpleNamespace

    mistake = lambda feels, states, right, actor: dict(post_feels=feels, states_feeling=states,  # noqa: E731
                                                       feeling_right=right, actor=actor, verb=0, object=0, feeling=0)
    found = {"agree": 6, "total": 10, "by_term": {"coverage": (3, 4), "invented": (3, 6)},
             "picks": {1: [dict(first=1.0, rm_best=0.0, gold_best=0.5)], 16: [dict(first=0.2, rm_best=0.4, gold_best=0.8)]},
             "mistakes": [mistake(True, 1, 1, 2), mistake(True, 0, 0, 0), mistake(False, 1, 0, 1)],
             "eos_td": [1.0, 2.0], "token_td": [0.5, 0.0],
             "probes": {"swapped": [1, 0], "dropped": [1, 1], "added": [0], "looped": [1], "policy_swapped": [0],
                        "wrong": [1, 1, 0, 0], "unstated": [1]}}
    lines = diag.report_lines(found, SimpleNamespace(samples=16, temperature=0.7), 5, "sft", "rm")
    text = "\n".join(lines)
    assert "**0.600** over 10 pairs" in text
    assert "| invented | 0.600 | 0.500 |" in lines and "| coverage | 0.400 | 0.750 |" in lines  # most pairs first
    assert lines.index("| invented | 0.600 | 0.500 |") < lines.index("| coverage | 0.400 | 0.750 |")
    assert "| 1 | 1.000 | 0.000 | 0.500 |" in lines and "| 16 | 0.200 | 0.400 | 0.800 |" in lines
    assert "| 1.000 | 0.000 | 0.000 | 0.000 | 0.500 / 0.500 | 1.000 |" in lines  # actor mean 1, the feeling columns
    assert "**1.500**" in text and "**0.250**" in text
    assert "| the RM prefers it to the same facts with one actor the post never names | 0.500 |" in lines
    assert "| with the post's feeling, the RM prefers it to the same with another feeling | 0.500 |" in lines


def test_scores_and_first_values_against_one_unpadded_row_at_a_time():
    """The agreement and the critic's TD errors read the RM as PPO does: the score at the EOS (-1 for a response
    without one: the EOS trick) and the values before each response token. Against a naive loop: each row alone,
    without pads, through the RM; its last output is the score, its output before response token t is the value."""
    import torch
    from transformers import AutoTokenizer

    import reward

    tokenizer = AutoTokenizer.from_pretrained(WORLD / "pythia-tiny")
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(0)
    model = reward.reward_model_from_sft(str(WORLD / "pythia-tiny")).eval()
    torch.nn.init.normal_(model.head.weight, std=1.0)  # a head that reads the hidden state (its init is near zero)
    words = [tokenizer.encode(" " + text) for text in ("my landlord cancelled my lease", "i feel angry", "a b c")]
    longest = max(map(len, words)) + 2
    queries = torch.tensor([[pad] * (longest - len(ids)) + ids for ids in words])  # left-padded, as the queries are
    width = 6
    ends = [3, None, width - 1]  # the EOS index of each response: mid-way, none, the last token
    responses = torch.full((3, width), pad)
    for row, end in enumerate(ends):
        tokens = (words[2] * width)[:width if end is None else end] + ([eos] if end is not None else [])
        responses[row, :len(tokens)] = torch.tensor(tokens)
    with torch.no_grad():
        scores, values = diag.scores_and_first_values(model, queries, responses, pad, eos)
        for row, end in enumerate(ends):
            query = [t for t in queries[row].tolist() if t != pad]
            response = [t for t in responses[row].tolist() if t != pad]
            out = model(input_ids=torch.tensor([query + response]), attention_mask=torch.ones(1, len(query + response)))[0]
            expected = out[-1] if end is not None else torch.tensor(-1.0)
            assert torch.allclose(scores[row], expected, atol=1e-5), row
            last = len(response) - 1  # every value up to the last real token (the EOS) matches
            assert torch.allclose(values[row, :last + 1], out[len(query) - 1:len(query) + last], atol=1e-5), row
    assert abs(scores[0].item() + 1) > 1e-3 and abs(scores[2].item() + 1) > 1e-3  # a real score is not the penalty


def test_time_layouts_alternates_and_leaves_the_warm_up_out(monkeypatch):
    """reward_pair_rows.time_layouts (also dpo_pair_rows.py's and sft_length_groups.py's timer) with a fake clock that
    each update moves by 1 s: per round the layouts in turn, each a fresh model, one untimed warm-up update, then one
    timed update per later batch."""
    import torch

    import reward_pair_rows

    now, order = [0.0], []
    monkeypatch.setattr(reward_pair_rows, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def loss(model, batch, layout):
        now[0] += 1.0
        order.append(layout)
        return model(batch).sum()

    batches = [torch.ones(2, 3)] * 4  # the warm-up, then 3 timed updates
    seconds = reward_pair_rows.time_layouts(["a", "b"], 2, batches, lambda: torch.nn.Linear(3, 1), loss, 1e-3, "cpu")
    assert seconds == {"a": [3.0, 3.0], "b": [3.0, 3.0]}
    assert order == (["a"] * 4 + ["b"] * 4) * 2  # alternating: a, b, a, b


def test_reward_pair_rows_table_by_hand():
    """render_table on made-up rounds: pairs / s from each layout's median round (not the mean), each against two rows,
    one row, and its own last-layer-at-every-column form."""
    import reward_pair_rows

    every = reward_pair_rows.EVERY_COLUMN
    args = SimpleNamespace(updates=2, batch_size=8, rounds=3, length_groups=[], query_dataset=None,
                           sft_model_path=str(WORLD / "pythia-tiny"))
    # 16 pairs a round: medians 2 s, 1 s, 4 s (means 3, 2, 4): 8, 16 and 4 pairs / s
    seconds = {"two rows": [1.0, 2.0, 6.0], "one row": [1.0, 1.0, 4.0], "one row" + every: [4.0, 4.0, 4.0]}
    table = reward_pair_rows.render_table(args, "cpu", seconds, {"one row": (1e-7, 2e-7), "one row" + every: (0, 0)})
    assert "| two rows | 8.0 | 1.00x | 0.50x |  |  |" in table
    assert "| one row | 16.0 | 2.00x | 1.00x | 4.00x | 1.0e-07 / 2.0e-07 |" in table
    assert f"| one row{every} | 4.0 | 0.50x | 0.25x |  | 0.0e+00 / 0.0e+00 |" in table


def test_reward_pair_rows_every_column_layouts_run_the_plain_forward(tiny_tldr, monkeypatch):
    """A layout "..., last layer at every column" runs the backbone's plain forward (plain_hidden_states_at), its
    fast form reward.hidden_states_at: the two are timed over different work, as their column says."""
    import datasets
    import torch

    import reward_pair_rows

    plain = []
    real = reward_pair_rows.plain_hidden_states_at
    monkeypatch.setattr(reward_pair_rows, "plain_hidden_states_at", lambda *args: plain.append(1) or real(*args))
    pairs = datasets.load_from_disk(str(tiny_tldr / "preference"))["train"].with_format(
        "torch", columns=list(reward_pair_rows.reward.TRAIN_PAIR_COLUMNS + reward_pair_rows.reward.PAIR_COLUMNS))
    batch = pairs[[0, 1]]
    model = reward_pair_rows.fresh_rm(str(WORLD / "pythia-tiny"), "cpu")
    pad = 1  # the tiny world's [PAD]
    fast = reward_pair_rows.batch_rewards(model, batch, "one row, 2 length groups", pad, "cpu")
    assert plain == []
    slow = reward_pair_rows.batch_rewards(model, batch, "one row, 2 length groups" + reward_pair_rows.EVERY_COLUMN, pad,
                                          "cpu")
    assert plain and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(fast, slow))


def test_reward_pair_rows_scoring_table_times_each_scorer_in_place(tiny_tldr, monkeypatch):
    """time_scoring with score_dataset faked on a fake clock (3 s a call with the plain get_reward patched in as
    rewards_at_eos, 1 s with rewards_at_eos itself): each scorer is the one score_dataset calls while it is timed, and
    the table's speed-up is the plain median over the scorer's (3.00x), not its inverse."""
    import accelerate
    import torch

    import reward_pair_rows

    now, real = [0.0], reward_pair_rows.reward.rewards_at_eos

    def score_dataset(accelerator, model, references, layouts, pad, batch):
        now[0] += 1.0 if reward_pair_rows.reward.rewards_at_eos is real else 3.0
        return {name: torch.zeros(len(references)) for name in layouts}

    monkeypatch.setattr(reward_pair_rows, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(reward_pair_rows.reward, "score_dataset", score_dataset)
    monkeypatch.setattr(accelerate, "Accelerator", lambda: SimpleNamespace(device="cpu"))
    args = SimpleNamespace(sft_model_path=str(WORLD / "pythia-tiny"), query_dataset=str(tiny_tldr / "sft"),
                           scoring_rows=4, rounds=3)
    table = reward_pair_rows.time_scoring(args, 1)
    assert "| plain (get_reward) | 3.00 (3.00, 3.00, 3.00) | 1.00x |  |" in table
    assert "| last layer at the EOS (rewards_at_eos) | 1.00 (1.00, 1.00, 1.00) | 3.00x | 0.0e+00 |" in table
