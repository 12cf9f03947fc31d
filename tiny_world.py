"""The embedded tiny TL;DR world: the project's offline default dataset, judge and base model.

The real pipeline reads two Hub datasets and a Pythia checkpoint, none of which can be downloaded
on an offline machine or in CI. This module builds a small stand-in world that has the same shape,
so every stage runs the exact code path it runs on the real thing:

- `tldr_3_filtered/`: the SFT dataset, in the schema of `vwxyzjn/summarize_from_feedback_tldr_3_filtered`
  (id, subreddit, title, post, summary; train / validation / test). `load_dataset(path)`.
- `summarize_from_feedback/`: the preference dataset, in the schema of `openai/summarize_from_feedback`
  (config `comparisons`; train / validation, with CNN/DM-like news rows in validation).
  `load_dataset(path, "comparisons")`.
- `pythia-tiny/`: a byte-level BPE tokenizer (`<|endoftext|>` = EOS, a distinct `[PAD]`) and a
  tiny GPT-NeoX (the Pythia architecture, rotary) saved with `save_pretrained`, pretrained (6,000
  steps by default) on Reddit-like posts and news-like articles, so `--base_model assets/tiny_world/pythia-tiny` loads like `EleutherAI/pythia-1b-deduped`.
- `WORLD.md` / `world.json`: the world card (sizes, policies, label noise, the best achievable accuracy).

The world has a ground truth. Each post is built from key facts ("my landlord cancelled my lease"),
a feeling, and irrelevant detail ("it was rainy and I was eating tacos"). `gold_score(post, summary)`
is a deterministic function of the two texts alone that rewards covering the post's key facts and
penalises invented facts, irrelevant detail, repetition and rambling. Preference labels are drawn
from it with Bradley-Terry noise, so the best accuracy any reward model can reach on the labels
(the noise ceiling) is known and written to the card. The same function is the offline judge of
model outputs (`judge.py --judge gold`), so it accepts any text.

    python tiny_world.py --out_dir assets/tiny_world      # rebuilds the committed world (~16 min on 2 cores)
    python tiny_world.py --out_dir /tmp/w --seed 2        # another world

Same seed, same bytes: the datasets and the tokenizer are a deterministic function of the arguments; the base
model's weights are too, given the same torch version, thread count and CPU (float sums run in another order on
another one, so its training takes another path). A build killed while pretraining
continues from its last checkpoint (`{out_dir}/.pretraining/`, every 250 steps) when started again.
`world.json` is written last: a folder without it is not a whole world (benchmark/tiny.sh builds it again).
"""

import json
import math
import os
import random
import re
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass

# ------------------------------------------------------------------------------------------------
# The lexicon. Key words (actors, verbs, objects, feelings; news officials, actions, things) carry
# the facts that a summary should keep; filler words only ever appear in irrelevant detail. Every
# other word (my, the, so, what, should ...) is neutral glue. The gold judge only needs these sets.
# ------------------------------------------------------------------------------------------------
SUBREDDITS = ["relationships", "AskReddit", "personalfinance", "tifu", "legaladvice", "jobs",
              "roommates", "Parenting"]
ACTORS = ["landlord", "roommate", "boss", "girlfriend", "boyfriend", "sister", "brother", "coworker",
          "neighbor", "mother", "father", "friend", "wife", "husband", "teacher", "manager", "cousin",
          "uncle", "aunt", "grandmother", "mechanic", "coach", "dentist", "classmate"]
VERBS = ["cancelled", "borrowed", "broke", "ignored", "stole", "forgot", "sold", "criticized", "hid",
         "moved", "lost", "damaged", "refused", "raised", "cut", "read", "returned", "crashed",
         "ruined", "mocked", "blocked", "skipped", "reported", "deleted", "painted", "locked",
         "shared", "doubled", "replaced", "missed"]
OBJECTS = ["lease", "car", "laptop", "birthday", "wallet", "rent", "phone", "wedding", "dog", "bike",
           "paycheck", "keys", "couch", "promotion", "vacation", "password", "diary", "savings",
           "apartment", "guitar", "camera", "paperwork", "deposit", "insurance", "schedule", "tuition",
           "loan", "medication", "passport", "contract", "garden", "fence", "recipe", "budget",
           "furniture", "invitation", "bonus", "bedroom", "shift", "mortgage"]
FEELINGS = ["angry", "confused", "hurt", "betrayed", "anxious", "embarrassed", "guilty", "stressed",
            "jealous", "exhausted"]
NEWS_ACTORS = ["mayor", "senator", "governor", "police", "council", "minister", "judge", "company",
               "union", "hospital", "university", "airline", "regulator", "court"]
NEWS_VERBS = ["approved", "rejected", "announced", "closed", "opened", "investigated", "delayed",
              "funded", "banned", "expanded", "suspended", "unveiled"]
NEWS_OBJECTS = ["bridge", "stadium", "railway", "airport", "museum", "tax", "law", "park", "election",
                "merger", "strike", "vaccine", "pipeline", "curfew", "festival", "subsidy"]
KEY_WORDS = frozenset(ACTORS + VERBS + OBJECTS + FEELINGS + NEWS_ACTORS + NEWS_VERBS + NEWS_OBJECTS)

WEATHER = ["rainy", "sunny", "windy", "foggy", "snowy", "humid"]
FOODS = ["tacos", "pasta", "pizza", "noodles", "pancakes", "sushi", "burritos", "soup", "waffles",
         "curry"]
PETS = ["whiskers", "biscuit", "pepper", "mittens", "noodle", "ziggy", "luna", "mochi"]
FURNITURE = ["sofa", "armchair", "beanbag", "futon", "ottoman", "hammock"]
COLORS = ["purple", "orange", "yellow", "turquoise", "maroon", "beige"]
CLOTHES = ["hoodie", "sweater", "jacket", "scarf", "sneakers", "beanie"]
SHOWS = ["cartoons", "documentaries", "sitcoms", "podcasts", "reruns", "anime"]
PLACES = ["gym", "library", "laundromat", "bakery", "pharmacy", "supermarket"]
NEWS_FILLER = ["reporters", "cameras", "umbrellas", "crowds", "journalists", "spectators"]
FILLER_WORDS = frozenset(WEATHER + FOODS + PETS + FURNITURE + COLORS + CLOTHES + SHOWS + PLACES
                         + NEWS_FILLER)

FACT_SENTENCES = [
    "So last week my {a} {v} my {o}.", "Then my {a} {v} my {o} without even asking.",
    "To make it worse, my {a} {v} my {o}.", "It started when my {a} {v} my {o}.",
    "A few days ago my {a} {v} my {o}.", "Yesterday my {a} {v} my {o} and said nothing.",
    "On top of that my {a} {v} my {o}.", "Basically my {a} {v} my {o}.",
]
FILLER_SENTENCES = [
    "It was {weather} outside and I was eating {food}.", "My cat {pet} was asleep on the {furniture}.",
    "I was wearing my {color} {clothes} at the time.", "We had been watching {shows} all evening.",
    "I had just come back from the {place}.", "For some reason I remember it was {weather} that day.",
    "Earlier I had {food} with my cat {pet}.", "The {furniture} in the hallway is {color} by the way.",
]
FEELING_SENTENCES = ["Honestly I feel {f} about it.", "I am so {f} right now.",
                     "I feel {f} and I do not know why."]
QUESTIONS = ["What should I do?", "Am I overreacting?", "How do I handle this?",
             "Is this normal?", "Any advice?"]
OPENERS = ["Throwaway account for obvious reasons.", "Long time lurker, first post.",
           "Sorry for the formatting, I am on mobile.", "Not sure if this is the right place.",
           "I (24) need some outside perspective.", "This might be long, sorry."]
RAMBLES = ["honestly i do not even know anymore", "it has been going on for a while now",
           "which is just a lot to deal with right now", "i keep thinking about it every day",
           "so yeah that is basically the whole story"]
NEWS_FACTS = ["The {a} {v} the {o} on Monday.", "Officials said the {a} {v} the {o} after a long debate.",
              "Earlier this year the {a} {v} the {o}.", "In a surprise move the {a} {v} the {o}."]
NEWS_FILLERS = ["Dozens of {nf} waited outside in the {weather} weather.",
                "Local {nf} gathered near the {place} as the news broke.",
                "Some {nf} were seen eating {food} nearby."]


# ------------------------------------------------------------------------------------------------
# The gold judge: a deterministic function of (post text, summary text) alone.
# ------------------------------------------------------------------------------------------------
WORD_RE = re.compile(r"[a-z0-9']+")
JUDGE_WEIGHTS = {"coverage": 3.0, "invented": 0.8, "irrelevant": 0.4, "repetition": 0.3,
                 "rambling": 0.1, "empty": 2.0}


def words(text):
    """Lower-cased word tokens of any text (special tokens such as <|endoftext|> become words)."""
    return WORD_RE.findall(text.lower())


def gold_breakdown(post, summary):
    """The gold judge's score of `summary` for `post`, with the terms that make it up."""
    post_keys = {w for w in words(post) if w in KEY_WORDS}
    summary_words = words(summary)
    summary_keys = {w for w in summary_words if w in KEY_WORDS}
    coverage = len(summary_keys & post_keys) / max(1, len(post_keys))
    invented = len(summary_keys - post_keys)  # facts that are not in the post
    irrelevant = sum(w in FILLER_WORDS for w in summary_words)  # details that do not matter
    counts = Counter(w for w in summary_words if w in KEY_WORDS or w in FILLER_WORDS)
    repetition = sum(c - 1 for c in counts.values())
    # A good summary needs about 2 words per key word of the post; beyond a small margin it rambles.
    budget = 6 + 2 * len(post_keys)
    rambling = max(0, len(summary_words) - budget)
    w = JUDGE_WEIGHTS
    score = (w["coverage"] * coverage - w["invented"] * invented - w["irrelevant"] * irrelevant
             - w["repetition"] * repetition - w["rambling"] * rambling
             - w["empty"] * (len(summary_words) == 0))
    return {"score": score, "coverage": coverage, "invented": invented, "irrelevant": irrelevant,
            "repetition": repetition, "rambling": rambling, "n_words": len(summary_words)}


def gold_score(post, summary):
    """The gold judge's scalar score (higher is better); see `gold_breakdown`."""
    return gold_breakdown(post, summary)["score"]


# Two summaries whose terms add up to the same score can differ in the last bits of their float sums
# (1.8000000000000003 against 1.7999999999999998): closer than this, the gold judge calls them equal.
# Distinct scores differ by far more (the terms are multiples of 0.1 and 3 x coverage, a fraction of few key words).
GOLD_TIE = 1e-9


def gold_difference(score_a, score_b):
    """score_a - score_b of two gold scores, exactly 0.0 for scores equal up to float rounding (GOLD_TIE)."""
    return 0.0 if abs(score_a - score_b) < GOLD_TIE else score_a - score_b


def gold_margin(post, summary_a, summary_b):
    """gold_difference of the two summaries' gold scores: 0.0 for a tie."""
    return gold_difference(gold_score(post, summary_a), gold_score(post, summary_b))


def preference_probability(post, summary_a, summary_b, temperature):
    """Bradley-Terry probability that a labeller prefers summary_a: sigmoid(gold difference / T)."""
    diff = gold_score(post, summary_a) - gold_score(post, summary_b)
    return 1.0 / (1.0 + math.exp(-diff / temperature))


# ------------------------------------------------------------------------------------------------
# Posts, articles and summaries.
# ------------------------------------------------------------------------------------------------
def filler_sentence(rng, templates):
    """One sentence of irrelevant detail."""
    return rng.choice(templates).format(
        weather=rng.choice(WEATHER), food=rng.choice(FOODS), pet=rng.choice(PETS).capitalize(),
        furniture=rng.choice(FURNITURE), color=rng.choice(COLORS), clothes=rng.choice(CLOTHES),
        shows=rng.choice(SHOWS), place=rng.choice(PLACES), nf=rng.choice(NEWS_FILLER))


def make_post(rng, long_tail, recap_probability=0.3):
    """A Reddit-style post: (subreddit, title, post text, facts, feeling)."""
    n_facts = rng.choice([2, 2, 3, 3, 3, 4])
    actors, objects = rng.sample(ACTORS, n_facts), rng.sample(OBJECTS, n_facts)
    facts = [(a, rng.choice(VERBS), o) for a, o in zip(actors, objects)]
    feeling = rng.choice(FEELINGS) if rng.random() < 0.7 else None
    # Sentences in reading order: the facts in order, irrelevant detail sprinkled between them.
    sentences = [rng.choice(OPENERS)] if rng.random() < 0.5 else []
    for a, v, o in facts:
        sentences.append(rng.choice(FACT_SENTENCES).format(a=a, v=v, o=o))
        sentences += [filler_sentence(rng, FILLER_SENTENCES) for _ in range(rng.choice([0, 1, 1, 2]))]
    if feeling:
        sentences.append(rng.choice(FEELING_SENTENCES).format(f=feeling))
    # Cut the sentences into 2-5 paragraphs; the question ends the post in its own paragraph.
    cuts = sorted(rng.sample(range(1, len(sentences)), min(len(sentences) - 1, rng.randint(1, 4))))
    paragraphs = [" ".join(sentences[i:j]) for i, j in zip([0] + cuts, cuts + [len(sentences)])]
    if long_tail:  # a long rant of irrelevant paragraphs: these overflow the query budget (Detail 2)
        for _ in range(rng.randint(6, 14)):
            paragraphs.append(" ".join(filler_sentence(rng, FILLER_SENTENCES) for _ in range(3)))
    if rng.random() < recap_probability:  # an edit that restates the facts: Reddit posts repeat
        # themselves, and copying from earlier in the context is what the base model must learn
        paragraphs.append(f"{RECAP_OPENER} {recap_text(facts)}.")
    paragraphs.append(rng.choice(QUESTIONS))
    a, v, o = facts[0]
    question = rng.choice(QUESTIONS)
    title = f"My {a} {v} my {o}, {question[0].lower()}{question[1:]}"
    return rng.choice(SUBREDDITS), title, "\n\n".join(paragraphs), facts, feeling


RECAP_OPENER = "Edit: to sum up,"  # opens a post's recap paragraph (recap_skill prompts with it)


def recap_text(facts):
    """A post's facts as its recap states them: "my a v my o and my a v my o"."""
    return " and ".join(f"my {a} {v} my {o}" for a, v, o in facts)


def make_article(rng, recap_probability=0.0):
    """A CNN/DM-like news article: (site, title, article text, facts)."""
    n_facts = rng.choice([2, 3, 3, 4])
    actors, objects = rng.sample(NEWS_ACTORS, n_facts), rng.sample(NEWS_OBJECTS, n_facts)
    facts = [(a, rng.choice(NEWS_VERBS), o) for a, o in zip(actors, objects)]
    paragraphs = []
    for i, (a, v, o) in enumerate(facts):
        lead = "(CNN) -- " if i == 0 else ""
        paragraph = [lead + rng.choice(NEWS_FACTS).format(a=a, v=v, o=o)]
        paragraph += [filler_sentence(rng, NEWS_FILLERS) for _ in range(rng.randint(1, 3))]
        paragraphs.append(" ".join(paragraph))
    if rng.random() < recap_probability:  # a closing paragraph that restates the news, as wire stories do
        paragraphs.append("In short, " + " and ".join(f"the {a} {v} the {o}" for a, v, o in facts) + ".")
    a, v, o = facts[0]
    return rng.choice(["cnn", "dailymail"]), f"The {a} {v} the {o}", "\n".join(paragraphs), facts


def pretraining_corpus(rng, n, news_fraction):
    """The base model's web text: n documents, posts and (news_fraction of them) articles, each with a recap."""
    documents = []
    for _ in range(n):
        if rng.random() < news_fraction:
            _, title, text, _ = make_article(rng, recap_probability=1.0)
        else:
            _, title, text, _, _ = make_post(rng, long_tail=False, recap_probability=1.0)
        documents.append(f"{title}\n\n{text}")
    return documents


@dataclass(frozen=True)
class Policy:
    """How a summarisation policy of the world writes: probabilities of each habit."""

    main: float  # keeps the first (main) fact
    other: float  # keeps each other fact
    feeling: float  # mentions the feeling
    invent: float  # adds a fact that is not in the post
    filler: float  # copies irrelevant detail
    ramble: float  # rambles on
    repeat: float  # repeats a clause (1-3 times: a loop)
    question: float  # ends with the question
    terse: float  # writes facts telegraphically ("landlord cancelled lease")
    misremember: float = 0.0  # gets one word of a kept fact wrong (another actor or object)
    reads_feelings: bool = False  # states the post's own feeling; a model of this world guesses one instead


# The names follow the policies of openai/summarize_from_feedback; the qualities are this world's.
# Like the real dataset's model-written summaries, the policies make model-like mistakes: a kept
# fact with one wrong name or thing (misremember), loops of repeated clauses, filler, rambling.
# They make the mistakes the models of this world make (the real dataset's models are of the kind
# being trained). A model of this world gets a name wrong; it does not make up a whole fact:
# sampled at 0.7, the SFT models of six worlds (seeds 1-5, 9) write 0.28-0.56 kept facts with
# one wrong name per summary and 0.003-0.014 facts the post never states
# (benchmark/results/tiny_main_job_notebook.md, "Mistakes as the models make them").
# So a model policy invents no whole fact; its misremember rate is the chance of either habit
# in the table before 2026-11-28 (1 - (1 - misremember) (1 - invent)). Only the human writer
# makes up a fact now and then.
# And a guessed feeling: the models of this world cannot read a feeling off a post (the base model's
# pretraining recaps restate facts only, so the SFT model trained from it guesses one too; README),
# so a model policy's "i feel ..." is a random one of FEELINGS, for a post with or without a feeling.
# Only the human writer, the post's author, states the post's own (reads_feelings).
POLICIES = {
    # The human reference writer: states the main point, keeps half of the rest, sometimes gets a
    # name or thing wrong, copies a detail that does not matter or rambles (see WORLD.md for rates).
    "ref": Policy(0.90, 0.50, 0.35, 0.02, 0.15, 0.15, 0.02, 0.3, 0.5, misremember=0.15, reads_feelings=True),
    "sup1": Policy(0.70, 0.40, 0.3, 0.0, 0.40, 0.30, 0.20, 0.5, 0.3, misremember=0.545),
    "sup2": Policy(0.80, 0.50, 0.3, 0.0, 0.30, 0.25, 0.15, 0.5, 0.3, misremember=0.4375),
    "sup2_t0.7": Policy(0.75, 0.45, 0.3, 0.0, 0.35, 0.30, 0.20, 0.5, 0.3, misremember=0.51),
    "sup4": Policy(0.90, 0.65, 0.4, 0.0, 0.20, 0.20, 0.08, 0.4, 0.4, misremember=0.2775),
    "sup4_t0.7": Policy(0.85, 0.60, 0.4, 0.0, 0.25, 0.25, 0.10, 0.4, 0.4, misremember=0.36),
    "sup4_6b": Policy(0.93, 0.70, 0.4, 0.0, 0.15, 0.15, 0.05, 0.4, 0.4, misremember=0.19),
    "sup4_ppo_rm3": Policy(0.97, 0.85, 0.6, 0.0, 0.10, 0.45, 0.05, 0.6, 0.2, misremember=0.0975),
    "sup4_bo8_rm3": Policy(0.95, 0.80, 0.5, 0.0, 0.10, 0.20, 0.03, 0.4, 0.4, misremember=0.126),
    "pretrain_1b_t.7": Policy(0.45, 0.25, 0.2, 0.0, 0.60, 0.50, 0.35, 0.3, 0.2, misremember=0.73),
}
# Detail 6 in this world: train compares a few supervised policies; validation adds many unseen ones.
TRAIN_POLICIES = ["sup1", "sup2", "sup4", "sup4_t0.7", "pretrain_1b_t.7"]
VALIDATION_POLICIES = list(POLICIES)
CNNDM_POLICIES = ["ref", "sup4", "sup4_t0.7", "pretrain_1b_t.7"]
CNNDM_BATCHES = ["batch0_cnndm", "cnndm0", "cnndm2"]


def make_summary(rng, facts, feeling, policy, filler_pool, news=False, guesses=None):
    """A summary written by `policy` from the post's facts (no leading space, no EOS).

    A policy that does not read feelings draws its guessed feelings from `guesses`, its own stream, so that
    every other draw of `rng` (and with it the rest of the world) is the same as for one that does."""
    kept = [fact for i, fact in enumerate(facts) if rng.random() < (policy.main if i == 0 else policy.other)]
    if kept and rng.random() < policy.misremember:  # one kept fact with a wrong actor or object
        actors, objects = (NEWS_ACTORS, NEWS_OBJECTS) if news else (ACTORS, OBJECTS)
        in_post = {w for fact in facts for w in fact}
        i = rng.randrange(len(kept))
        a, v, o = kept[i]
        if rng.random() < 0.5:
            a = rng.choice([w for w in actors if w not in in_post])
        else:
            o = rng.choice([w for w in objects if w not in in_post])
        kept[i] = (a, v, o)
    clauses = [f"{a} {v} {o}" if rng.random() < policy.terse else (f"the {a} {v} the {o}" if news else f"my {a} {v} my {o}")
               for a, v, o in kept]
    if rng.random() < policy.invent:  # a fact the post never states
        pool = (NEWS_ACTORS, NEWS_VERBS, NEWS_OBJECTS) if news else (ACTORS, VERBS, OBJECTS)
        a, v, o = (rng.choice(p) for p in pool)
        clauses.insert(rng.randint(0, len(clauses)), f"{a} {v} {o}" if news else f"my {a} {v} my {o}")
    if feeling and rng.random() < policy.feeling:
        clauses.append(f"i feel {feeling if policy.reads_feelings else guesses.choice(FEELINGS)}")
    if rng.random() < policy.filler and filler_pool:
        clauses.insert(rng.randint(0, len(clauses)), rng.choice(filler_pool))
    if clauses and rng.random() < policy.repeat:  # a loop: one clause again, up to three times
        clauses += [rng.choice(clauses)] * rng.choice([1, 1, 2, 3])
    if rng.random() < policy.ramble:
        clauses.append(rng.choice(RAMBLES))
    separator = rng.choice([", ", "; ", " and "]) if clauses else ", "
    # For a post without a feeling, a guess goes last, after every draw of `rng` a reader's summary makes.
    if not feeling and not news and not policy.reads_feelings and guesses.random() < policy.feeling:
        clauses.append(f"i feel {guesses.choice(FEELINGS)}")
    text = separator.join(clauses) if clauses else "not sure"
    if not news and rng.random() < policy.question:
        text += ". " + rng.choice(QUESTIONS).lower()
    return text


def filler_phrases(text):
    """Irrelevant-detail phrases a careless summary copies: the post's filler sentences, lowered."""
    return [s.strip(" .").lower() for s in re.split(r"(?<=[.?!])\s+", text)
            if any(w in FILLER_WORDS for w in words(s))]


def make_id(rng, prefix="t3_"):
    """A Reddit-like id."""
    return prefix + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(6))


# ------------------------------------------------------------------------------------------------
# Datasets in the Hub schemas.
# ------------------------------------------------------------------------------------------------
def build_sft_rows(rng, n, long_tail_fraction):
    """Rows of the SFT dataset: id, subreddit, title, post, summary (human-like references)."""
    rows = []
    for _ in range(n):
        subreddit, title, post, facts, feeling = make_post(rng, rng.random() < long_tail_fraction)
        summary = make_summary(rng, facts, feeling, POLICIES["ref"], filler_phrases(post))
        rows.append({"id": make_id(rng), "subreddit": subreddit, "title": title, "post": post,
                     "summary": summary})
    return rows


def build_preference_rows(rng, n, split, policies, batches, temperature, long_tail_fraction,
                          news=False, guesses=None):
    """Comparison rows in the schema of openai/summarize_from_feedback, labelled by the gold judge.

    `guesses`: the model policies' stream of guessed feelings (make_summary)."""
    rows, probabilities = [], []
    for i in range(n):
        if news:
            site, title, text, facts = make_article(rng)
            info = {"id": make_id(rng, "cnndm/"), "post": None, "title": title, "subreddit": None,
                    "site": site, "article": text}
            feeling = None
        else:
            subreddit, title, text, facts, feeling = make_post(rng, rng.random() < long_tail_fraction)
            info = {"id": make_id(rng), "post": text, "title": title, "subreddit": subreddit,
                    "site": None, "article": None}
        pair = rng.sample(policies, 2) if rng.random() < 0.85 else [rng.choice(policies)] * 2
        texts = [make_summary(rng, facts, feeling, POLICIES[p], filler_phrases(text), news, guesses)
                 for p in pair]
        # The labeller sees title and text; the label is Bradley-Terry noise around the gold judge.
        p0 = preference_probability(f"{title}\n{text}", texts[0], texts[1], temperature)
        choice = 0 if rng.random() < p0 else 1
        margin = abs(gold_score(f"{title}\n{text}", texts[0]) - gold_score(f"{title}\n{text}", texts[1]))
        confidence = min(9, max(1, round(1 + 2 * margin + rng.gauss(0, 1))))
        if split == "train" and i < n // 2:
            confidence = None  # like the real train split: early batches carry no confidence
        rows.append({
            "info": info,
            "summaries": [{"text": " " + t, "policy": p,
                           "note": "both miss the point" if rng.random() < 0.03 else None}
                          for t, p in zip(texts, pair)],
            "choice": choice,
            "worker": "w" + "".join(rng.choice("0123456789abcdef") for _ in range(8)),
            "batch": batches[min(len(batches) - 1, i * len(batches) // n)],
            "split": split if split == "train" else ("valid1" if i % 2 == 0 else "valid2"),
            "extra": {"confidence": confidence},
        })
        probabilities.append(max(p0, 1 - p0))
    return rows, probabilities


def sft_features():
    """Features of the SFT dataset (all strings)."""
    from datasets import Features, Value

    return Features({k: Value("string") for k in ["id", "subreddit", "title", "post", "summary"]})


def preference_features():
    """Features of the comparisons config of openai/summarize_from_feedback."""
    from datasets import Features, List, Value

    info = {k: Value("string") for k in ["id", "post", "title", "subreddit", "site", "article"]}
    summary = {"text": Value("string"), "policy": Value("string"), "note": Value("string")}
    return Features({"info": info, "summaries": List(summary), "choice": Value("int32"),
                     "worker": Value("string"), "batch": Value("string"), "split": Value("string"),
                     "extra": {"confidence": Value("int32")}})


def write_hub_style_dataset(path, config_name, splits, features, card):
    """Write splits as parquet plus a README whose `configs:` make `load_dataset(path, config)` work."""
    from datasets import Dataset

    folder = config_name or "data"
    os.makedirs(os.path.join(path, folder), exist_ok=True)
    yaml = ["---", "configs:", f"- config_name: {config_name or 'default'}", "  data_files:"]
    for split, rows in splits.items():
        Dataset.from_list(rows, features=features).to_parquet(os.path.join(path, folder, f"{split}.parquet"))
        yaml += [f"  - split: {split}", f"    path: {folder}/{split}.parquet"]
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write("\n".join(yaml + ["---", "", card, ""]))


# ------------------------------------------------------------------------------------------------
# Tokenizer and base model.
# ------------------------------------------------------------------------------------------------
def train_tokenizer(texts, vocab_size):
    """A byte-level BPE like Pythia's: `<|endoftext|>` (id 0) is BOS/EOS/UNK, `[PAD]` (id 1) is pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "[PAD]"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", unk_token="<|endoftext|>",
                                   pad_token="[PAD]", padding_side="right", model_max_length=2048)


def pretrain(model, documents, pad_id, steps, batch_size, lr, seed, checkpoint=None, identity=None, save_every=250):
    """Next-token pretraining on tokenized documents (lists of ids); returns the per-step losses.

    With `checkpoint` (a folder), the state after every `save_every` steps is kept there (weights, optimizer, random
    states, losses; no pickle), and a build killed while pretraining continues from it, bit for bit, when started
    again with the same `identity` (the world's arguments). An interrupted build of another world starts afresh."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = load_pretraining(checkpoint, identity, model, optimizer, generator) if checkpoint else []
    model.train()
    for step in range(len(losses), steps):
        batch = [documents[i] for i in torch.randint(0, len(documents), (batch_size,), generator=generator)]
        width = max(len(d) for d in batch)
        ids = torch.tensor([d + [pad_id] * (width - len(d)) for d in batch])  # (B, T) right-padded
        mask = ids != pad_id
        for group in optimizer.param_groups:  # linear warm-up then cosine decay
            group["lr"] = lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        loss = model(input_ids=ids.masked_fill(~mask, 0), attention_mask=mask.long(),
                     labels=ids.masked_fill(~mask, -100)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            print(f"pretrain step {step}/{steps} loss {loss.item():.3f}", flush=True)
        if checkpoint and (step + 1) % save_every == 0 and step + 1 < steps:
            save_pretraining(checkpoint, identity, losses, model, optimizer, generator)
    model.eval()
    return losses


def save_pretraining(folder, identity, losses, model, optimizer, generator):
    """The pretraining's state after len(losses) steps into `folder`, whole: written beside it, then renamed."""
    import torch
    from safetensors.torch import save_file

    partial = folder + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    state = optimizer.state_dict()  # AdamW: {"state": {index: {name: tensor}}, "param_groups": [plain values]}
    tensors = {f"model.{name}": value.contiguous() for name, value in model.state_dict().items()}
    tensors.update({f"optimizer.{index}.{name}": value for index, values in state["state"].items()
                    for name, value in values.items()})
    tensors.update({"rng.torch": torch.get_rng_state(), "rng.generator": generator.get_state()})
    save_file(tensors, os.path.join(partial, "state.safetensors"))
    with open(os.path.join(partial, "state.json"), "w") as f:
        json.dump({"identity": identity, "losses": losses, "param_groups": state["param_groups"]}, f)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(partial, folder)


def load_pretraining(folder, identity, model, optimizer, generator):
    """Restore what save_pretraining kept in `folder` -> its losses; [] (nothing restored) if there is none
    or it belongs to a world with other arguments."""
    import torch
    from safetensors.torch import load_file

    if not os.path.isfile(os.path.join(folder, "state.json")):
        return []
    with open(os.path.join(folder, "state.json")) as f:
        saved = json.load(f)
    if saved["identity"] != identity:
        print(f"{folder} holds the pretraining of a world with other arguments: pretraining from step 0")
        return []
    tensors = load_file(os.path.join(folder, "state.safetensors"))
    model.load_state_dict({name[len("model."):]: value for name, value in tensors.items() if name.startswith("model.")})
    optimizer_state = {}
    for name, value in tensors.items():
        if name.startswith("optimizer."):
            index, key = name[len("optimizer."):].split(".", 1)
            optimizer_state.setdefault(int(index), {})[key] = value
    for group in saved["param_groups"]:
        group["betas"] = tuple(group["betas"])  # JSON has no tuples
    optimizer.load_state_dict({"state": optimizer_state, "param_groups": saved["param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
    generator.set_state(tensors["rng.generator"])
    print(f"pretraining continues from {folder} at step {len(saved['losses'])}", flush=True)
    return saved["losses"]


def recap_skill(model, tokenizer, seed, n=200):
    """How well a base model copies from its context: greedy recaps of n fresh pretraining-style posts.

    Returns {"facts_right": share of the posts' facts recapped word for word (as recap_text writes them),
    "invented_per_recap": key words per recap that the post does not contain}."""
    import torch

    rng = random.Random(seed + 2)  # fresh posts: seed is the datasets', seed + 1 the pretraining corpus'
    right = facts = invented = 0
    for _ in range(n):
        _, title, text, post_facts, _ = make_post(rng, long_tail=False, recap_probability=1.0)
        document = f"{title}\n\n{text}"
        prefix = document[: document.index(RECAP_OPENER) + len(RECAP_OPENER)]
        ids = tokenizer(prefix, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        recap = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split(".")[0]
        right += sum(recap_text([fact]) in recap for fact in post_facts)
        facts += len(post_facts)
        invented += gold_breakdown(f"{title}\n{text}", recap)["invented"]
    return {"facts_right": right / facts, "invented_per_recap": invented / n}


# ------------------------------------------------------------------------------------------------
# The world card.
# ------------------------------------------------------------------------------------------------
def world_card(meta):
    """The markdown card written to WORLD.md (meta: world.json as read back)."""
    sections = (card_datasets(meta), card_writer(meta), card_length(meta), card_policies(meta), card_base_model(meta))
    return "\n".join(line for section in sections for line in section) + "\n"


def card_datasets(meta):
    """The card's title, row counts and ground truth (the gold judge, the labels' noise ceiling)."""
    c = meta["counts"]
    return [
        "# The tiny TL;DR world", "",
        f"Built by `python tiny_world.py` with seed {meta['args']['seed']}. Same seed, same bytes: the datasets and "
        "the tokenizer anywhere, the base model's weights with the same torch version, thread count and CPU.", "",
        "| dataset | split | rows |", "|---|---|---|",
        *[f"| {d} | {s} | {n} |" for d, splits in c.items() for s, n in splits.items()], "",
        "## Ground truth",
        "`tiny_world.gold_score(post, summary)`: "
        + ", ".join(f"{k} {v}" for k, v in JUDGE_WEIGHTS.items())
        + " (coverage = share of the post's key words kept; invented = key words not in the post; "
          "irrelevant = filler words; rambling = words beyond 6 + 2 x post key words).", "",
        f"Labels: Bradley-Terry around the gold score with temperature {meta['args']['label_temperature']}. "
        "Best achievable accuracy on the labels (the noise ceiling, mean of max(p, 1-p)):", "",
        "| split | noise ceiling |", "|---|---|",
        *[f"| {s} | {v:.3f} |" for s, v in meta["noise_ceiling"].items()], "",
    ]


def card_writer(meta):
    """The card's section on the human reference writer: its configured habits and what they give."""
    return [
        "## The human reference writer", "",
        "The SFT dataset's reference summaries (and the `ref` policy of the preference pairs) come from a "
        "human-like writer, not from an oracle: like a Reddit TL;DR, it states the main point and skips "
        "much of the rest, and it makes mistakes. How often (configured rates, per summary unless a row says of what):", "",
        "| habit | rate |", "|---|---|",
        *[f"| {what} | {getattr(POLICIES['ref'], field):.2f} |" for field, what in WRITER_HABITS.items()], "",
        "What that gives on the SFT train split, measured with the gold judge "
        f"({meta['references']['n']} summaries):", "",
        "| measure | value |", "|---|---|",
        *[f"| {name} | {meta['references'][key]:.3g} |" for key, name in REFERENCE_MEASURES.items()], "",
        "A summary that keeps every fact and adds nothing scores about 3.0; the references average "
        f"{meta['references']['gold_score']:.2f}, so a policy can beat them, as RLHF beats human TL;DRs in the paper.", "",
    ]


def card_length(meta):
    """The card's section on length: how often the chosen summary is the longer one."""
    return [
        "## Which summary is preferred: length", "",
        "In the real preference data the chosen summary is slightly the longer one (median 32 against 30 tokens, "
        "the paper's Detail 4). Here the world's mistakes (a copied detail, a loop, a ramble) add "
        f"words: over the {meta['preference_lengths']['n']} train pairs the chosen summary has a median of "
        f"{meta['preference_lengths']['chosen_median_words']} words against "
        f"{meta['preference_lengths']['rejected_median_words']} for the rejected one, and it is the longer one in "
        f"{meta['preference_lengths']['chosen_longer']:.0%} of the pairs whose lengths differ. A reward model can "
        "learn that shorter is better (benchmark/README.md measures what that does to PPO, and a world without the cue).", "",
    ]


def card_policies(meta):
    """The card's section on the policies that wrote the preference pairs (Detail 6)."""
    return [
        "## Policies (Detail 6)", "",
        f"- train pairs are drawn from {', '.join(TRAIN_POLICIES)}",
        f"- validation pairs from all of {', '.join(VALIDATION_POLICIES)}",
        f"- validation_cnndm (news articles) from {', '.join(CNNDM_POLICIES)}", "",
        "Every policy writes like the reference writer, with its own rates (the model-written summaries of "
        "the real dataset also get names wrong and loop). The model policies are models of this world and make "
        "its models' mistakes: they get a name or a thing of a kept fact wrong, and never make up a whole fact, "
        "which only the human writer does now and then. Like its base model they cannot read a feeling off a "
        "post: at their `feeling` rate they state "
        "one drawn at random (the post's own one time in ten), whether the post states one or not. Only the "
        "reference writer, the post's author, states the post's own:", "",
        "| policy | " + " | ".join(POLICY_COLUMNS.values()) + " |", "|---|" + "---|" * len(POLICY_COLUMNS),
        *[f"| {name} | " + " | ".join(f"{getattr(p, field):.2f}" for field in POLICY_COLUMNS) + " |"
          for name, p in POLICIES.items()], "",
    ]


def card_base_model(meta):
    """The card's section on the base model: size, pretraining and its recap skill."""
    return [
        "## Base model", "",
        f"`pythia-tiny/`: GPT-NeoX, {meta['model']['parameters']:,} parameters, "
        f"vocab {meta['model']['vocab_size']}, pretrained for {meta['args']['pretrain_steps']} steps "
        f"(loss {meta['model']['pretrain_loss_first']:.2f} -> {meta['model']['pretrain_loss_last']:.2f}) "
        f"on the world's web text: fresh Reddit-like posts and ({meta['args']['pretrain_news_fraction']:.0%}) news-like "
        "articles, each ending with a recap (\"Edit: to sum up, ...\", \"In short, ...\"); never a dataset row, "
        "a TL;DR, a reference summary or a label. (Its tokenizer's merges, though, are learnt from that text with "
        "the SFT train split's posts and references and the validation split's CNN/DM articles: its vocabulary "
        "knows their words, as a real tokenizer knows the words of the web.) Predicting the recap teaches it to copy facts from its "
        "context; the articles let a reward model trained on Reddit posts transfer to CNN/DM. "
        f"Recapping {meta['args']['recap_posts']} fresh posts greedily, it gets "
        f"{meta['model']['recap_facts_right']:.0%} of their facts right word for word and adds "
        f"{meta['model']['recap_invented']:.3f} key words per recap that the post does not "
        "contain (`recap_skill`): a poor copier's summaries are full of invented facts. "
        f"It was pretrained with dropout {meta['args']['pretrain_dropout']} (Pythia pretrains without), and its "
        f"config sets dropout {meta['args']['dropout']} (Pythia's is 0), so Detail 7 (disable dropout) has a visible effect.",
    ]


# The writer's habits as the card names them (fields of Policy) and the measures of its summaries.
WRITER_HABITS = {"main": "states the main point (the title's fact)", "other": "keeps each other fact",
                 "misremember": "gets a name or a thing wrong, of summaries that keep a fact", "invent": "adds a fact the post never states",
                 "filler": "copies an irrelevant detail, of posts that hold one", "ramble": "rambles on",
                 "repeat": "loops: repeats a clause 1-3 more times, of summaries that state a clause",
                 "feeling": "mentions the feeling, of posts that state one", "question": "ends with a question, one of the five the posts ask drawn at random (not read from the post)",
                 "terse": "writes a fact telegraphically (\"landlord cancelled lease\"), per fact"}
POLICY_COLUMNS = {"main": "main point", "other": "other facts", "misremember": "wrong name or thing (of summaries keeping a fact)",
                  "invent": "invents", "filler": "irrelevant detail (of posts holding one)", "ramble": "rambles",
                  "repeat": "loops (of summaries stating a clause)",
                  "feeling": "feeling (a guess but for ref)", "question": "question", "terse": "telegraphic"}
REFERENCE_MEASURES = {"gold_score": "mean gold score", "coverage": "mean coverage of the post's key words",
                      "with_wrong_or_invented": "share with a key word the post does not contain",
                      "with_irrelevant": "share with an irrelevant detail", "words": "mean words",
                      "words_min": "fewest words", "words_max": "most words"}


def reference_statistics(rows):
    """The gold judge's view of the SFT references (title + post as the post, as the labels use it)."""
    parts = [gold_breakdown(f"{r['title']}\n{r['post']}", r["summary"]) for r in rows]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"n": len(parts), "gold_score": mean([b["score"] for b in parts]),
            "coverage": mean([b["coverage"] for b in parts]),
            "with_wrong_or_invented": mean([b["invented"] > 0 for b in parts]),
            "with_irrelevant": mean([b["irrelevant"] > 0 for b in parts]),
            "words": mean([b["n_words"] for b in parts]), "words_min": min(b["n_words"] for b in parts),
            "words_max": max(b["n_words"] for b in parts)}


def preference_length_statistics(rows):
    """Words of the chosen and the rejected summary of comparison rows: medians, and how often the chosen is longer."""
    lengths = [(len(words(r["summaries"][r["choice"]]["text"])), len(words(r["summaries"][1 - r["choice"]]["text"])))
               for r in rows]
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731  (the upper median: a word count, not a mean)
    differ = [(c, o) for c, o in lengths if c != o]
    return {"n": len(rows), "chosen_median_words": median([c for c, _ in lengths]),
            "rejected_median_words": median([o for _, o in lengths]),
            "chosen_longer": sum(c > o for c, o in differ) / max(1, len(differ))}


@dataclass
class Args:
    out_dir: str
    """Where the world is written (tldr_3_filtered/, summarize_from_feedback/, pythia-tiny/, WORLD.md); required, so
    that no start rebuilds the committed world (assets/tiny_world) by accident: its first step removes world.json"""
    seed: int = 1
    """Seed of everything: same seed, same bytes"""
    sft_sizes: tuple[int, int, int] = (4096, 256, 256)
    """Rows of the SFT dataset: train, validation, test"""
    preference_sizes: tuple[int, int, int] = (16384, 512, 256)
    """Rows of the preference dataset: train, validation (TL;DR), validation (CNN/DM-like news); the main job's
    RM trains 3 passes over the train pairs (benchmark/tiny.sh), the paper's one epoch over 92,858"""
    long_tail_fraction: float = 0.08
    """Share of posts with a long tail of irrelevant paragraphs that overflows the query budget"""
    label_temperature: float = 0.7
    """Bradley-Terry temperature of the preference labels (lower: less noise)"""
    vocab_size: int = 2048
    """BPE vocabulary size, at most: merging stops once every word of the training text is one token (the committed world: 1,276); the model's embedding is rounded up to a multiple of 128, as Pythia's"""
    hidden_size: int = 96
    """Width of the tiny GPT-NeoX"""
    num_layers: int = 3
    """Depth of the tiny GPT-NeoX (2 is the least that can learn to copy from its context; 3 copies far better)"""
    num_heads: int = 4
    """Attention heads of the tiny GPT-NeoX"""
    pretrain_steps: int = 6000
    """Steps of next-token pretraining (0: random weights; the committed world used the default). Copying
    from the context comes late: after 3000 steps the model recapped 56% of a post's facts right, after 6000
    73% (`recap_skill`; real base models copy well, and a poor copier's summaries are full of invented facts)"""
    pretrain_documents: int = 8192
    """Documents (posts and articles) in the pretraining corpus"""
    pretrain_news_fraction: float = 0.5
    """Share of news-like articles in the pretraining corpus (the rest are Reddit-like posts)"""
    pretrain_batch_size: int = 16
    """Documents per pretraining step"""
    pretrain_seq_len: int = 256
    """Longest pretraining document in tokens (longer ones are cut)"""
    pretrain_lr: float = 5e-3
    """Peak learning rate of the pretraining"""
    pretrain_dropout: float = 0.1
    """Dropout while pretraining (Pythia pretrains without). With 0.1 copying comes late and by chance: seed 1
    recaps 73% of the facts right after 6,000 steps (the committed world; an earlier build of seeds 2 and 3: 83% and 99%; seed 1 at one thread: 2% after
    3,000). With 0, seed 1 recaps 85% after 3,000 steps and 99% after 6,000, but its main job's PPO did worse;
    the committed world keeps 0.1
    (benchmark/results/tiny_main_job_notebook.md, "Pretraining without dropout")"""
    dropout: float = 0.1
    """Dropout of the saved model's config (Pythia's is 0): the stages must turn it off (Detail 7), and it shows"""
    recap_posts: int = 200
    """Fresh posts the base model recaps to measure how well it copies (recap_skill, on the card)"""


def build_world(args, with_model=True):
    """Build every file of the world under args.out_dir and return its metadata.

    with_model=False writes only the datasets and the tokenizer (seconds instead of minutes)."""
    start = time.time()
    marker = os.path.join(args.out_dir, "world.json")  # written last: a world without it is not whole (tiny.sh)
    if with_model and os.path.exists(marker):
        os.remove(marker)  # a build over an older world, killed midway, must not look whole
    sft, preference, news_rows, noise = build_datasets(args)
    # The pretraining corpus is this world's "web text": fresh Reddit-like posts and news-like
    # articles (never a dataset row, never a TL;DR, never a label) that end with a recap ("Edit: to
    # sum up, ..." / "In short, ..."). Learning to predict the recap teaches the model to copy facts
    # from earlier in its context, which a tiny model learns only after a few hundred steps of such
    # text; SFT then only has to point that skill at "TL;DR:". Real base models have read news too,
    # which is what lets a reward model trained on Reddit transfer to CNN/DM (Figure 4).
    corpus = pretraining_corpus(random.Random(args.seed + 1), args.pretrain_documents, args.pretrain_news_fraction)
    # Tokenizer: trained on the text the world contains (SFT train posts and references, the CNN/DM
    # articles of the validation split, web text); the card says so.
    texts = [f"{r['title']}\n{r['post']}\nTL;DR: {r['summary']}" for r in sft["train"]]
    texts += [r["info"]["article"] for r in news_rows] + corpus
    tokenizer = train_tokenizer(texts, args.vocab_size)
    model_dir = os.path.join(args.out_dir, "pythia-tiny")
    tokenizer.save_pretrained(model_dir)
    if not with_model:
        return None
    model, losses, recap = build_base_model(args, tokenizer, corpus, model_dir)

    train_rows = preference["train"]
    meta = {
        # where the world was written is not part of what it is (same seed, same datasets anywhere)
        "args": {k: v for k, v in asdict(args).items() if k != "out_dir"},
        "counts": {"tldr_3_filtered": {k: len(v) for k, v in sft.items()},
                   "summarize_from_feedback": {"train": len(train_rows),
                                               "validation (TL;DR)": len(preference["validation"]) - len(news_rows),
                                               "validation (CNN/DM)": len(news_rows)}},
        "references": reference_statistics(sft["train"]),
        "preference_lengths": preference_length_statistics(train_rows),
        "noise_ceiling": noise,
        "model": {"parameters": sum(p.numel() for p in model.parameters()),
                  "vocab_size": model.config.vocab_size, "tokenizer_size": len(tokenizer),
                  "pretrain_loss_first": losses[0], "pretrain_loss_last": losses[-1],
                  "recap_facts_right": recap["facts_right"], "recap_invented": recap["invented_per_recap"]},
    }
    with open(os.path.join(args.out_dir, "WORLD.md"), "w") as f:
        f.write(world_card(json.loads(json.dumps(meta, sort_keys=True))))  # the card of world.json as read back
    for leftover in (".pretraining", ".pretraining.partial"):  # the world is whole: nothing to resume from
        shutil.rmtree(os.path.join(args.out_dir, leftover), ignore_errors=True)
    with open(marker + ".partial", "w") as f:  # then renamed: a kill never leaves half a world.json
        json.dump(meta, f, indent=2, sort_keys=True)
    os.replace(marker + ".partial", marker)
    print(f"tiny world written to {args.out_dir} in {time.time() - start:.1f}s; noise ceiling "
          + ", ".join(f"{k} {v:.3f}" for k, v in meta["noise_ceiling"].items()))
    return meta


def build_datasets(args):
    """Write the SFT and preference datasets -> their rows by split (SFT, preference), the news rows of the
    preference validation split, and the noise ceiling of each preference split."""
    rng = random.Random(args.seed)
    n_train, n_val, n_test = args.sft_sizes
    sft = {"train": build_sft_rows(rng, n_train, args.long_tail_fraction),
           "validation": build_sft_rows(rng, n_val, args.long_tail_fraction),
           "test": build_sft_rows(rng, n_test, args.long_tail_fraction)}
    p_train, p_val, p_news = args.preference_sizes
    common = dict(temperature=args.label_temperature, long_tail_fraction=args.long_tail_fraction,
                  guesses=random.Random(args.seed + 2))  # the guessed feelings' own stream (seed + 1: the corpus')
    train_rows, train_p = build_preference_rows(
        rng, p_train, "train", TRAIN_POLICIES, [f"batch{i}" for i in range(3, 11)], **common)
    val_rows, val_p = build_preference_rows(
        rng, p_val, "validation", VALIDATION_POLICIES, [f"batch{i}" for i in range(11, 23)], **common)
    news_rows, news_p = build_preference_rows(
        rng, p_news, "validation", CNNDM_POLICIES, CNNDM_BATCHES, news=True, **common)
    preference = {"train": train_rows, "validation": val_rows + news_rows}

    write_hub_style_dataset(os.path.join(args.out_dir, "tldr_3_filtered"), None, sft, sft_features(),
                            "# tldr_3_filtered (tiny world)\n\nSynthetic stand-in for "
                            "`vwxyzjn/summarize_from_feedback_tldr_3_filtered`, built by tiny_world.py.")
    write_hub_style_dataset(os.path.join(args.out_dir, "summarize_from_feedback"), "comparisons",
                            preference, preference_features(),
                            "# summarize_from_feedback (tiny world)\n\nSynthetic stand-in for "
                            "`openai/summarize_from_feedback` (config `comparisons`), built by tiny_world.py.")
    noise = {"train": sum(train_p) / len(train_p), "validation": sum(val_p) / len(val_p),
             "validation_cnndm": sum(news_p) / len(news_p)}
    return sft, preference, news_rows, noise


def build_base_model(args, tokenizer, corpus, model_dir):
    """Pretrain the base model on `corpus` and save it to model_dir -> (model, pretraining losses, recap_skill)."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(args.seed)
    config = GPTNeoXConfig(
        vocab_size=128 * math.ceil(len(tokenizer) / 128), hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
        intermediate_size=4 * args.hidden_size, rotary_pct=0.25, max_position_embeddings=2048,
        hidden_dropout=args.pretrain_dropout, attention_dropout=args.pretrain_dropout, tie_word_embeddings=False,
        use_parallel_residual=True, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = GPTNeoXForCausalLM(config)
    documents = [tokenizer(text).input_ids[: args.pretrain_seq_len] + [tokenizer.eos_token_id] for text in corpus]
    checkpoint = os.path.join(args.out_dir, ".pretraining")  # where a killed build continues from (build_world)
    identity = json.loads(json.dumps({k: v for k, v in asdict(args).items() if k != "out_dir"}))  # as JSON reads it
    losses = pretrain(model, documents, tokenizer.pad_token_id, args.pretrain_steps, args.pretrain_batch_size,
                      args.pretrain_lr, args.seed, checkpoint, identity) or [float("nan")]
    # The saved config turns dropout on for whoever loads the model (the modules built above keep theirs).
    model.config.hidden_dropout = model.config.attention_dropout = args.dropout
    model.save_pretrained(model_dir)
    return model, losses, recap_skill(model, tokenizer, args.seed, args.recap_posts)


if __name__ == "__main__":
    import tyro

    build_world(tyro.cli(Args, use_underscores=True))  # --help shows --flag_name as the docs write it; --flag-name works too
