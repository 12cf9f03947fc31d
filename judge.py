"""Judge model summaries against the human reference summaries: the paper's headline win rate.

Reads the sample tables that sft.py, ppo.py and dpo.py write (CSV columns `query, response,
reference`; PPO tables may add the reward model's `score, reference_score`), asks a judge which of
two summaries of a post is better, and reports for every table the win rate against the reference
(or against another table's summaries of the same posts) with a 95% Wilson interval:

    {output_dir}/judgments.jsonl       the cache: one line per judged or failed row, appended the moment it is made
    {output_dir}/results.json          per run: n, win rate, CI, judged, malformed, ties, failed, unjudged, calls,
                                       possibly billed twice, mean lengths, RM agreement; totals and this run's counts
    {output_dir}/results.md            the same as markdown tables: per run, and per method over seeds
    {output_dir}/length_vs_winrate.png win rate against log(summary length / reference length) (Figure 8)
    {output_dir}/judged/<run>.csv      every comparison of this call's runs: A/B order, raw reply, verdict, status, error, lengths, scores
    {output_dir}/args.json             these flags (URL redacted), the prompt version and the git commit (never a key)

    # the tiny world's gold judge: offline, instant, no key
    python judge.py --judge gold --tables sft=models/tiny/sft_1/eval_validation.csv ppo__seed1=models/tiny/ppo_1/eval_validation.csv \
        --output_dir runs/judge_gold
    # an OpenAI judge (key from OPENAI_API_KEY only), PPO also against SFT; the paper's, gpt-3.5-turbo-0125, is gone
    python judge.py --model gpt-5.6-terra --tables sft__seed1=models/tiny/sft_1/eval_validation.csv \
        ppo__seed1=models/tiny/ppo_1/eval_validation.csv --pairs ppo__seed1:sft__seed1
    # any OpenAI-compatible server (vLLM, llama.cpp ...): OPENAI_API_KEY=unused for a keyless one
    python judge.py --base_url http://127.0.0.1:8000/v1 --model Qwen/Qwen2.5-7B-Instruct \
        --tables dpo=models/tiny/dpo_1/eval_validation.csv

Run labels are `<method>` or `<method>__seed<seed>` (`sft`, `ppo__seed1`); results.md averages
each method over its seeds. Unlike the reference judge (eval/oai.py: a blocking sleep in async code,
an unseeded and unrecorded A/B shuffle, the API's default temperature, a verdict not exactly A or B counted
for the reference), the A/B order is drawn per row from a seed and recorded, the temperature is
fixed and recorded, a malformed verdict counts for neither side (a tie of the gold judge counts 1/2,
as a forced choice between equals would), and no paid call is repeated: the
cache is keyed by (model, prompt version, temperature, post, summary A, summary B), so a rerun after
a crash, Ctrl-C or SIGTERM (SLURM, `timeout`) asks only what is missing.

Faults. A row that fails for good (a 400, retries spent on 429/5xx/timeouts, an HTTP 200 whose body
is not JSON or has no choices) is recorded as failed and the run goes on; the next
--failed_row_retries runs ask it again. A call abandoned at the timeout (or a 200 without a usable
reply) may have been billed: every later call for that row is counted as `possibly_billed_twice`.
A fault no row can get past (401, 403, 404, 410, an exhausted quota, server unreachable, the same 400 on the first 3
rows asked with no verdict yet under these settings) stops the run. Results are written
in every case: the cache is append-only (a line torn by a kill is skipped and that row asked again),
every other file is written beside and renamed into place. Keys come from OPENAI_API_KEY only;
credentials inside --base_url (user:password@, query values) are redacted wherever text is written.
Exit status: 0 every row answered (or the --max_new_judgments budget spent: results.md counts the rows left);
1 bad flags or a stopped run; 3 finished with failed rows.

Details: 17 (agreement of the reward model's ordering with the judge, when scores are present).
Printed: a progress bar, then the results tables (results.md) and the call counts.
"""

import asyncio
import base64
import collections
import csv
import io
import hashlib
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
import urllib.parse
from dataclasses import asdict, dataclass
from typing import Literal, Optional

import openai
import tyro
from tqdm import tqdm


@dataclass
class Args:
    """Judge sample tables against their reference summaries (see the module docstring of judge.py)."""

    # experiment & output
    output_dir: str = "runs/judge"
    """Folder for judgments.jsonl (the cache: reuse the folder to resume), results, plot and args.json"""

    # data
    tables: tuple[str, ...] = ()
    """Sample tables as LABEL=PATH.csv (LABEL: `sft`, `ppo__seed1` ...; columns query, response, reference)"""
    pairs: tuple[str, ...] = ()
    """Head-to-head runs as OURS:OTHER labels of --tables (e.g. ppo__seed1:sft__seed1), rows matched by query"""
    reference: bool = True
    """Judge every table against its human reference summaries (off: only --pairs)"""
    n: int = -1
    """Judge the first n rows of each table (-1: all; the paper judged the whole validation split)"""

    # judge
    judge: Literal["openai", "gold"] = "openai"
    """`openai`: an LLM through any OpenAI-compatible server; `gold`: the tiny world's gold_score"""
    model: Optional[str] = None
    """Judge model name sent to the server, required with --judge openai (paper: GPT-3.5 Turbo, in the reference gpt-3.5-turbo-0125, which OpenAI shut
    down on 2026-10-23: any judge today is another judge, and its win rates are not on the paper's scale)"""
    base_url: Optional[str] = None
    """OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (None: $OPENAI_BASE_URL, else api.openai.com);
    credentials in it (user:password@, ?key=) are sent but written nowhere"""
    temperature: float = 1.0
    """Judge sampling temperature, recorded and part of the cache key (the paper states none; 1.0 is the API default,
    which the reference left in place; a greedy judge, 0, pushes win rates away from 0.5)"""
    seed: int = 1
    """Seed of the per-row A/B order draw (same seed: same order, so a rerun hits the cache)"""

    # calling
    max_concurrency: int = 8
    """Calls in flight at once (the reference used 11 for gpt-3.5 to stay under the token rate limit)"""
    timeout: float = 60.0
    """Seconds one call may take before it is abandoned and retried"""
    max_retries: int = 6
    """Retries of one call on 408/409/429, 5xx, timeouts and connection errors; then the row is recorded as failed
    (an unreachable server stops the run)"""
    retry_base_delay: float = 1.0
    """First backoff delay in seconds; doubles each retry, with jitter in [1/2, 1] of it"""
    retry_max_delay: float = 60.0
    """Cap of one backoff delay in seconds (also caps a server's Retry-After)"""
    max_new_judgments: int = -1
    """Stop after this many new (uncached) judgments, e.g. to bound the cost of one run (-1: no limit)"""
    failed_row_retries: int = 2
    """Later runs that ask a failed row again (400, retries spent, unusable reply); then it stays failed (0: never)"""

    # report
    length_bins: int = 10
    """Equal-width bins of log(summary length / reference length) in the length plot (reference: 10)"""


# ------------------------------------------------------------------------------------------------
# The prompt (paper, Appendix I, modified by the authors from Rafailov et al. 2023), as the appendix prints it
# without its line-end backslashes. The reference's eval/oai.py sent a variant: `### Post:`-style headers, one
# literal backslash (a raw string); docs/details.md lists the differences.
# Bump PROMPT_VERSION whenever the text changes: it is part of every cache key.
# ------------------------------------------------------------------------------------------------
PROMPT_VERSION = "appendix-i-v1"
SYSTEM_PROMPT = "You are a helpful assistant."  # the reference's system message
JUDGE_PROMPT = """Which of the following summaries does a better job of summarizing the most important points in the given forum post, without including unimportant or irrelevant details? Judge based on accuracy, coverage, and coherence.

Post:
{post}

Summary A:
{summary_a}

Summary B:
{summary_b}

FIRST provide a one-sentence comparison of the two summaries, explaining which you prefer and why. SECOND, on a new line, state only "A" or "B" to indicate your choice. Your response should use the format:

Comparison: <one-sentence comparison and explanation>
Preferred: <"A" or "B">"""
# gold-v2: scores equal up to float rounding are a tie (tiny_world.gold_difference); gold-v1 let the rounding decide
GOLD_MODEL, GOLD_PROMPT_VERSION = "tiny_world.gold_score", "gold-v2"
PAPER_MODEL = "gpt-3.5-turbo-0125"  # the paper's judge (GPT-3.5 Turbo, Appendix I; this version in the reference's eval/oai.py); shut down by OpenAI on 2026-10-23
EOS_TEXT = "<|endoftext|>"
LABEL_RE = re.compile(r"[\w.-]+")
Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile


def ours_is_a(seed: int, row: int) -> bool:
    """Whether our summary is shown as A in comparison `row`: a fair coin seeded by (seed, row).

    String seeds hash with SHA-512, so the draw is the same in every process and on every rerun."""
    # GPT-3.5 favours one position; a fair coin per comparison turns that bias into noise that
    # cancels on average (paper, Appendix I, after Wang et al. 2023 and Zheng et al. 2023).
    return random.Random(f"{seed}-{row}").random() < 0.5


def make_items(label: str, ours_rows: list[dict], other_rows: Optional[list[dict]], seed: int) -> list[dict]:
    """Comparisons of a run: ours vs the reference (other_rows None) or vs another table, matched by query."""
    by_query = {row["query"].strip(): row for row in other_rows} if other_rows is not None else None
    items = []
    for i, row in enumerate(ours_rows):
        post = row["query"].strip()  # the reference shows the whole query: SUBREDDIT, TITLE, POST, TL;DR:
        if by_query is None:
            # The reference column has no EOS, but an older table might: cut at it to be safe.
            other, other_score = row["reference"].split(EOS_TEXT)[0].strip(), optional_float(row, "reference_score")
        elif post in by_query:
            other, other_score = by_query[post]["response"].strip(), optional_float(by_query[post], "score")
        else:
            continue  # the other run has no sample for this post
        items.append(dict(label=label, row=i, post=post, ours=row["response"].strip(), other=other,
                          ours_score=optional_float(row, "score"), other_score=other_score,
                          ours_is_a=ours_is_a(seed, i)))
    return items


def build_prompt(post: str, summary_a: str, summary_b: str) -> str:
    """The Appendix I prompt, filled in one pass (a post containing `{summary_a}` stays as written)."""
    values = {"post": post, "summary_a": summary_a, "summary_b": summary_b}
    return re.sub(r"\{(post|summary_a|summary_b)\}", lambda m: values[m.group(1)], JUDGE_PROMPT)


def judgment_key(model: str, prompt_version: str, temperature: Optional[float], post: str, a: str, b: str) -> str:
    """Cache key of one judgment: SHA-256 of everything that decides the judge's answer (A/B order included)."""
    blob = json.dumps([model, prompt_version, temperature, post, a, b], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def parse_verdict(reply: Optional[str], allow_tie: bool = False) -> Optional[str]:
    """"A" or "B" from exactly one line `Preferred: A|B` (or "tie" if allowed); None when malformed.

    The answer may carry what the prompt's own format line and markdown put around it (`Preferred: "A"`,
    `**Preferred:** A`, `**Preferred**: A`, `Preferred: Summary B.`); anything else is malformed: `a`, `A or B`,
    two Preferred lines or none (the reference counted a verdict other than a bare A or B for the reference
    summary, and gave a reply without a Preferred line a random one)."""
    lines = [line.strip().lstrip("*_# ") for line in (reply or "").splitlines()]
    lines = [re.sub(r"^Preferred[*_]+:", "Preferred:", line) for line in lines]  # `**Preferred**: A`
    lines = [line for line in lines if line.startswith("Preferred:")]
    if len(lines) != 1:
        return None
    value = lines[0].removeprefix("Preferred:").strip(" *_\"'`").removesuffix(".").strip(" *_\"'`")
    value = value.removeprefix("Summary ")
    return value if value in ("A", "B") or (allow_tie and value == "tie") else None


def cached_verdict(record: dict) -> Optional[str]:
    """A judged record's verdict, parsed again from its reply: a cache written by an older, stricter parse_verdict
    then counts as a new one would (the reply is what was paid for; the stored verdict is a convenience)."""
    if "reply" not in record:
        return record.get("verdict")
    return parse_verdict(record["reply"], allow_tie=record.get("verdict") == "tie" or record.get("model") == GOLD_MODEL)


def preferred_side(verdict: Optional[str], ours_a: bool, other_name: str) -> str:
    """Map a verdict in A/B terms to "ours", `other_name` ("reference" or "other"), "tie" or "malformed"."""
    if verdict is None:
        return "malformed"
    if verdict == "tie":
        return "tie"
    return "ours" if verdict == ("A" if ours_a else "B") else other_name


def wilson_interval(wins: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (better than p +- z*se near 0, 1 and small n)."""
    # The plain p +- z*se interval leaves [0, 1] and undercovers at small n (a length bin, a pilot
    # run of 64 rows); Wilson's interval inverts the score test and behaves at both.
    p = wins / n  # n > 0
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (center - half, center + half)


def rm_agreement(preferred: list[str], ours_scores: list, other_scores: list) -> tuple[Optional[float], int]:
    """Fraction of decided judgments ("ours" or the other side) where score ordering agrees; and their count."""
    # Detail 17: Agreement with an LLM judge
    # The RM "prefers ours" iff score > other score (strict, as the reference's eval/analyze_rm.py:
    # an RM tie agrees with nobody). Malformed verdicts, gold ties and rows without scores do not count.
    agree = [s > o if p == "ours" else s < o for p, s, o in zip(preferred, ours_scores, other_scores)
             if p not in ("malformed", "tie", "unjudged") and s is not None and o is not None]
    return (sum(agree) / len(agree) if agree else None), len(agree)


def summarize(rows: list[dict], other_name: str) -> dict:
    """Per-run statistics from rows (keys status, preferred, ours_words, other_words, ours_score, other_score).

    status: "judged" (the judge replied), "failed" (no reply: counted, asked again by a rerun) or
    "unjudged" (not asked yet); preferred: "ours", `other_name`, "tie", "malformed", or "unjudged" without a reply."""
    preferred, status = [r["preferred"] for r in rows], [r["status"] for r in rows]
    wins, losses, ties = preferred.count("ours"), preferred.count(other_name), preferred.count("tie")
    # A tie (the gold judge's two equal scores) counts 1/2: the paper's judge must pick A or B, and
    # picks either of two equal summaries about half the time. Leaving ties out would push every
    # rate away from 0.5 and rest it on fewer posts than were judged.
    # A malformed verdict counts for neither side: the reference counted a verdict other than a
    # bare A or B as a loss, which pulls every win rate down by that fraction.
    n, score = wins + losses + ties, wins + ties / 2
    low, high = wilson_interval(score, n) if n else (None, None)
    agreement, n_agreement = rm_agreement(preferred, [r["ours_score"] for r in rows], [r["other_score"] for r in rows])
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return dict(n=n, wins=wins, win_rate=score / n if n else None, ci_low=low, ci_high=high,
                judged=status.count("judged"), malformed=preferred.count("malformed"), ties=ties,
                failed=status.count("failed"), unjudged=status.count("unjudged"), rows=len(rows),
                mean_words=mean([r["ours_words"] for r in rows]), mean_other_words=mean([r["other_words"] for r in rows]),
                rm_agreement=agreement, n_rm_agreement=n_agreement)


def gold_reply(post: str, summary_a: str, summary_b: str) -> str:
    """The tiny world's gold judge as a reply in the LLM's format (`Preferred: tie` when the scores are equal, up to
    float rounding: tiny_world.gold_difference)."""
    import tiny_world  # off the training path and only needed here: `import judge` stays light

    score_a, score_b = tiny_world.gold_score(post, summary_a), tiny_world.gold_score(post, summary_b)
    margin = tiny_world.gold_difference(score_a, score_b)
    verdict = "A" if margin > 0 else "B" if margin < 0 else "tie"
    return f"Comparison: gold score of summary A {score_a:.4f}, of summary B {score_b:.4f}.\nPreferred: {verdict}"


def length_bin_edges(log_ratios: list[float], bins: int) -> list[float]:
    """bins + 1 equally spaced edges from the smallest to the largest log length ratio of every run (one unit wide
    around them when they are all equal)."""
    low, high = (min(log_ratios), max(log_ratios)) if log_ratios else (0.0, 0.0)
    low, high = (low - 0.5, high + 0.5) if high - low < 1e-9 else (low, high)
    return [low + (high - low) * k / bins for k in range(bins + 1)]


def log_length_ratio(ours_words: int, other_words: int) -> float:
    """Figure 8's x: log(our summary's words / the other's), empty summaries counted as one word (kept on the plot)."""
    return math.log(max(1, ours_words) / max(1, other_words))


def length_curve(log_ratios: list[float], preferred: list[str], edges: list[float], other_name: str) -> list:
    """[(bin center, win rate, count)] of judgments (a tie 1/2, a malformed one left out) per bin of log length ratio
    (empty bins skipped)."""
    counts = [[0.0, 0] for _ in range(len(edges) - 1)]  # [wins, judged] per bin
    for x, p in zip(log_ratios, preferred):
        if p in ("ours", other_name, "tie"):
            i = min(max(0, sum(x >= e for e in edges[1:-1])), len(counts) - 1)
            counts[i][0] += 1.0 if p == "ours" else 0.5 if p == "tie" else 0.0
            counts[i][1] += 1
    return [((edges[i] + edges[i + 1]) / 2, wins / total, total)
            for i, (wins, total) in enumerate(counts) if total]


def judged_rows(run: dict, cache: dict) -> list[dict]:
    """One row per comparison of `run`: status, verdict, the side preferred, lengths, scores, reply and calls."""
    # A cached verdict is in A/B terms; `ours_is_a` maps it back to ours or the other side.
    judged = []
    for item in run["items"]:
        record = cache.get(item["key"])
        status = record.get("status", "judged") if record else "unjudged"
        status = status if status in ("judged", "failed") else "unjudged"  # never asked, or abandoned
        verdict = cached_verdict(record) if status == "judged" else None
        counts = row_totals(record)
        judged.append(dict(
            row=item["row"], ours_is_a=item["ours_is_a"], verdict=verdict,
            preferred=preferred_side(verdict, item["ours_is_a"], run["other_name"])
            if status == "judged" else "unjudged",
            status=status, ours_words=len(item["ours"].split()), other_words=len(item["other"].split()),
            ours_score=item["ours_score"], other_score=item["other_score"],
            post=item["post"], ours=item["ours"], other=item["other"], reply=(record or {}).get("reply") or "",
            error=(record or {}).get("error") or "", calls=counts["calls"],
            possibly_billed_twice=counts["billed_twice"]))
    return judged


def main() -> None:
    """The judge, top to bottom (run at the end of the file, once the plumbing below the fence is defined)."""
    args = tyro.cli(Args, use_underscores=True)  # --help shows --flag_name as the docs write it; --flag-name works too
    # 1. Flags, tables, the endpoint and the key: all checked before anything is written.
    tables, rows, endpoint, secrets = read_inputs(args)

    # 2. The comparisons: every table against its references (Figure 1), then each pair head to head.
    comparisons = {}  # run name -> its items (one per row), the other side's name, our label, what we face
    if args.reference:
        for label in tables:
            comparisons[label] = dict(items=make_items(label, rows[label], None, args.seed),
                                      other_name="reference", ours_label=label, vs="reference")
    for pair in args.pairs:
        ours, _, other = pair.partition(":")
        name = f"{ours}_vs_{other}"
        items = make_items(name, rows[ours], rows[other], args.seed)
        print(f"{name}: {len(items)} of {len(rows[ours])} posts of {ours} also sampled by {other}")
        comparisons[name] = dict(items=items, other_name="other", ours_label=ours, vs=other)

    # 3. The judge: the tiny world's gold score (which may tie), or an LLM that must answer A or B.
    if args.judge == "gold":
        meta = dict(model=GOLD_MODEL, prompt_version=GOLD_PROMPT_VERSION, temperature=None, allow_tie=True)
    else:
        meta = dict(model=args.model, prompt_version=PROMPT_VERSION, temperature=args.temperature, allow_tie=False)

    # 4. Ask it what the cache does not hold yet; each answer is on disk the moment it arrives.
    cache_path, cache = start_outputs(args, meta)
    todo = rows_to_ask(args, comparisons, cache, meta, endpoint)
    run_id = time.time()  # marks this run's records in the cache
    stopped = ask_judge(args, endpoint, todo, cache, cache_path, meta, run_id, secrets)

    # 5. Win rates with Wilson intervals, RM agreement (Detail 17) and the length curves (Figure 8),
    # recomputed from the cache every time: a run resumed after a crash reports exactly what one
    # uninterrupted run would have.
    runs, log_ratios, failures = {}, {}, []
    for name, run in comparisons.items():
        judged = judged_rows(run, cache)
        write_judged_table(args.output_dir, name, judged)
        failures += failed_rows(name, run, cache, args.failed_row_retries)
        method, seed = parse_run_label(run["ours_label"])
        runs[name] = dict(method=method, seed=seed, vs=run["vs"], table=tables[run["ours_label"]],
                          **summarize(judged, run["other_name"]), calls=sum(j["calls"] for j in judged),
                          possibly_billed_twice=sum(j["possibly_billed_twice"] for j in judged))
        if run["vs"] == "reference":
            # Words, not tokens: the tables hold text only.
            log_ratios[name] = ([log_length_ratio(j["ours_words"], j["other_words"]) for j in judged],
                                [j["preferred"] for j in judged])
    drop_other_judged_tables(args.output_dir, comparisons)  # judged/ holds this call's runs, as results.md does
    write_results(args, meta, runs, log_ratios, failures, run_counts(comparisons, cache, todo, run_id, stopped))
    exit_with_status(stopped, failures, cache_path, args.failed_row_retries)


# ---- plumbing and fast paths: no Detail below ----


# Inputs: flags and tables checked before any write; credentials kept out of every written text.
def read_inputs(args: Args) -> tuple[dict, dict, Optional[str], list[str]]:
    """(label -> path, label -> rows, endpoint, secrets to scrub); exits naming each bad input, writing nothing."""
    problems = flag_problems(args)
    endpoint = None  # the judge's URL as given (it may hold credentials): sent, never written
    if args.judge == "openai":
        endpoint = args.base_url or os.environ.get("OPENAI_BASE_URL") or None
        if args.base_url is None and endpoint is not None and not endpoint_is_valid(endpoint):
            problems.append("$OPENAI_BASE_URL (not shown: it may hold a key): want http(s)://host[:port][/path]")
        key = os.environ.get("OPENAI_API_KEY")  # read here and by the client only, never written anywhere
        if not key:
            problems.append("OPENAI_API_KEY is not set: set it (any non-empty value for a local server without keys)")
        elif key != key.strip():  # an illegal header value: every call would fail as a "connection error"
            problems.append("OPENAI_API_KEY (not shown) begins or ends with whitespace, e.g. the newline of "
                            "`$(cat keyfile)` from a file written on Windows: set it without")
    # Scrubbed from every text written or printed: replies, errors, tracebacks.
    secrets = url_secrets(endpoint) + url_secrets(os.environ.get("OPENAI_BASE_URL")) + \
        [os.environ.get("OPENAI_API_KEY", "")]
    tables = dict(parse_table_spec(spec) for spec in args.tables) if not problems else {}
    rows = {}
    columns = ("query", "response", "reference") if args.reference else ("query", "response")
    for label, path in tables.items():
        try:
            rows[label] = read_table(path, args.n, columns)
        except (OSError, ValueError, csv.Error) as error:  # UnicodeDecodeError is a ValueError
            problems.append(f"--tables {label}={path}: {error}")
    if args.judge == "gold":  # its score means something for the tiny world's posts only
        problems += [f"--tables {label}={tables[label]}: {problem}" for label in rows
                     for problem in [not_the_tiny_world(rows[label])] if problem]
    if problems:
        sys.exit("judge.py: cannot start (nothing was written):\n  " +
                 "\n  ".join(scrub(p, secrets) for p in problems))
    for note in input_notes(args, rows):
        print(f"note: {note}")
    return tables, rows, endpoint, secrets


def not_the_tiny_world(rows: list[dict]) -> Optional[str]:
    """Why these rows' posts are not the tiny world's (the first holding words none of its queries can hold), for
    the gold judge, which would score a real post's summary as confidently as a world's; None if they all are."""
    import tiny_world  # off the training path and only needed here: `import judge` stays light

    # Every word a world query can hold: its templates', its word lists', the query format's (seeds change none).
    texts = [*tiny_world.SUBREDDITS, *tiny_world.KEY_WORDS, *tiny_world.FILLER_WORDS, *tiny_world.FACT_SENTENCES,
             *tiny_world.FILLER_SENTENCES, *tiny_world.FEELING_SENTENCES, *tiny_world.QUESTIONS, *tiny_world.OPENERS,
             tiny_world.RECAP_OPENER, "and", "SUBREDDIT: r/ TITLE: POST: TL;DR:"]
    vocabulary = {word for text in texts for word in tiny_world.words(text)}
    for i, row in enumerate(rows):
        foreign = sorted({word for word in tiny_world.words(row["query"]) if word not in vocabulary})
        if foreign:
            return (f"data row {i}'s post is not the tiny world's (it holds {', '.join(map(repr, foreign[:4]))}"
                    f"{', ...' if len(foreign) > 4 else ''}, words no world post holds): --judge gold scores the tiny "
                    "world's summaries only; judge these with --judge openai")
    return None


def input_notes(args: Args, rows: dict) -> list[str]:
    """What a start may not mean and still runs: flags the gold judge reads none of, a seed label the results
    will not group, a query in two rows of a table, tables of different lengths (win rates over different posts)."""
    notes = []
    if args.judge == "gold" and (args.model is not None or args.base_url is not None or args.temperature != 1.0):
        notes.append("--judge gold scores with tiny_world.gold_score: --model, --base_url and --temperature are unused")
    for label in rows:
        if parse_run_label(label)[1] is None and re.search(r"(?<!_)_seed\d+$", label):
            notes.append(f"label {label}: seeds are written with two underscores ({label.replace('_seed', '__seed')}); "
                         "as it is, it is a method of its own in results.md")
    for label, table in rows.items():
        first_row, repeats = {}, []  # query -> the row it first appears in; (row, first row) of each repeat
        for i, row in enumerate(table):
            first = first_row.setdefault(row["query"].strip(), i)
            if first != i:
                repeats.append((i, first))
        if repeats:
            notes.append(f"table {label}: {len(repeats)} row(s) repeat an earlier row's query (data row {repeats[0][0]} "
                         f"repeats row {repeats[0][1]}...): each row is a comparison against the references, and "
                         "in a pair against this table the last row of a query is the one compared")
    lengths = {label: len(table) for label, table in rows.items()}
    if len(set(lengths.values())) > 1:
        notes.append(f"the tables hold different numbers of posts ({', '.join(f'{k} {v}' for k, v in lengths.items())}): "
                     "each win rate is over its own table's posts")
    return notes


def flag_problems(args: Args) -> list[str]:
    """One line per flag that cannot work (named, with what to pass instead); empty when all can."""
    # Checked before anything is written, so a typo leaves no folder or file behind.
    problems, labels = [], []
    for spec in args.tables:
        try:
            label, path = parse_table_spec(spec)
        except ValueError as error:
            problems.append(str(error))
            continue
        labels.append(label)
        if not os.path.isfile(path):
            problems.append(f"--tables {spec}: no file {path}")
    if not args.tables or len(set(labels)) != len(labels):
        problems.append("--tables: pass LABEL=PATH.csv ... with distinct labels")
    for pair in args.pairs:
        ours, sep, other = pair.partition(":")
        if not sep or ours not in labels or other not in labels:
            problems.append(f"--pairs {pair}: want OURS:OTHER, both labels of --tables {labels}")
        elif ours == other:
            problems.append(f"--pairs {pair}: a table against itself; want two different labels of --tables")
    # Each comparison's results go under its name: a table's (vs the references) or OURS_vs_OTHER (a pair).
    names = (list(dict.fromkeys(labels)) if args.reference else []) + [pair.replace(":", "_vs_", 1) for pair in args.pairs]
    clashes = sorted({name for name in names if names.count(name) > 1})
    if clashes:
        problems.append(f"--tables / --pairs: two comparisons would be saved as {', '.join(clashes)} (a pair OURS:OTHER "
                        "is saved as OURS_vs_OTHER, a table by its label): rename a label or drop the repeated pair")
    if not args.reference and not args.pairs:
        problems.append("--no_reference without --pairs: nothing to compare; keep --reference or pass --pairs")
    checks = [("n", args.n == -1 or args.n >= 1, "-1 (all rows) or >= 1"),
              ("temperature", 0 <= args.temperature <= 2, "a number in [0, 2]"),
              ("max_concurrency", args.max_concurrency >= 1, ">= 1"),
              ("timeout", 0 < args.timeout < math.inf, "seconds > 0"),
              ("max_retries", args.max_retries >= 0, ">= 0"),
              ("retry_base_delay", 0 <= args.retry_base_delay < math.inf, "seconds >= 0"),
              ("retry_max_delay", args.retry_base_delay <= args.retry_max_delay < math.inf,
               "seconds >= --retry_base_delay"),
              ("max_new_judgments", args.max_new_judgments >= -1, "-1 (no limit) or >= 0"),
              ("failed_row_retries", args.failed_row_retries >= 0, ">= 0"),
              ("length_bins", args.length_bins >= 1, ">= 1"),
              ("model", args.judge == "gold" or args.model is None or bool(args.model.strip()), "a model name")]
    problems += [f"--{flag} {getattr(args, flag)}: want {want}" for flag, ok, want in checks if not ok]
    if args.judge == "openai" and args.model is None:
        problems.append(f"--model: required with --judge openai. The paper's judge, {PAPER_MODEL}, was shut down by "
                        "OpenAI on 2026-10-23; name a current model (--model gpt-5.6-terra, say) or your server's "
                        "(--base_url). Its win rates are not on the paper's scale: compare runs judged alike")
    if args.base_url is not None and not endpoint_is_valid(args.base_url):
        # Not echoed: a URL that does not parse may still hold a key.
        problems.append("--base_url (not shown: it may hold a key): want http(s)://host[:port][/path]")
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        problems.append(f"--output_dir {args.output_dir} is a file: choose a folder")
    return problems


def parse_table_spec(spec: str) -> tuple[str, str]:
    """`LABEL=PATH` -> (label, path); the label becomes a file name, so it is `[\\w.-]+`."""
    label, sep, path = spec.partition("=")
    if not sep or not LABEL_RE.fullmatch(label) or not path:
        raise ValueError(f"--tables entry {spec!r}: want LABEL=PATH.csv with LABEL made of letters, digits, _ . -")
    return label, path


def read_table(path: str, n: int, columns: tuple) -> list[dict]:
    """The first n rows (-1: all) of a sample CSV as dicts; empty cells stay empty strings.

    Raises ValueError naming the file, the row and the column of anything make_items cannot read."""
    with open(path, newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    if not rows:
        raise ValueError(f"{path}: no data rows")
    missing = set(columns) - set(rows[0])
    if missing:
        raise ValueError(f"{path}: missing columns {sorted(missing)} (want {', '.join(columns)})")
    rows = rows if n < 0 else rows[:n]
    for i, row in enumerate(rows):
        if None in row or None in row.values():  # csv.DictReader's filler for a row longer / shorter than the header
            fields = sum(value is not None for key, value in row.items() if key is not None) + len(row.get(None, []))
            raise ValueError(f"{path}: data row {i} has {fields} field(s), the header {len(row) - (None in row)}; quote "
                             "cells that hold commas or newlines")
        for column in ("score", "reference_score"):
            try:
                optional_float(row, column)
            except ValueError:
                raise ValueError(f"{path}: data row {i}, column {column}: {row[column]!r} is not a number") from None
    return rows


def optional_float(row: dict, column: str) -> Optional[float]:
    """A numeric cell, or None when the column is absent or empty."""
    value = row.get(column, "")
    return float(value) if value not in ("", None) else None


def endpoint_is_valid(url: str) -> bool:
    """Whether `url` is an http(s) URL with a host (and a numeric port if any)."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError on a port that is not a number)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def redact_url(url: Optional[str]) -> Optional[str]:
    """`url` safe to write: user:password@ becomes ***@, every query value ***, the fragment goes."""
    # Every query value, not a list of secret names (key, api_key, token ...): a list always misses
    # one (sig=, code=, x-goog-api-key=). A bare `?TOKEN` becomes `?***`.
    if url is None:
        return None
    parts = urllib.parse.urlsplit(url)
    netloc = ("***@" if "@" in parts.netloc else "") + parts.netloc.rpartition("@")[2]
    query = "&".join(f"{p.partition('=')[0]}=***" if "=" in p else "***" for p in parts.query.split("&") if p)
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def url_secrets(url: Optional[str]) -> list[str]:
    """The credentials inside `url` (user, password, query values, fragment), raw, decoded and as Basic auth."""
    if url is None:
        return []
    parts = urllib.parse.urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    found = userinfo.split(":", 1) if userinfo else []
    found += [p.partition("=")[2] if "=" in p else p for p in parts.query.split("&") if p] + [parts.fragment]
    found += [urllib.parse.unquote(s) for s in found]
    if userinfo:  # httpx sends user:password as `Authorization: Basic base64(...)`: a server may echo it
        found.append(base64.b64encode(urllib.parse.unquote(userinfo).encode()).decode())
    return found


def scrub(text: Optional[str], secrets: list[str]) -> Optional[str]:
    """`text` with every secret of 6 or more characters replaced by ***, and so its masked forms (a run of *
    then the secret's last 4 characters, as OpenAI's 401 quotes a wrong key: `sk-proj-****...abcd`)."""
    # Shorter strings are not keys, and replacing them would mangle the text (a user `A` would eat
    # the verdict of `Preferred: A`). Longest first: a secret containing another goes whole.
    for secret in sorted(set(secrets), key=len, reverse=True):
        if text is not None and len(secret) >= 6:
            text = text.replace(secret, "***")
            text = re.sub(r"[^\s*]*\*{3,}" + re.escape(secret[-4:]), "***", text)
    return text


def split_endpoint(url: Optional[str]) -> tuple[Optional[str], dict]:
    """(`url` without its query and fragment, the query as a dict) for the client's base_url and default_query."""
    if url is None:
        return None, {}
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")), query


# The cache: one appended line per judged or failed row, so no paid call is repeated.
def start_outputs(args: Args, meta: dict) -> tuple[str, dict]:
    """Create the output folder, write args.json (URL redacted, no key), read the cache: (its path, key -> record)."""
    try:
        os.makedirs(os.path.join(args.output_dir, "judged"), exist_ok=True)
    except OSError as error:
        sys.exit(f"judge.py: --output_dir {args.output_dir}: cannot create it ({error}); choose a writable folder")
    write_text_atomic(os.path.join(args.output_dir, "args.json"), json.dumps(
        {**asdict(args), "base_url": redact_url(args.base_url), "prompt_version": meta["prompt_version"],
         "git_commit": git_commit(os.path.dirname(os.path.abspath(__file__)))}, indent=2))
    cache_path = os.path.join(args.output_dir, "judgments.jsonl")
    cache, unreadable = load_cache(cache_path)
    if unreadable:
        print(f"{cache_path}: {unreadable} unreadable line(s) skipped (a kill mid-write); they are judged again")
    return cache_path, cache


def rows_to_ask(args: Args, comparisons: dict, cache: dict, meta: dict, endpoint: Optional[str]) -> list[dict]:
    """Key every item (judgment_key) and list those to ask now: not in the cache, or failed and due a retry."""
    todo, queued, keys = [], set(), set()
    for run in comparisons.values():
        for item in run["items"]:
            a, b = (item["ours"], item["other"]) if item["ours_is_a"] else (item["other"], item["ours"])
            item["key"] = judgment_key(meta["model"], meta["prompt_version"], meta["temperature"], item["post"], a, b)
            keys.add(item["key"])
            item["other_name"] = run["other_name"]
            record = cache.get(item["key"])
            if should_ask(record, args.failed_row_retries) and item["key"] not in queued:  # a pair twice: once
                queued.add(item["key"])
                todo.append(item)
    total = sum(len(run["items"]) for run in comparisons.values())
    retried = sum(item["key"] in cache for item in todo)
    if 0 <= args.max_new_judgments < len(todo):
        print(f"--max_new_judgments {args.max_new_judgments}: {len(todo) - args.max_new_judgments} left for a rerun")
        todo = todo[: args.max_new_judgments]
    where = f" at {redact_url(endpoint) or 'api.openai.com'}" if args.judge == "openai" else ""
    print(f"{total} comparisons in {len(comparisons)} runs, {len(keys)} distinct (a comparison met twice is asked once); "
          f"{len(todo)} to ask {meta['model']}{where} ({retried} of them failed before), {len(keys) - len(queued)} cached")
    return todo


def row_totals(record: Optional[dict]) -> dict:
    """A cached row's counts over every run that asked it: calls, abandoned, billed_twice, failed_runs."""
    totals = dict(calls=0, abandoned=0, billed_twice=0, failed_runs=0)
    if record is not None:  # records written before these counts existed hold `attempts` only
        totals.update(record.get("totals", {"calls": record.get("attempts", 0)}))
    return totals


def load_cache(path: str) -> tuple[dict, int]:
    """judgments.jsonl -> ({key: record}, number of unreadable lines, e.g. one cut by a kill mid-write)."""
    cache, bad = {}, 0
    if os.path.exists(path):
        with open(path, encoding="utf-8") as file:
            for line in file:
                try:
                    record = json.loads(line)
                    cache[record["key"]] = record
                except (json.JSONDecodeError, KeyError, TypeError):
                    bad += 1
    return cache, bad


def open_cache_for_append(path: str):
    """Open the cache to append whole lines: a half-written last line (a kill mid-write) is closed first."""
    torn = False
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, "rb") as file:
            file.seek(-1, os.SEEK_END)
            torn = file.read(1) != b"\n"
    file = open(path, "a", encoding="utf-8")
    if torn:
        file.write("\n")  # the torn line stays unreadable (judged again); the next record starts clean
    return file


def should_ask(record: Optional[dict], failed_row_retries: int) -> bool:
    """Whether a row is asked in this run: never answered, and failed in at most `failed_row_retries` runs so far."""
    # A row that failed in run 1 is asked again by runs 2 .. 1 + failed_row_retries, then left failed.
    # Records older than `status` are all judged ones.
    return record is None or (record.get("status", "judged") != "judged" and
                              row_totals(record)["failed_runs"] <= failed_row_retries)


def call_counts(records: list[Optional[dict]], this_run_only: bool) -> dict:
    """Rows judged / malformed / failed / unjudged (None or abandoned) and their calls / possibly billed twice.

    Calls of this run only (`attempts`, `billed_twice`), or of every run that asked the rows (`totals`)."""
    asked = [r for r in records if r is not None]
    judged = [r for r in asked if r.get("status", "judged") == "judged"]
    failed = [r for r in asked if r.get("status") == "failed"]
    if this_run_only:
        calls, twice = sum(r["attempts"] for r in asked), sum(r["billed_twice"] for r in asked)
    else:
        calls = sum(row_totals(r)["calls"] for r in asked)
        twice = sum(row_totals(r)["billed_twice"] for r in asked)
    return dict(rows=len(records), judged=len(judged), malformed=sum(cached_verdict(r) is None for r in judged),
                failed=len(failed), unjudged=len(records) - len(judged) - len(failed), calls=calls,
                possibly_billed_twice=twice)


# The calls: concurrent, timed out, retried with backoff, counted (possibly billed twice).
def ask_judge(args: Args, endpoint: Optional[str], todo: list[dict], cache: dict, cache_path: str, meta: dict,
              run_id: float, secrets: list[str]) -> Optional[str]:
    """Judge `todo` (judge_all), appending to the cache; None when it finished, else why the run stopped."""
    retry = dict(timeout=args.timeout, max_retries=args.max_retries, base=args.retry_base_delay,
                 cap=args.retry_max_delay)

    async def judge_todo(cache_file) -> None:
        """Judge `todo` with the chosen backend; the client lives and closes inside the event loop."""
        # max_retries=0: the retries are ours (backoff with jitter, counted, bounded), not the client's.
        # The query goes apart: the client pastes request paths after base_url, query and all.
        base_url, query = split_endpoint(endpoint)
        client = openai.AsyncOpenAI(base_url=base_url, default_query=query or None, max_retries=0,
                                    timeout=args.timeout) if args.judge == "openai" else None

        async def ask(post: str, summary_a: str, summary_b: str) -> Optional[str]:
            if client is None:
                return gold_reply(post, summary_a, summary_b)
            try:
                response = await client.chat.completions.create(
                    model=args.model, temperature=args.temperature,
                    messages=[{"role": "system", "content": SYSTEM_PROMPT},
                              {"role": "user", "content": build_prompt(post, summary_a, summary_b)}])
            except (json.JSONDecodeError, openai.APIResponseValidationError) as error:
                raise BadReply(f"HTTP 200 with a body that is not a chat completion ({error})") from error
            # A body served as text/html comes back as a str; a broken server may send no choices.
            choices = getattr(response, "choices", None)
            if not choices or getattr(choices[0], "message", None) is None:
                raise BadReply(f"HTTP 200 without choices: {str(response)[:200]!r}")
            return choices[0].message.content  # None (no text) is a malformed verdict: the judge did answer

        try:
            await judge_all(todo, ask, cache, cache_file, meta, args.max_concurrency, retry, run_id, secrets)
        finally:
            if client is not None:
                await client.close()

    stopped = None  # why the run stopped before asking all of `todo`
    # SLURM, `timeout` and `docker stop` send SIGTERM: stop as on Ctrl-C, recording the calls in flight
    # (a KeyboardInterrupt here; in the event loop, cancelled_by_sigterm cancels the run instead).
    on_sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)
    with open_cache_for_append(cache_path) as cache_file:
        try:
            asyncio.run(cancelled_by_sigterm(judge_todo(cache_file)))
        except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C, or SIGTERM (cancelled_by_sigterm)
            stopped = "interrupted"
        except Exception as error:  # the TaskGroup wraps the first error and cancels the calls in flight
            first = error.exceptions[0] if isinstance(error, ExceptionGroup) else error
            stopped = scrub(describe(first), secrets)
            if not isinstance(first, RunStopped):  # not a server's answer but a bug: show where it happened
                print(scrub("".join(traceback.format_exception(first)), secrets), file=sys.stderr)
        finally:
            signal.signal(signal.SIGTERM, on_sigterm)
    return stopped


async def cancelled_by_sigterm(run) -> None:
    """Await the coroutine `run`; SIGTERM cancels it as asyncio.run's own handler does on Ctrl-C.

    At the event loop's next turn, so that every call in flight is recorded as abandoned: a KeyboardInterrupt raised by
    SIGTERM inside a call's code ended the loop before the other calls in flight were recorded."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    except (NotImplementedError, RuntimeError, ValueError):  # Windows, or not the main thread: as outside the loop
        return await run
    try:
        await run
    finally:
        loop.remove_signal_handler(signal.SIGTERM)  # which leaves SIGTERM's default: until the loop ends, ours
        signal.signal(signal.SIGTERM, signal.default_int_handler)


async def judge_all(todo: list[dict], ask, cache: dict, cache_file, meta: dict, max_concurrency: int,
                    retry: dict, run_id: float, secrets: list[str]) -> None:
    """Judge every item of `todo` (distinct keys) with `ask(post, a, b) -> reply`; append each record at once.

    `retry`: call_with_retries' timeout, max_retries, base, cap. A row that fails for good is recorded as failed and the
    others go on; one that stops the run (why_run_stops) cancels the rest. Every finished row is on disk, no secret."""
    semaphore = asyncio.Semaphore(max_concurrency)
    rng = random.Random()  # jitter only: deliberately unseeded, it changes no result
    bar = tqdm(total=len(todo), desc=f"judging ({meta['model']})", unit="call")
    # Non-empty once a row stopped the run: the rows that get the semaphore it releases before the
    # TaskGroup cancels them must not start a call (it would be abandoned at once, maybe billed).
    stopping = []
    rejected = collections.Counter()  # the 400s of rows asked before any verdict (why_run_stops)
    judged = any(judged_under(record, meta) for record in cache.values())  # a verdict under these settings yet

    async def one(item: dict) -> None:
        nonlocal judged
        a, b = (item["ours"], item["other"]) if item["ours_is_a"] else (item["other"], item["ours"])
        totals = row_totals(cache.get(item["key"]))  # a failed or abandoned row's counts from earlier runs
        before = dict(totals)

        def save(status: str, reply: Optional[str] = None, error: Optional[BaseException] = None) -> None:
            """Append the row's record: status "judged", "failed" (no reply) or "abandoned" (run stopped mid-call)."""
            record = row_record(item, meta, status, reply, error, totals, before, run_id, secrets,
                                seconds=time.monotonic() - start)
            # One write, no await in between: whole lines in completion order; flushed, a kill loses none.
            # ASCII JSON: a line torn by a kill can never break the decoding of the whole file.
            cache_file.write(json.dumps(record) + "\n")
            cache_file.flush()
            cache[item["key"]] = record
            bar.update(1)

        async with semaphore:
            if stopping:
                return
            start = time.monotonic()  # the row's own time: its calls and backoffs, not its wait for a slot
            try:
                reply = await call_with_retries(lambda: ask(item["post"], a, b), totals, rng=rng, **retry)
            except (openai.OpenAIError, TimeoutError, BadReply) as error:
                if not stops_run(error):  # a row's own failure: recorded, the others go on
                    totals["failed_runs"] += 1
                    save("failed", error=error)
                why = why_run_stops(error, rejected, judged, stopping)
                if why is not None:
                    stopping.append(item["key"])
                    raise RunStopped(scrub(why, secrets)) from error
                return
            except asyncio.CancelledError:
                if totals["calls"] > before["calls"]:  # calls were made: keep their count for the re-ask
                    save("abandoned")
                raise
        judged = True
        save("judged", reply)

    try:
        async with asyncio.TaskGroup() as group:
            for item in todo:
                group.create_task(one(item))
    finally:
        bar.close()


def row_record(item: dict, meta: dict, status: str, reply: Optional[str], error: Optional[BaseException],
               totals: dict, before: dict, run_id: float, secrets: list[str], seconds: float) -> dict:
    """The cache line of one judged, failed or abandoned row: its verdict, this run's calls (totals - before) and
    the counts over every run that asked it; replies and errors scrubbed of `secrets`."""
    verdict = parse_verdict(reply, allow_tie=meta["allow_tie"]) if status == "judged" else None
    return dict(key=item["key"], model=meta["model"], prompt_version=meta["prompt_version"],
                temperature=meta["temperature"], label=item["label"], row=item["row"], ours_is_a=item["ours_is_a"],
                status=status, reply=scrub(reply, secrets), verdict=verdict,
                preferred=preferred_side(verdict, item["ours_is_a"], item["other_name"])
                if status == "judged" else "unjudged",
                error=scrub(describe(error), secrets) if error else None,
                attempts=totals["calls"] - before["calls"], abandoned=totals["abandoned"] - before["abandoned"],
                billed_twice=totals["billed_twice"] - before["billed_twice"], totals=totals,
                run=run_id, seconds=round(seconds, 3), time=time.time())


async def call_with_retries(call, tally: dict, timeout: float, max_retries: int, base: float, cap: float,
                            rng: random.Random) -> str:
    """Await `call()` with a wall-clock timeout, retrying retryable errors with backoff; the reply.

    Raises the last error when it is not retryable or the retries are spent. Counts in `tally`, in
    place: `calls` made, calls that may have been billed without a usable reply (`abandoned`), and
    calls made after one of those (`billed_twice`)."""
    for attempt in range(max_retries + 1):
        tally["billed_twice"] += int(tally["abandoned"] > 0)  # a re-ask may pay a second time for one verdict
        tally["calls"] += 1
        try:
            return await asyncio.wait_for(call(), timeout)
        except asyncio.CancelledError:  # Ctrl-C, or another row stopped the run: the server may still bill it
            tally["abandoned"] += 1
            raise
        except Exception as error:
            tally["abandoned"] += int(may_be_billed(error))
            if not is_retryable(error) or attempt == max_retries:
                raise
            # asyncio.sleep yields to the other calls; the reference's time.sleep(30) froze them all.
            await asyncio.sleep(max(backoff_delay(attempt, base, cap, rng), min(cap, retry_after(error))))
    raise AssertionError("unreachable")


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Seconds to wait before retry number `attempt` (0-based): base * 2**attempt, capped, times U(1/2, 1).

    The jitter spreads the retries of calls that failed together (one 429 burst) over time."""
    return min(cap, base * 2**attempt) * rng.uniform(0.5, 1.0)


def is_retryable(error: BaseException) -> bool:
    """Rate limits, server errors, timeouts and lost connections are worth a retry; 400/401/404 are not."""
    if isinstance(error, (TimeoutError, openai.APIConnectionError)):  # APITimeoutError is a connection error
        return True
    return isinstance(error, openai.APIStatusError) and not out_of_quota(error) and (
        error.status_code in (408, 409, 429) or error.status_code >= 500)


def retry_after(error: BaseException) -> float:
    """The server's retry-after-ms or Retry-After header in seconds (0 when absent or not a number)."""
    response = getattr(error, "response", None)
    if response is None:
        return 0.0
    for header, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            if header in response.headers:
                return max(0.0, float(response.headers[header]) * scale)
        except ValueError:
            continue
    return 0.0


class BadReply(Exception):
    """An HTTP 200 without a usable reply (body not JSON, no choices): maybe billed, so not re-asked at once."""


class RunStopped(Exception):
    """A fault that every other row would meet too (bad key, no access, wrong model or URL, server unreachable)."""


def may_be_billed(error: BaseException) -> bool:
    """Whether a failed call may still have been billed: abandoned at the timeout, or a 200 without a usable reply."""
    # The server does not learn that the client gave up: it may finish the call and bill it.
    return isinstance(error, (TimeoutError, openai.APITimeoutError, BadReply))


def stops_run(error: BaseException) -> bool:
    """Whether `error` would fail every other row as well: 401, 403, 404, 410, an exhausted quota or an unreachable
    server."""
    if isinstance(error, openai.APIStatusError):
        return error.status_code in (401, 403, 404, 410) or out_of_quota(error)
    return isinstance(error, openai.APIConnectionError) and not isinstance(error, openai.APITimeoutError)


def out_of_quota(error: BaseException) -> bool:
    """A 429 that waiting does not clear: OpenAI's `insufficient_quota` (no credit, a spend limit reached), or any
    server's `x-should-retry: false`."""
    if not isinstance(error, openai.APIStatusError) or error.status_code != 429:
        return False
    if error.response.headers.get("x-should-retry", "").lower() == "false":
        return True
    body = error.body.get("error", error.body) if isinstance(error.body, dict) else {}
    return isinstance(body, dict) and "insufficient_quota" in (body.get("type"), body.get("code"))


SAME_400_STOPS = 3  # rows failing with one 400 before any is judged: judge_all stops the run


def judged_under(record: dict, meta: dict) -> bool:
    """Whether a cache record is a verdict asked with the settings of `meta` (model, prompt version, temperature)."""
    return (record.get("status", "judged") == "judged"
            and all(record.get(k) == meta[k] for k in ("model", "prompt_version", "temperature")))


def why_run_stops(error: BaseException, rejected: collections.Counter, judged: bool, stopping: list) -> Optional[str]:
    """Why a row's `error` stops the run (stops_run, or SAME_400_STOPS rows with the same 400 and no verdict yet under
    these settings), None if the other rows go on. Counts that 400 in `rejected`; `stopping`: non-empty once stopped."""
    if stops_run(error):
        if isinstance(error, openai.APIConnectionError):  # (stops_run: not a timeout) no server answered
            host = getattr(getattr(getattr(error, "request", None), "url", None), "host", None) or "the server"
            return (f"cannot reach {host} (is this machine offline? another server: --base_url; the tiny world's "
                    "summaries need none: --judge gold); " + describe(error))
        return ("no quota left (429 insufficient_quota or x-should-retry: false), which waiting does not clear: add "
                "credit or raise the spend limit; " if out_of_quota(error) else "") + describe(error)
    kind = bad_request_kind(error) if isinstance(error, openai.BadRequestError) else None
    if kind is None or judged:
        return None
    # A 400 that every row gets (a flag the server rejects, e.g. a temperature a reasoning model refuses) would
    # fail the rows one by one: the same 400 on the first rows asked with these settings, none judged, stops it.
    rejected[kind] += 1
    if rejected[kind] < SAME_400_STOPS or stopping:
        return None
    return (f"the first {SAME_400_STOPS} rows asked all got the same 400, which every row would get: check the flags "
            "the server rejects (a reasoning model takes --temperature 1 only); " + describe(error))


# 400s that depend on the row itself (a long post, a flagged one), however alike their messages: never a run's fault.
ROW_400_CODES = ("context_length_exceeded", "string_above_max_length", "content_filter", "content_policy_violation")


def bad_request_kind(error: BaseException) -> Optional[tuple]:
    """What makes two 400s the same fault: their code (a string: vLLM and llama.cpp send the status 400 there),
    param and message; None for a 400 that depends on the row (ROW_400_CODES)."""
    body = getattr(error, "body", None)
    body = body.get("error", body) if isinstance(body, dict) else {}
    body = body if isinstance(body, dict) else {}
    code = body.get("code") if isinstance(body.get("code"), str) else None
    return None if code in ROW_400_CODES else (code, body.get("param"), str(error)[:300])


def describe(error: BaseException) -> str:
    """`ErrorType: message`, cut to 300 characters (a server's error body can be long)."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 300 else text[:297] + "..."


# Results: tables, plot and exit status; files replaced whole.
def failed_rows(name: str, run: dict, cache: dict, failed_row_retries: int) -> list[dict]:
    """The rows of `run` whose last ask failed: the error, in how many runs, and whether a rerun asks again."""
    records = [(item, cache.get(item["key"])) for item in run["items"]]
    return [dict(run=name, row=item["row"], error=record["error"], failed_runs=row_totals(record)["failed_runs"],
                 asked_by_rerun=should_ask(record, failed_row_retries))
            for item, record in records if record and record.get("status") == "failed"]


def write_judged_table(output_dir: str, name: str, judged: list[dict]) -> None:
    """judged/<name>.csv: every comparison of the run, one row each (judged_rows' columns)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(judged[0]) if judged else ["row"])
    writer.writeheader()
    writer.writerows(judged)
    write_text_atomic(os.path.join(output_dir, "judged", f"{name}.csv"), buffer.getvalue())


def drop_other_judged_tables(output_dir: str, comparisons: dict) -> None:
    """Remove judged/<name>.csv of runs this call does not report: an earlier call into the same folder judged
    other tables, and reward.py --judged_file would read its rows beside this call's results (the cache keeps
    every verdict: rerunning that call rebuilds them without a paid request)."""
    folder = os.path.join(output_dir, "judged")
    for name in sorted(set(os.listdir(folder) if os.path.isdir(folder) else []) - {f"{run}.csv" for run in comparisons}):
        os.remove(os.path.join(folder, name))


def run_counts(comparisons: dict, cache: dict, todo: list[dict], run_id: float, stopped: Optional[str]) -> dict:
    """Call counts over every run (`totals`) and of this run alone (`this_run`, with why it stopped)."""
    # Counts over distinct comparisons (a pair judged for two runs is one call), and of this run alone.
    records = [cache.get(key) for key in {item["key"] for run in comparisons.values() for item in run["items"]}]
    totals = call_counts(records, this_run_only=False)
    this_run = dict(to_ask=len(todo), **call_counts([r for r in records if r and r.get("run") == run_id], True),
                    stopped=stopped)
    del this_run["rows"]  # the rows of this run are `to_ask`; those not reached or abandoned are unjudged:
    this_run["unjudged"] = len(todo) - this_run["judged"] - this_run["failed"]
    return dict(totals=totals, this_run=this_run)


def write_results(args: Args, meta: dict, runs: dict, log_ratios: dict, failures: list[dict], counts: dict) -> None:
    """results.json, results.md and length_vs_winrate.png (Figure 8), then the tables and counts on stdout."""
    totals, this_run = counts["totals"], counts["this_run"]
    header = (f"Judge `{meta['model']}`, prompt `{meta['prompt_version']}`, temperature {fmt(meta['temperature'], 2)}, "
              f"A/B order seed {args.seed}. Win rate = (wins + ties / 2) / (wins + ties + losses); malformed "
              "verdicts, unjudged and failed rows count for neither side. 95% CI: Wilson score interval.")
    write_text_atomic(os.path.join(args.output_dir, "results.json"), json.dumps(dict(
        judge=args.judge, **{k: meta[k] for k in ("model", "prompt_version", "temperature")}, seed=args.seed,
        ci="wilson 95%", runs=runs, totals=totals, this_run=this_run, failures=failures), indent=2))
    write_text_atomic(os.path.join(args.output_dir, "results.md"), markdown_tables(runs, header))
    if log_ratios:
        edges = length_bin_edges([x for xs, _ in log_ratios.values() for x in xs], args.length_bins)
        plot_length_curves({name: length_curve(xs, ps, edges, "reference") for name, (xs, ps) in log_ratios.items()},
                           os.path.join(args.output_dir, "length_vs_winrate.png"))
    print(markdown_tables(runs, header))
    print("this run: " + ", ".join(f"{k} {v}" for k, v in this_run.items() if k != "stopped") +
          "; all runs: " + ", ".join(f"{k} {v}" for k, v in totals.items()))
    print(f"saved {args.output_dir}/results.json, results.md, length_vs_winrate.png, judged/, judgments.jsonl")


def exit_with_status(stopped: Optional[str], failures: list[dict], cache_path: str, failed_row_retries: int) -> None:
    """Exit 1 when the run stopped, 3 when it finished with failed rows (listed), else return (status 0)."""
    if stopped:
        sys.exit(f"judge.py: stopped: {stopped}. Judgments made so far are in {cache_path} and counted in "
                 "results.json; fix the cause and rerun the same command to continue")
    if failures:
        for failure in failures[:10]:
            print(f"failed: {failure['run']} row {failure['row']} in {failure['failed_runs']} run(s): "
                  f"{failure['error']}", file=sys.stderr)
        again = sum(f["asked_by_rerun"] for f in failures)
        given_up = "" if again == len(failures) else (
            f"; the other {len(failures) - again} failed in more than --failed_row_retries {failed_row_retries} "
            "reruns (raise it to ask them again)")
        print(f"judge.py: {len(failures)} row(s) failed (listed in results.json `failures` and judged/<run>.csv); "
              f"a rerun asks {again} of them again{given_up}", file=sys.stderr)
        sys.exit(3)  # finished, but the results lack these rows


def parse_run_label(label: str) -> tuple[str, Optional[str]]:
    """`ppo__seed1` -> ("ppo", "1"); `sft` -> ("sft", None)."""
    method, sep, seed = label.partition("__seed")
    return (method, seed) if sep and seed else (label, None)


def fmt(x: Optional[float], digits: int = 3) -> str:
    """A number for a table cell: "-" for None."""
    return "-" if x is None else f"{x:.{digits}f}"


def markdown_tables(runs: dict, header: str) -> str:
    """results.md: one row per run, then one row per method averaged over its seeds (vs reference only)."""
    lines = [header, "", "| run | method | seed | vs | n | win rate | 95% CI (Wilson) | malformed | ties | unjudged "
             "| failed | words (ours / other) | RM agreement (n) | calls (possibly billed twice) |", "|" + "---|" * 14]
    for label, r in runs.items():
        lines.append(f"| {label} | {r['method']} | {r['seed'] or '-'} | {r['vs']} | {r['n']} | {fmt(r['win_rate'])} "
                     f"| [{fmt(r['ci_low'])}, {fmt(r['ci_high'])}] | {r['malformed']} | {r['ties']} | {r['unjudged']} "
                     f"| {r['failed']} | {fmt(r['mean_words'], 1)} / {fmt(r['mean_other_words'], 1)} "
                     f"| {fmt(r['rm_agreement'])} ({r['n_rm_agreement']}) "
                     f"| {r['calls']} ({r['possibly_billed_twice']}) |")
    methods: dict = {}
    for r in runs.values():
        if r["vs"] == "reference" and r["n"]:
            methods.setdefault(r["method"], []).append(r)
    if methods:
        # n and the rows left say whether a mean is over every post (a --max_new_judgments stop leaves some unjudged).
        lines += ["", "| method | runs | mean win rate | std over runs | mean words | n | left (unjudged, failed) |",
                  "|---|---|---|---|---|---|---|"]
        for method, rs in methods.items():
            rates = [r["win_rate"] for r in rs]
            std = statistics.stdev(rates) if len(rates) > 1 else None  # sample std over seeds
            lines.append(f"| {method} | {len(rs)} | {fmt(statistics.mean(rates))} | {fmt(std)} "
                         f"| {fmt(statistics.mean(r['mean_words'] for r in rs), 1)} | {sum(r['n'] for r in rs)} "
                         f"| {sum(r['unjudged'] for r in rs)}, {sum(r['failed'] for r in rs)} |")
    return "\n".join(lines) + "\n"


def plot_length_curves(curves: dict, path: str) -> None:
    """Figure 8 (right): one line per run, win rate against log(summary length / reference length)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(7, 5))
    for label, points in curves.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.axhline(0.5, color="gray", linestyle="--", linewidth=1)
    ax.set(xlabel="log(summary length / reference length)  [words]", ylabel="win rate against the reference",
           ylim=(-0.05, 1.05), title="Win rate by summary length (paper Figure 8)")
    ax.legend()
    figure.tight_layout()
    write_atomic(path, lambda partial: figure.savefig(partial, format="png"))
    plt.close(figure)


def write_atomic(path: str, write) -> None:
    """Create `path` whole or not at all: `write(tmp_path)` writes beside it, then a rename replaces it."""
    # A kill mid-write leaves the old file (or none) and a `.partial` that the next run overwrites;
    # a reader never sees half a results.json. os.replace is atomic within one file system.
    partial = path + ".partial"
    write(partial)
    os.replace(partial, path)


def write_text_atomic(path: str, text: str) -> None:
    """write_atomic for a text file (UTF-8)."""
    def write(partial: str) -> None:
        with open(partial, "w", encoding="utf-8", newline="") as file:
            file.write(text)
    write_atomic(path, write)


def git_commit(folder: str) -> Optional[str]:
    """The git commit checked out in `folder`, None outside a git checkout."""
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True)
    except OSError:
        return None
    return result.stdout.strip() if result.returncode == 0 else None


if __name__ == "__main__":
    main()  # here, at the end, so that every helper below the fence is defined when it runs
