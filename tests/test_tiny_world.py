"""The embedded tiny TL;DR world: schemas, determinism, the gold judge, and the committed copy.

The committed world (assets/tiny_world, the offline default of every stage) must be exactly what
`tiny_world.py` builds: the datasets and the tokenizer are rebuilt here and compared byte for
byte; the model's pretraining takes minutes, so its determinism is checked on a short build.
"""

import dataclasses
import json
import math
import random
import re
from pathlib import Path

import datasets
import pytest

import tiny_world as tw
from conftest import REPO, tiny_lengths

WORLD = REPO / "assets" / "tiny_world"
DATA_FILES = ["tldr_3_filtered/README.md", "tldr_3_filtered/data/train.parquet",
              "tldr_3_filtered/data/validation.parquet", "tldr_3_filtered/data/test.parquet",
              "summarize_from_feedback/README.md", "summarize_from_feedback/comparisons/train.parquet",
              "summarize_from_feedback/comparisons/validation.parquet",
              "pythia-tiny/tokenizer.json", "pythia-tiny/tokenizer_config.json"]
# Everything a world folder holds: no `datasets` cache, no lock files (they were once committed).
WORLD_FILES = sorted(DATA_FILES + ["pythia-tiny/config.json", "pythia-tiny/generation_config.json",
                                   "pythia-tiny/model.safetensors", "WORLD.md", "world.json"])


def load_world(path, cache):
    """The two datasets of a world folder, loaded as from the Hub with a `datasets` cache in `cache`.

    The cache never goes inside the world: assets/ holds only what tiny_world.py writes."""
    sft = datasets.load_dataset(str(path / "tldr_3_filtered"), cache_dir=str(cache))
    preference = datasets.load_dataset(str(path / "summarize_from_feedback"), "comparisons", cache_dir=str(cache))
    return sft, preference


def small_args(out_dir, seed=1):
    """A world small enough to build twice in a test."""
    return tw.Args(out_dir=str(out_dir), seed=seed, sft_sizes=(64, 8, 8), preference_sizes=(64, 16, 4),
                   pretrain_steps=3, pretrain_documents=32, recap_posts=4)


def tree_bytes(root):
    """{relative path: bytes} of every file under root."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return load_world(WORLD, tmp_path_factory.mktemp("datasets_cache"))


def test_same_seed_same_bytes(tmp_path):
    tw.build_world(small_args(tmp_path / "a"))
    tw.build_world(small_args(tmp_path / "b"))
    tw.build_world(small_args(tmp_path / "c", seed=2), with_model=False)
    load_world(tmp_path / "a", tmp_path / "cache")  # loading as the stages do writes nothing into the world
    a, b, c = tree_bytes(tmp_path / "a"), tree_bytes(tmp_path / "b"), tree_bytes(tmp_path / "c")
    assert sorted(a) == WORLD_FILES
    assert "pythia-tiny/model.safetensors" in a and "summarize_from_feedback/comparisons/train.parquet" in a
    assert a.keys() == b.keys()
    assert [name for name in a if a[name] != b[name]] == []
    assert a["tldr_3_filtered/data/train.parquet"] != c["tldr_3_filtered/data/train.parquet"]


def test_pretraining_dropout_is_its_own_and_the_saved_config_keeps_the_worlds(tmp_path):
    """--pretrain_dropout changes the pretraining (other weights) but not the saved config's dropout (Detail 7)."""
    tw.build_world(small_args(tmp_path / "with"))
    tw.build_world(dataclasses.replace(small_args(tmp_path / "without"), pretrain_dropout=0.0))
    with_, without = tree_bytes(tmp_path / "with"), tree_bytes(tmp_path / "without")
    assert with_["pythia-tiny/model.safetensors"] != without["pythia-tiny/model.safetensors"]
    for files in (with_, without):
        config = json.loads(files["pythia-tiny/config.json"])
        assert config["hidden_dropout"] == config["attention_dropout"] == 0.1
    assert "pretrained with dropout 0.0 (Pythia pretrains without)" in without["WORLD.md"].decode()


def test_committed_world_is_what_the_generator_builds(tmp_path):
    committed = sorted(p.relative_to(WORLD).as_posix() for p in WORLD.rglob("*") if p.is_file())
    assert committed == WORLD_FILES, "assets/tiny_world holds files tiny_world.py does not write (a cache?)"
    tw.build_world(tw.Args(out_dir=str(tmp_path)), with_model=False)
    for name in DATA_FILES:
        assert (tmp_path / name).read_bytes() == (WORLD / name).read_bytes(), (
            f"{name} differs from a fresh build: run `python tiny_world.py --out_dir assets/tiny_world`")
    meta = json.loads((WORLD / "world.json").read_text())
    defaults = {k: v for k, v in json.loads(json.dumps(vars(tw.Args(out_dir="")))).items() if k != "out_dir"}
    assert meta["args"] == defaults, "the committed world was built with other args than the defaults"
    # The statistics the card and the report quote (noise ceilings, the reference writer's habits, counts,
    # lengths) are what the generator computes from these data: a rebuilt world states the same.
    sft, preference, _, noise = tw.build_datasets(tw.Args(out_dir=str(tmp_path / "again")))
    assert noise == meta["noise_ceiling"]
    assert tw.reference_statistics(sft["train"]) == meta["references"]
    assert tw.preference_length_statistics(preference["train"]) == meta["preference_lengths"]


def test_the_card_describes_the_committed_world_and_its_reference_writer():
    """WORLD.md is the card of world.json, and it says what the human-like writer gets wrong and how often."""
    meta = json.loads((WORLD / "world.json").read_text())
    card = (WORLD / "WORLD.md").read_text()
    assert card == tw.world_card(meta)
    writer = tw.POLICIES["ref"]
    for field in ("misremember", "invent", "filler", "ramble", "repeat"):  # its mistakes, with their rates
        assert f"| {tw.WRITER_HABITS[field]} | {getattr(writer, field):.2f} |" in card
        assert getattr(writer, field) > 0  # a human writer, not an oracle
    # the references it wrote leave room above them (RLHF beats human TL;DRs in the paper)
    assert 0.5 < meta["references"]["gold_score"] < 2.5
    assert meta["references"]["with_wrong_or_invented"] > 0.05
    # the card states how the preferred summary's length differs from the real data's (Detail 4)
    assert "median 32 against 30 tokens" in card
    assert f"{meta['preference_lengths']['chosen_longer']:.0%} of the pairs whose lengths differ" in card


def test_preference_length_statistics_by_hand():
    """Medians of the chosen and rejected word counts, and the chosen's share of the longer side where they differ."""
    def row(chosen, other, choice):
        texts = [chosen, other] if choice == 0 else [other, chosen]
        return {"summaries": [{"text": t} for t in texts], "choice": choice}
    rows = [row("a b c", "a", 0), row("a", "a b", 1), row("a b", "c d", 0), row("a b c d", "a b", 1)]
    # chosen words 3, 1, 2, 4 (upper median 3); rejected 1, 2, 2, 2 (upper median 2); 3 pairs differ, 2 with the chosen longer
    assert tw.preference_length_statistics(rows) == {"n": 4, "chosen_median_words": 3, "rejected_median_words": 2,
                                                     "chosen_longer": 2 / 3}


def test_schemas_match_the_hub_datasets(world):
    sft, preference = world
    assert set(sft) == {"train", "validation", "test"}
    assert sft["train"].column_names == ["id", "subreddit", "title", "post", "summary"]
    assert set(preference) == {"train", "validation"}
    assert preference["train"].column_names == ["info", "summaries", "choice", "worker", "batch", "split", "extra"]
    info = preference["train"].features["info"]
    assert sorted(info) == ["article", "id", "post", "site", "subreddit", "title"]
    row = preference["train"][0]
    assert len(row["summaries"]) == 2 and set(row["summaries"][0]) == {"text", "policy", "note"}
    assert all(s["text"].startswith(" ") for s in row["summaries"])  # preference texts carry the space
    assert not sft["train"][0]["summary"].startswith(" ")  # SFT summaries do not


def test_cnndm_rows_are_news_in_validation_only(world):
    _, preference = world
    news = [r for r in preference["validation"] if r["batch"] in tw.CNNDM_BATCHES]
    assert len(news) == tw.Args(out_dir="").preference_sizes[2]
    assert all(r["info"]["article"] and r["info"]["post"] is None for r in news)
    assert all(r["info"]["article"] is None for r in preference["train"])
    assert {r["batch"] for r in news} <= set(tw.CNNDM_BATCHES)


def test_validation_policies_are_out_of_distribution(world):
    _, preference = world
    pairs = {split: {tuple(sorted(s["policy"] for s in r["summaries"])) for r in preference[split]}
             for split in ("train", "validation")}
    assert len(pairs["validation"] - pairs["train"]) > len(pairs["train"]) / 2


def test_long_posts_overflow_the_tiny_query_budget(world):
    sft, _ = world
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(WORLD / "pythia-tiny")
    budget = int(re.search(r"--query_length (\d+)", (REPO / "benchmark" / "tiny.sh").read_text()).group(1))
    lengths = [len(tokenizer(f"SUBREDDIT: r/{r['subreddit']}\n\nTITLE: {r['title']}\n\nPOST: {r['post']}\n\nTL;DR:")
                   .input_ids) for r in sft["train"]]
    overflow = sum(n > budget for n in lengths) / len(lengths)
    assert 0.02 < overflow < 0.2, overflow  # a tail, so paragraph truncation (Detail 2) really fires


def test_tokenizer_and_model_load_like_pythia():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(WORLD / "pythia-tiny")
    model = AutoModelForCausalLM.from_pretrained(WORLD / "pythia-tiny")
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token == "[PAD]"
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert tokenizer(" hello<|endoftext|>").input_ids[-1] == tokenizer.eos_token_id
    rotary = model.config.rope_parameters  # transformers 5 keeps Pythia's rotary_pct here
    assert model.config.model_type == "gpt_neox" and rotary["partial_rotary_factor"] == 0.25
    assert model.config.vocab_size >= len(tokenizer)


def test_labels_follow_the_gold_judge_with_the_documented_noise(world):
    _, preference = world
    meta = json.loads((WORLD / "world.json").read_text())
    temperature = meta["args"]["label_temperature"]
    rows = [r for r in preference["train"]]
    probabilities, agree = [], 0
    for r in rows:
        post = f"{r['info']['title']}\n{r['info']['post']}"
        a, b = (s["text"] for s in r["summaries"])
        p = tw.preference_probability(post, a, b, temperature)
        probabilities.append(max(p, 1 - p))
        agree += (p > 0.5) == (r["choice"] == 0) if p != 0.5 else 0.5
    ceiling = sum(probabilities) / len(rows)
    assert ceiling == pytest.approx(meta["noise_ceiling"]["train"], abs=1e-9)
    # The labels agree with the gold ordering as often as the ceiling says (4 standard errors).
    assert abs(agree / len(rows) - ceiling) < 4 * math.sqrt(ceiling * (1 - ceiling) / len(rows))
    assert 0.75 < ceiling < 0.95


def test_gold_judge_prefers_the_reference_over_an_unrelated_summary(world):
    sft, _ = world
    rows = sft["validation"]
    wins = sum(tw.gold_score(f"{r['title']}\n{r['post']}", r["summary"])
               > tw.gold_score(f"{r['title']}\n{r['post']}", rows[(i + 1) % len(rows)]["summary"])
               for i, r in enumerate(rows))
    assert wins / len(rows) >= 0.95


def test_gold_judge_penalises_invented_facts_and_irrelevant_detail(world):
    sft, _ = world
    rng = random.Random(0)
    for r in sft["validation"]:
        post, summary = f"{r['title']}\n{r['post']}", r["summary"]
        post_words = set(tw.words(post))
        actor = rng.choice([a for a in tw.ACTORS if a not in post_words])
        thing = rng.choice([o for o in tw.OBJECTS if o not in post_words])
        invented = f"{summary}, my {actor} sold my {thing}"
        irrelevant = f"{summary}, I was eating {rng.choice(tw.FOODS)} on the {rng.choice(tw.FURNITURE)}"
        base = tw.gold_score(post, summary)
        assert tw.gold_score(post, invented) < base, invented
        assert tw.gold_score(post, irrelevant) < base, irrelevant


def test_gold_judge_accepts_any_text():
    post = "My landlord cancelled my lease.\n\nWhat should I do?"
    for summary in ["", " ", "<|endoftext|>[PAD][PAD]", "ünïcödé ✓ 日本語", "landlord " * 500, "\n\n\t"]:
        score = tw.gold_score(post, summary)
        assert math.isfinite(score)
    assert tw.gold_score(post, "") < tw.gold_score(post, "my landlord cancelled my lease")
    assert tw.gold_score("", "anything at all") <= 0


def test_gold_breakdown_by_hand():
    post = "My landlord cancelled my lease. It was rainy and I ate tacos. I feel angry."
    # post key words: landlord, cancelled, lease, angry (4) -> budget 6 + 2 * 4 = 14 words
    b = tw.gold_breakdown(post, "landlord cancelled lease, boss sold car, tacos tacos")
    assert b["coverage"] == 3 / 4
    assert b["invented"] == 3  # boss, sold, car
    assert b["irrelevant"] == 2 and b["repetition"] == 1 and b["rambling"] == 0
    w = tw.JUDGE_WEIGHTS
    assert b["score"] == pytest.approx(w["coverage"] * 0.75 - w["invented"] * 3 - w["irrelevant"] * 2
                                       - w["repetition"] * 1)


def test_equal_gold_scores_are_a_tie_whatever_the_float_rounding_of_their_sums():
    """3 x 4/5 - 0.3 x 2 and 3 x 3/5 are both 1.8, but their float sums differ in the last bit: gold_margin calls them
    equal, and judge.py's gold judge a tie, where the rounding decided before (for the summary of the first)."""
    post = "My landlord cancelled my lease and sold my bike."  # 5 key words
    four_twice = "my landlord cancelled my lease and sold it, my landlord, my lease"  # coverage 4/5, repetition 2
    three = "my landlord cancelled my lease"  # coverage 3/5
    breakdown = tw.gold_breakdown(post, four_twice)
    assert (breakdown["coverage"], breakdown["repetition"]) == (0.8, 2)
    assert tw.gold_score(post, four_twice) != tw.gold_score(post, three)  # 1.8000000000000003 against 1.7999999999999998
    assert tw.gold_margin(post, four_twice, three) == 0.0 == tw.gold_margin(post, three, four_twice)
    assert tw.gold_margin(post, four_twice, "my landlord") == pytest.approx(3 * 0.8 - 0.6 - 3 * 0.2)  # no tie
    import judge
    assert judge.parse_verdict(judge.gold_reply(post, four_twice, three), allow_tie=True) == "tie"
    assert judge.parse_verdict(judge.gold_reply(post, four_twice, "my landlord"), allow_tie=True) == "A"


def test_gold_judge_reads_words_as_words_whatever_their_case_and_an_empty_summary_costs_its_penalty():
    """The judge of model outputs (judge.py --judge gold, PPO's gold reward): an empty summary scores -empty (a
    policy that stops at once must not tie a summary that says something wrong); capitals do not hide a fact;
    "don't" and "24" are one word each (the rambling budget counts words)."""
    post = "My landlord cancelled my lease.\n\nWhat should I do?"  # 3 key words: budget 6 + 2 * 3 = 12 words
    for empty in ("", " ", "\n\t", ". , !"):
        assert tw.gold_breakdown(post, empty) == {"score": -tw.JUDGE_WEIGHTS["empty"], "coverage": 0.0, "invented": 0,
                                                  "irrelevant": 0, "repetition": 0, "rambling": 0, "n_words": 0}
    assert tw.gold_score(post, "My Landlord CANCELLED my Lease") == tw.gold_score(post, "my landlord cancelled my lease")
    assert tw.gold_score(post, "My Landlord CANCELLED my Lease") == pytest.approx(tw.JUDGE_WEIGHTS["coverage"])
    assert tw.words("I don't know, I'm 24") == ["i", "don't", "know", "i'm", "24"]
    b = tw.gold_breakdown(post, "my landlord cancelled my lease and i don't know what i'm 24 years old now")
    assert (b["n_words"], b["rambling"]) == (15, 3)


def test_preprocess_runs_on_the_committed_world_with_the_tiny_lengths(tiny_tldr):
    """benchmark/tiny.sh's length flags match what preprocess_tldr.py computes on the world."""
    sft = datasets.load_from_disk(str(tiny_tldr / "sft"))
    preference = datasets.load_from_disk(str(tiny_tldr / "preference"))
    assert sft.num_rows == dict(zip(["train", "validation", "test"], tw.Args(out_dir="").sft_sizes))
    assert set(preference) == {"train", "validation", "validation_cnndm"}
    assert preference["validation_cnndm"].num_rows == tw.Args(out_dir="").preference_sizes[2]
    lengths = tiny_lengths()
    query_length = int(lengths[lengths.index("--query_length") + 1])
    assert len(sft["train"][0]["query_token"]) == query_length
    # the long-tail posts really were cut to fit (Detail 2), and only those
    truncated = sum(not r["query"].endswith(r["post"] + "\n\nTL;DR:") for r in sft["train"])
    assert 0 < truncated < 0.2 * sft["train"].num_rows


class RecapStub:
    """A stand-in base model for recap_skill: recaps the post's fact sentences, the first actor wrong if asked."""

    def __init__(self, tokenizer, swap_first_actor):
        self.tokenizer, self.swap_first_actor = tokenizer, swap_first_actor

    def generate(self, ids, **kwargs):
        import torch

        text = self.tokenizer.decode(ids[0])
        facts = re.findall(r"\bmy (\w+) (\w+) my (\w+)", text.split("\n", 1)[1])  # the body, in order
        if self.swap_first_actor:
            actor = next(a for a in tw.ACTORS if a not in text.lower())
            facts[0] = (actor, *facts[0][1:])
        recap = " " + tw.recap_text(facts) + "."
        return torch.cat((ids, self.tokenizer(recap, return_tensors="pt").input_ids), dim=1)


def test_recap_skill_counts_facts_copied_and_invented_against_a_naive_count():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(WORLD / "pythia-tiny")
    assert tw.recap_skill(RecapStub(tokenizer, False), tokenizer, seed=5, n=20) == {
        "facts_right": 1.0, "invented_per_recap": 0.0}
    # Naive count: every post loses exactly its first fact, and that recap names one actor the post never does.
    rng = random.Random(5 + 2)
    fact_counts = [len(tw.make_post(rng, long_tail=False, recap_probability=1.0)[3]) for _ in range(20)]
    skill = tw.recap_skill(RecapStub(tokenizer, True), tokenizer, seed=5, n=20)
    assert skill["facts_right"] == pytest.approx(1 - 20 / sum(fact_counts))
    assert skill["invented_per_recap"] == pytest.approx(1.0)


class ChattyRecapStub(RecapStub):
    """A base model that goes on after its recap (as a real one does: the next paragraph, a question) with facts the
    post never states; it recaps only when prompted with the whole recap opener, as pretraining taught it."""

    def generate(self, ids, **kwargs):
        import torch

        text = self.tokenizer.decode(ids[0])
        assert text.endswith(tw.RECAP_OPENER), text[-40:]  # the prompt ends where the post's recap would begin
        out = super().generate(ids, **kwargs)
        actor = next(a for a in tw.ACTORS if a not in text.lower())
        more = f" What should I do?\n\nmy {actor} {actor} {actor}."
        return torch.cat((out, self.tokenizer(more, return_tensors="pt").input_ids), dim=1)


def test_recap_skill_reads_the_recap_sentence_only_of_a_prompt_that_opens_it():
    """recap_skill prompts with the post up to its recap opener and judges the first sentence of the continuation:
    what a model writes after its recap is not part of it (a perfect copier that chats on still scores 1.0 / 0.0)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(WORLD / "pythia-tiny")
    assert tw.recap_skill(ChattyRecapStub(tokenizer, False), tokenizer, seed=5, n=10) == {
        "facts_right": 1.0, "invented_per_recap": 0.0}


def test_model_policies_guess_feelings_and_the_writer_states_the_posts_own():
    """A model policy's "i feel ..." is a random feeling (for posts with or without one); the reference writer's is
    the post's. The guesses come from their own stream: the world's other draws are those of a reader's summary."""
    rng = random.Random(0)
    posts = [tw.make_post(rng, False) for _ in range(400)]
    model, writer = tw.POLICIES["sup2"], tw.POLICIES["ref"]
    reader = dataclasses.replace(model, reads_feelings=True)
    assert not model.reads_feelings and writer.reads_feelings
    stated = {"model": [], "writer": []}
    for seed, (_, _, text, facts, feeling) in enumerate(posts):
        filler = tw.filler_phrases(text)
        a, b = random.Random(seed), random.Random(seed)
        guessed = tw.make_summary(a, facts, feeling, model, filler, guesses=random.Random(-seed))
        read = tw.make_summary(b, facts, feeling, reader, filler)
        assert a.getstate() == b.getstate()  # the same draws of the world's stream
        strip = lambda s: re.sub(r"(, |; | and )?i feel \w+", "", s)  # noqa: E731
        assert strip(guessed) == strip(read), (guessed, read)
        stated["model"] += [(feeling, f) for f in re.findall(r"i feel (\w+)", guessed)]
        written = tw.make_summary(random.Random(seed), facts, feeling, writer, filler)
        stated["writer"] += [(feeling, f) for f in re.findall(r"i feel (\w+)", written)]
    assert stated["writer"] and all(post == said for post, said in stated["writer"])
    with_feeling = [post == said for post, said in stated["model"] if post]
    assert len(with_feeling) > 50 and sum(with_feeling) / len(with_feeling) < 0.3  # about 1 in 10: a guess
    assert any(not post for post, _ in stated["model"])  # and for posts that state none


def test_pretraining_killed_after_a_checkpoint_continues_bit_for_bit(tmp_path):
    """tiny_world.pretrain keeping its state every 2 steps, killed in its 5th step and started again on a new model
    (as a new process would be): the uninterrupted run's losses and weights, to the bit (dropout's random draws
    included). A checkpoint of a world with other arguments is not continued."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=64, hidden_dropout=0.1, attention_dropout=0.1)

    def new_model():
        torch.manual_seed(0)
        return GPTNeoXForCausalLM(config)

    class Killed(Exception):
        pass

    class KilledAfter(list):
        """The documents, until `reads` of them have been read."""
        def __init__(self, documents, reads):
            super().__init__(documents)
            self.reads = reads

        def __getitem__(self, index):
            self.reads -= 1
            if self.reads < 0:
                raise Killed
            return super().__getitem__(index)

    rng = random.Random(0)
    documents = [[rng.randrange(1, 64) for _ in range(rng.randrange(3, 12))] for _ in range(20)]
    plain_model = new_model()
    plain = tw.pretrain(plain_model, documents, 0, 6, 4, 1e-2, 1)  # 6 steps of 4 documents, no checkpoint
    folder = str(tmp_path / ".pretraining")
    with pytest.raises(Killed):  # 4 steps of 4 documents read, killed in the 5th
        tw.pretrain(new_model(), KilledAfter(documents, 4 * 4 + 2), 0, 6, 4, 1e-2, 1, folder, {"seed": 1}, save_every=2)
    assert len(json.loads(Path(folder, "state.json").read_text())["losses"]) == 4
    resumed_model, read = new_model(), KilledAfter(documents, 1000)
    assert tw.pretrain(resumed_model, read, 0, 6, 4, 1e-2, 1, folder, {"seed": 1}, save_every=2) == plain
    assert 1000 - read.reads == 2 * 4  # only the last 2 steps ran
    assert all(torch.equal(a, b) for a, b in zip(plain_model.state_dict().values(),
                                                 resumed_model.state_dict().values()))
    read = KilledAfter(documents, 1000)
    assert tw.pretrain(new_model(), read, 0, 6, 4, 1e-2, 1, folder, {"seed": 2}, save_every=2) == plain
    assert 1000 - read.reads == 6 * 4  # another world's checkpoint: all 6 steps


def test_world_json_is_written_last_and_whole(tmp_path, monkeypatch):
    """tiny.sh takes a folder with world.json as a whole world. A build over an older world drops its world.json before
    it writes anything; killed at any later moment (here in the card's write, after the datasets and the model) it
    leaves no world.json; a finished build leaves world.json and no .partial beside it."""
    out = tmp_path / "w"
    out.mkdir()
    (out / "world.json").write_text('{"an older world": true}')
    card = tw.world_card

    def killed(meta):
        assert not (out / "world.json").exists()  # already gone when the card is written
        raise KeyboardInterrupt

    monkeypatch.setattr(tw, "world_card", killed)
    with pytest.raises(KeyboardInterrupt):
        tw.build_world(small_args(out))
    assert not (out / "world.json").exists() and (out / "pythia-tiny" / "model.safetensors").is_file()
    monkeypatch.setattr(tw, "world_card", card)
    meta = tw.build_world(small_args(out))
    assert json.loads((out / "world.json").read_text()) == json.loads(json.dumps(meta))
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("world")) == ["world.json"]


def test_the_reference_writer_makes_its_mistakes_at_the_rates_the_card_states():
    """make_summary with the writer's habits, over 4,000 fresh posts: the habits a summary's text shows (the main point,
    an irrelevant detail, rambling, the question, the feeling) at the card's rates (within 4 standard errors); the
    feeling it states is always the post's own, and none for a post without one. The rebuild test pins the committed
    bytes; this pins what a rebuilt world's writer does (an error-free writer would fail it)."""
    writer, rng, n = tw.POLICIES["ref"], random.Random(7), 4000
    seen = {"main": 0, "filler": 0, "filler_possible": 0, "ramble": 0, "question": 0, "feeling": 0, "with_feeling": 0}
    for _ in range(n):
        _, _, post, facts, feeling = tw.make_post(rng, long_tail=False)
        pool = tw.filler_phrases(post)
        text = tw.make_summary(rng, facts, feeling, writer, pool)
        body = text.split(". ")[0]
        a, v, o = facts[0]
        said = set(tw.words(body))
        seen["main"] += v in said and (a in said or o in said)  # kept, perhaps with one word wrong (misremembered)
        seen["filler_possible"] += bool(pool)
        seen["filler"] += any(phrase in body for phrase in pool)
        seen["ramble"] += any(ramble in body for ramble in tw.RAMBLES)
        seen["question"] += any(text.endswith(". " + q.lower()) for q in tw.QUESTIONS)
        stated = re.findall(r"i feel (\w+)", body)
        assert set(stated) <= ({feeling} if feeling else set()), (feeling, text)  # a loop may repeat it
        seen["with_feeling"] += feeling is not None
        seen["feeling"] += bool(stated)

    def near(count, total, rate):
        return abs(count / total - rate) < 4 * math.sqrt(rate * (1 - rate) / total)

    # another kept fact may share the main fact's verb and a word of it: "main" can only count too many
    assert near(seen["main"], n, writer.main) or seen["main"] / n > writer.main, seen
    assert near(seen["filler"], seen["filler_possible"], writer.filler), seen
    assert near(seen["ramble"], n, writer.ramble), seen
    assert near(seen["question"], n, writer.question), seen
    assert near(seen["feeling"], seen["with_feeling"], writer.feeling), seen
