"""Can the reward model steer PPO? The RM against the gold judge on the SFT policy's own samples.

An RM's accuracy on the labelled validation pairs (Figure 4) compares summaries of other policies, which differ in
easy ways (rambling, loops, filler). PPO asks something else of it: to rank samples of ONE policy, the SFT model at
the rollout temperature, which differ in what that policy gets wrong. This script measures that, on the tiny world
(the gold judge is the truth), after benchmark/tiny.sh:

- on-policy agreement: for each validation post, N samples of the SFT policy at temperature 0.7; over every pair of
  samples of a post that both the RM and the gold judge separate, how often they prefer the same one
  (0.5 = the RM ranks a policy's samples at random; PPO can only climb where it is above 0.5), and the same by
  what decides a pair (the gold judge's term that differs most: coverage, invented key words, loops, ...);
- best-of-N (Gao et al. 2023): the gold win rate against the references of the sample the RM picks among the first
  n, beside a random sample and the sample the gold judge would pick (the headroom);
- probes with hand-made summaries of each post (its facts written out): the RM's preference for the true summary
  over the same summary with one actor swapped for one the post never names, with its last fact dropped, with a
  fact the post never states added, with its last fact written twice (a loop); and the SFT model's own likelihood
  on the swap (does the policy know the facts);
  the post's facts with its feeling against the same with another feeling, and, for a post that states no feeling,
  the facts alone against the facts plus a feeling;
- what the SFT policy's samples get wrong: key words the post does not contain (the gold judge's `invented`), by
  kind (actor, verb, object, feeling), and how often a sample states a feeling and the post's one;
- PPO's critic at its start (Detail 22: a copy of the RM, whose outputs before the EOS were never trained, Detail
  13): on these samples, the first TD errors it gives the EOS token (the score less the value before it) and every
  other token (the next value less this one). A large gap between them sets the direction of PPO's first updates:
  the EOS early (shorter summaries) when the EOS's is the larger;
- with --learnability_updates N: can an RM of this architecture, from this SFT model, learn the swap at all? A fresh
  RM trained on nothing but (true, swapped) probe pairs of the SFT train posts, its accuracy on those of the
  validation posts every 50 updates (the world's own pairs teach it the swap, or not, among everything else).

    python benchmark/rm_diagnostics.py                      # models/tiny, data/tiny_tldr, seed 1; ~20 s on 2 cores
    python benchmark/rm_diagnostics.py --models /tmp/m --data /tmp/d --seed 2 --world /tmp/w
    python benchmark/rm_diagnostics.py --learnability_updates 300      # + the swap-only RM (~2.5 min more)

Writes {models}/rm_diagnostics.md (and prints it).
"""

import argparse
import itertools
import os
import random
import re
import sys

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)

FACT = re.compile(r"my (\w+) (\w+) my (\w+)")  # how the tiny world's posts state a fact ("my landlord cancelled my lease")


def pairwise_agreement(rm_scores: list, gold_scores: list) -> tuple:
    """Scores of one prompt's samples by the RM and by the gold judge -> (agreeing pairs, pairs both separate)."""
    agree = total = 0
    for i, j in itertools.combinations(range(len(rm_scores)), 2):
        if rm_scores[i] != rm_scores[j] and gold_scores[i] != gold_scores[j]:
            total += 1
            agree += (rm_scores[i] > rm_scores[j]) == (gold_scores[i] > gold_scores[j])
    return agree, total


def gold_terms(breakdown: dict, world) -> dict:
    """A gold_breakdown -> each term's signed part of its score ({coverage, invented, irrelevant, repetition,
    rambling, empty}; they sum to breakdown["score"])."""
    w = world.JUDGE_WEIGHTS
    penalties = {name: -w[name] * breakdown[name] for name in ("invented", "irrelevant", "repetition", "rambling")}
    return {"coverage": w["coverage"] * breakdown["coverage"], **penalties,
            "empty": -w["empty"] * (breakdown["n_words"] == 0)}


def agreement_by_term(rm_scores: list, gold_scores: list, terms: list) -> dict:
    """One prompt's samples: RM scores, gold scores and gold_terms -> {term: (agreeing pairs, pairs)}, the pairs of
    pairwise_agreement, each counted under the term that decides it: the one whose part of the gold score differs
    most between the two samples (the first such term on a tie)."""
    counts = {}
    for i, j in itertools.combinations(range(len(rm_scores)), 2):
        if rm_scores[i] != rm_scores[j] and gold_scores[i] != gold_scores[j]:
            term = max(terms[i], key=lambda name: abs(terms[i][name] - terms[j][name]))
            agree, total = counts.get(term, (0, 0))
            counts[term] = (agree + ((rm_scores[i] > rm_scores[j]) == (gold_scores[i] > gold_scores[j])), total + 1)
    return counts


def win(score: float, reference_score: float) -> float:
    """1 if the sample beats the reference by the gold judge, 0.5 for a tie, else 0."""
    return 1.0 if score > reference_score else 0.5 if score == reference_score else 0.0


def invented_by_kind(post: str, text: str, world) -> dict:
    """Key words of a summary that its post does not contain, counted by kind: {actor, verb, object, feeling}
    (the gold judge's `invented` term, 0.8 off the score each), plus whether the summary states a feeling and
    whether that is the post's."""
    kinds = {"actor": world.ACTORS, "verb": world.VERBS, "object": world.OBJECTS, "feeling": world.FEELINGS}
    post_words, text_words = set(world.words(post)), set(world.words(text))
    counts = {kind: len((text_words & set(vocabulary)) - post_words) for kind, vocabulary in kinds.items()}
    stated = text_words & set(world.FEELINGS)
    return {**counts, "states_feeling": bool(stated), "feeling_right": bool(stated & post_words)}


def best_of_n(rm_scores: list, gold_scores: list, reference_score: float, n: int) -> dict:
    """One prompt, its first n samples -> {first, rm_best, gold_best}: the win against the reference of the first
    sample, of the one the RM scores highest (the first of equals), of the one the gold judge scores highest."""
    rm_pick = max(range(n), key=lambda k: rm_scores[k])
    return {"first": win(gold_scores[0], reference_score), "rm_best": win(gold_scores[rm_pick], reference_score),
            "gold_best": win(max(gold_scores[:n]), reference_score)}


def critic_start_td(values: torch.Tensor, scores: torch.Tensor, eos_index: torch.Tensor) -> tuple:
    """PPO's first TD errors, before any update (KL 0: the policy is the reference), gamma 1:
    (B, T_resp) values V(s_t) before each response token, (B,) scores after the EOS trick, (B,) EOS indices
    -> ([B] score - V(s_eos) of each EOS token, [sum of EOS indices] V(s_t+1) - V(s_t) of every earlier token)."""
    rows = torch.arange(values.size(0))
    eos = (scores - values[rows, eos_index]).tolist()
    before = torch.arange(values.size(1) - 1)[None, :] < eos_index[:, None]  # (B, T_resp - 1)
    return eos, (values[:, 1:] - values[:, :-1])[before].tolist()


def post_facts(post: str) -> list:
    """The (actor, verb, object) facts a tiny-world post states, in order, each once."""
    facts = []
    for fact in FACT.findall(post):
        if fact not in facts:
            facts.append(fact)
    return facts


def probe_summaries(post: str, rng: random.Random, world) -> dict:
    """Hand-made summaries of a post with at least 2 facts: {true, swapped, dropped, added, looped}; None for fewer."""
    facts = post_facts(post)
    if len(facts) < 2:
        return None
    in_post = set(world.words(post))
    strangers = [actor for actor in world.ACTORS if actor not in in_post]
    write = lambda fs: "; ".join(" ".join(fact) for fact in fs)  # noqa: E731  telegraphic, as the writers do
    k = rng.randrange(len(facts))
    swapped = facts[:k] + [(rng.choice(strangers),) + facts[k][1:]] + facts[k + 1:]
    added = facts + [(rng.choice(strangers), rng.choice(world.VERBS), rng.choice(world.OBJECTS))]
    return {"true": write(facts), "swapped": write(swapped), "dropped": write(facts[:-1]), "added": write(added),
            "looped": write(facts + facts[-1:])}  # the last fact once more: a writer's loop


def feeling_probe(post: str, rng: random.Random, world) -> tuple:
    """(kind, the post's facts with what the post says of its feeling, the same with a feeling it does not state):
    kind "wrong" for a post with a feeling (the other names another), "unstated" for one without (the other adds one);
    None for a post with no fact."""
    facts = post_facts(post)
    if not facts:
        return None
    write = lambda fs: "; ".join(" ".join(fact) for fact in fs)  # noqa: E731
    stated = [w for w in world.FEELINGS if w in set(world.words(post))]
    if stated:
        other = rng.choice([w for w in world.FEELINGS if w not in stated])
        return "wrong", f"{write(facts)}; i feel {stated[0]}", f"{write(facts)}; i feel {other}"
    return "unstated", write(facts), f"{write(facts)}; i feel {rng.choice(world.FEELINGS)}"


def summary_scores(reward_model, tokenizer, queries: list, texts: list) -> torch.Tensor:
    """The RM's scores of summaries (leading space, EOS), one per (query ids, text), as ppo.py scores a rollout:
    the left-padded query followed by the right-padded summary."""
    import ppo

    pad = tokenizer.pad_token_id
    ids = [tokenizer.encode(" " + text + tokenizer.eos_token) for text in texts]
    width = max(map(len, ids))
    responses = torch.tensor([row + [pad] * (width - len(row)) for row in ids])
    queries = torch.tensor(queries)
    return ppo.get_reward(reward_model, torch.cat((queries, responses), 1), pad, queries.shape[1])[1]


def swap_learnability(sft_path: str, train_rows, eval_rows, tokenizer, world, updates: int, seed: int,
                      batch_size: int = 32, lr: float = 1e-3, every: int = 50) -> list:
    """A fresh RM from the SFT model (reward.py's init) trained with the Bradley-Terry loss on (true, swapped) probe
    pairs of `train_rows` only -> [(updates done, accuracy on the probe pairs of `eval_rows`)], every `every`
    updates."""
    import reward

    rng = random.Random(seed)
    torch.manual_seed(seed)
    make = lambda rows: [(row["query_token"], made["true"], made["swapped"])  # noqa: E731
                         for row in rows if (made := probe_summaries(row["post"], rng, world))]
    train, held_out = make(train_rows), make(eval_rows)

    def rewards(pairs: list) -> tuple:
        """(true rewards, swapped rewards) of pairs."""
        scores = summary_scores(model, tokenizer, [query for query, _, _ in pairs for _ in range(2)],
                                [text for _, true, swapped in pairs for text in (true, swapped)])
        return scores[0::2], scores[1::2]

    def accuracy() -> float:
        model.eval()
        with torch.no_grad():
            scored = [rewards(held_out[i:i + 64]) for i in range(0, len(held_out), 64)]
        right = sum(int((true > swapped).sum()) for true, swapped in scored)
        model.train()
        return right / len(held_out)

    model = reward.reward_model_from_sft(sft_path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-5, weight_decay=0.01)
    curve = [(0, accuracy())]
    for update in range(1, updates + 1):
        true, swapped = rewards(rng.sample(train, batch_size))
        loss = -torch.nn.functional.logsigmoid(true - swapped).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if update % every == 0 or update == updates:
            curve.append((update, accuracy()))
    return curve


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="models/tiny", help="benchmark/tiny.sh's MODELS: sft_{seed}, reward_{seed}")
    parser.add_argument("--data", default="data/tiny_tldr", help="benchmark/tiny.sh's DATA: sft/ (validation queries)")
    parser.add_argument("--seed", type=int, default=1, help="the run's seed (names the model folders)")
    parser.add_argument("--world", default=os.path.join(ROOT, "assets", "tiny_world"), help="the world (gold judge)")
    parser.add_argument("--num_prompts", type=int, default=64, help="validation posts")
    parser.add_argument("--samples", type=int, default=16, help="SFT samples per post (N of best-of-N)")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (ppo.py's rollouts: 0.7)")
    parser.add_argument("--response_length", type=int, default=44, help="tokens sampled (benchmark/tiny.sh: 44)")
    parser.add_argument("--learnability_updates", type=int, default=0,
                        help="updates of a swap-only RM (0: skip; 300 show whether the architecture learns it)")
    return parser.parse_args()


def lm_logprob(policy, tokenizer, query: list, text: str) -> float:
    """The SFT model's log-probability of a summary (leading space, EOS) after its query."""
    context = [token for token in query if token != tokenizer.pad_token_id]
    ids = tokenizer.encode(" " + text + tokenizer.eos_token)
    logits = policy(torch.tensor([context + ids])).logits[0, len(context) - 1:-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).sum().item()


def scores_and_first_values(reward_model, queries: torch.Tensor, responses: torch.Tensor, pad: int, eos: int) -> tuple:
    """PPO's view of sampled responses (truncated after their EOS), from one RM forward: ((samples,) scores at the EOS,
    -1 without one, as PPO scores them; (samples, T_resp) the critic's first values, ppo.get_values' slice)."""
    import ppo

    context_length = queries.shape[1]
    reward_logits, scores = ppo.get_reward(reward_model, torch.cat((queries, responses), 1), pad, context_length)
    # Up to the EOS, where critic_start_td reads the values, they do not depend on the tokens after it (causal).
    return ppo.eos_trick(scores, (responses == eos).any(1), -1.0), reward_logits[:, context_length - 1:-1]


def diagnose(rows, policy, reward_model, tokenizer, args: argparse.Namespace, world) -> dict:
    """Sample, score and probe every post: agreement counts, mistakes per sample, best-of-n picks, probe outcomes."""
    from tqdm.auto import tqdm

    import ppo

    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    unsampled = torch.tensor(ppo.unsampled_token_ids(tokenizer, policy.get_output_embeddings().weight.size(0)))
    agree = total = 0
    by_term = {}  # the gold term that decides a pair -> [agreeing pairs, pairs] (agreement_by_term)
    eos_td, token_td = [], []  # critic_start_td of every sample
    mistakes = []  # invented_by_kind of every sample, with whether its post states a feeling
    picks = {n: [] for n in (1, 2, 4, 8, 16, 32) if n <= args.samples}
    probes = {"swapped": [], "dropped": [], "added": [], "looped": [], "policy_swapped": [], "wrong": [], "unstated": []}
    rng, feeling_rng = random.Random(args.seed), random.Random(args.seed + 1)
    with torch.no_grad():
        for row in tqdm(rows, desc="rm diagnostics"):
            queries = torch.tensor(row["query_token"]).repeat(args.samples, 1)
            context_length = queries.shape[1]
            query_responses, _ = ppo.sample_rollout(policy, queries, pad, eos, args.response_length,
                                                    args.temperature + 1e-7, unsampled)
            responses = ppo.truncate_response(query_responses[:, context_length:], eos, pad)
            scores, values = scores_and_first_values(reward_model, queries, responses, pad, eos)
            eos_errors, token_errors = critic_start_td(values, scores, ppo.response_masks(responses, pad, False)[0])
            eos_td += eos_errors
            token_td += token_errors
            scores = scores.tolist()
            texts = [tokenizer.decode([t for t in response.tolist() if t != pad], skip_special_tokens=True)
                     for response in responses]
            post = row["query"]  # the gold judge reads the query, as judge.py gives it
            breakdowns = [world.gold_breakdown(post, text) for text in texts]
            # Rounded: scores equal up to the float rounding of their sums compare equal (as tiny_world.gold_margin)
            gold = [round(breakdown["score"], 9) for breakdown in breakdowns]
            reference = round(world.gold_score(post, row["summary"]), 9)
            a, t = pairwise_agreement(scores, gold)
            agree, total = agree + a, total + t
            for term, (a, t) in agreement_by_term(scores, gold, [gold_terms(b, world) for b in breakdowns]).items():
                counts = by_term.setdefault(term, [0, 0])
                counts[0], counts[1] = counts[0] + a, counts[1] + t
            post_feels = bool(set(world.words(post)) & set(world.FEELINGS))
            mistakes += [{**invented_by_kind(post, text, world), "post_feels": post_feels} for text in texts]
            for n in picks:
                picks[n].append(best_of_n(scores, gold, reference, n))
            made = probe_summaries(row["post"], rng, world)
            if made:
                scores = summary_scores(reward_model, tokenizer, [row["query_token"]] * len(made), list(made.values()))
                true, *others = scores.tolist()
                for name, other in zip(list(made)[1:], others):  # swapped, dropped, added, looped
                    probes[name].append(true > other)
                probes["policy_swapped"].append(lm_logprob(policy, tokenizer, row["query_token"], made["true"])
                                                > lm_logprob(policy, tokenizer, row["query_token"], made["swapped"]))
            if made := feeling_probe(row["post"], feeling_rng, world):
                kind, true, other = made
                true, other = summary_scores(reward_model, tokenizer, [row["query_token"]] * 2, [true, other]).tolist()
                probes[kind].append(true > other)
    return dict(agree=agree, total=total, by_term=by_term, mistakes=mistakes, picks=picks, probes=probes,
                eos_td=eos_td, token_td=token_td)


def mean(xs: list) -> float:
    """The mean of xs, nan when empty."""
    return sum(xs) / len(xs) if xs else float("nan")


def report_lines(found: dict, args: argparse.Namespace, posts: int, sft_path: str, rm_path: str) -> list:
    """The report's lines: on-policy agreement, best-of-n, the samples' mistakes by kind, the probes."""
    agree, total, mistakes, picks, probes = (found[k] for k in ("agree", "total", "mistakes", "picks", "probes"))
    lines = [f"# Can the RM steer PPO? ({rm_path} on {sft_path}'s samples)", "",
             f"{posts} validation posts, {args.samples} samples each at temperature {args.temperature}, "
             f"{torch.get_num_threads()} torch threads.", "",
             f"On-policy agreement of the RM with the gold judge: **{agree / max(1, total):.3f}** over {total} pairs "
             "of samples of the same post that both separate (0.5: the RM ranks the policy's samples at random).", "",
             "The same pairs by what decides them: the gold judge's term (`tiny_world.gold_breakdown`, weighted) that "
             "differs most between the two samples.", "",
             "| deciding term | share of the pairs | the RM agrees with the gold judge |", "|---|---|---|"]
    lines += [f"| {term} | {t / max(1, total):.3f} | {a / t:.3f} |"
              for term, (a, t) in sorted(found["by_term"].items(), key=lambda item: -item[1][1])]
    lines += ["", "| n | gold win rate vs references: first sample | the RM's pick of n | the gold judge's pick of n |",
             "|---|---|---|---|"]
    for n, results in picks.items():
        lines.append(f"| {n} | {mean([r['first'] for r in results]):.3f} | {mean([r['rm_best'] for r in results]):.3f}"
                     f" | {mean([r['gold_best'] for r in results]):.3f} |")
    feels = [m for m in mistakes if m["post_feels"]]
    unfelt = [m for m in mistakes if not m["post_feels"]]
    lines += ["", f"What the SFT policy's samples get wrong ({len(mistakes)} samples): key words the post does not contain, "
              "per sample (the gold judge takes 0.8 off for each).", "",
              "| actor | verb | object | feeling | of the posts with a feeling: the sample states one / the post's | "
              "of the posts without: the sample states one |", "|---|---|---|---|---|---|",
              "| " + " | ".join(f"{mean([m[kind] for m in mistakes]):.3f}" for kind in ("actor", "verb", "object", "feeling"))
              + f" | {mean([m['states_feeling'] for m in feels]):.3f} / {mean([m['feeling_right'] for m in feels]):.3f}"
              f" | {mean([m['states_feeling'] for m in unfelt]):.3f} |"]
    lines += ["", "PPO's critic at its start (Detail 22: the RM, whose outputs before the EOS were never trained, Detail 13) "
              "on these samples: the mean first TD error of the EOS token (the score less the value before it) "
              f"**{mean(found['eos_td']):.3f}**, of every other token (the next value less this one) "
              f"**{mean(found['token_td']):.3f}**. Where the EOS's is the larger, PPO's first updates favour an early "
              "EOS: shorter summaries."]
    names = {"swapped": "the RM prefers it to the same facts with one actor the post never names",
             "dropped": "the RM prefers it to the same facts less the last one",
             "added": "the RM prefers it to the same facts plus one the post never states",
             "looped": "the RM prefers it to the same with its last fact written twice (a loop)",
             "policy_swapped": "the SFT model gives it more likelihood than the one with a swapped actor",
             "wrong": "with the post's feeling, the RM prefers it to the same with another feeling",
             "unstated": "without a feeling (the post states none), the RM prefers it to the same plus one"}
    lines += ["", f"Probes: the post's facts written out ({len(probes['swapped'])} posts with 2 or more facts; the feeling "
              f"probes: {len(probes['wrong'])} posts with a feeling, {len(probes['unstated'])} without).", "",
              "| the true summary: | share |", "|---|---|"]
    return lines + [f"| {names[key]} | {mean(values):.3f} |" for key, values in probes.items()]


def input_problems(args) -> list:
    """The missing inputs, each with the flag that names it (a wrong --data used to end in a traceback)."""
    expected = [("--models", args.models, f"sft_{args.seed}"), ("--models", args.models, f"reward_{args.seed}"),
                ("--data", args.data, "sft")]
    return [f"{flag} {folder}: {os.path.join(folder, name)} not found" for flag, folder, name in expected
            if not os.path.isdir(os.path.join(folder, name))]


def main() -> None:
    args = parse_args()
    problems = input_problems(args)
    if problems:
        sys.exit("\n".join(problems) + "\n--models and --data are benchmark/tiny.sh's MODELS and DATA folders (not their "
                 "sft/ subfolders), and --seed names the models; a run writes them: "
                 "WORLD=W SEED=S MODELS=M DATA=D bash benchmark/tiny.sh")

    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ppo
    import tiny_world as world

    torch.manual_seed(args.seed)
    sft_path, rm_path = (os.path.join(args.models, f"{stage}_{args.seed}") for stage in ("sft", "reward"))
    tokenizer = AutoTokenizer.from_pretrained(sft_path)
    policy = AutoModelForCausalLM.from_pretrained(sft_path, dtype=torch.float32).eval()
    reward_model = ppo.ScalarModel.from_pretrained(rm_path, dtype=torch.float32).eval()
    rows = datasets.load_from_disk(os.path.join(args.data, "sft"))["validation"]
    rows = rows.select(range(min(args.num_prompts, len(rows))))

    found = diagnose(rows, policy, reward_model, tokenizer, args, world)
    lines = report_lines(found, args, len(rows), sft_path, rm_path)
    if args.learnability_updates:
        sft_rows = datasets.load_from_disk(os.path.join(args.data, "sft"))
        curve = swap_learnability(sft_path, sft_rows["train"], sft_rows["validation"], tokenizer, world,
                                  args.learnability_updates, args.seed)
        lines += ["", "Learnability: a fresh RM from the SFT model trained on nothing but (true, swapped) probe pairs "
                  "of the SFT train posts (32 per update, lr 1e-3); its accuracy on those of the validation posts.", "",
                  "| updates | swap accuracy |", "|---|---|"] + [f"| {u} | {a:.3f} |" for u, a in curve]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(args.models, "rm_diagnostics.md"), "w") as file:
        file.write(text)


if __name__ == "__main__":
    main()
