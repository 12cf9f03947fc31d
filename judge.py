"""Judge model summaries against the human reference summaries: the paper's headline win rate.

Reads the sample tables that sft.py, ppo.py and dpo.py write (CSV columns `query, response,
reference`; PPO tables may add the reward model's `score, reference_score`), asks a judge which of
two summaries of a post is better, and reports for every table the win rate against the reference
(or against another table's summaries of the same posts) with a 95% Wilson interval:

    {output_dir}/judgments.jsonl       one line per judgment, appended the moment it is made (the cache)
    {output_dir}/results.json          per run: n, win rate, CI, malformed, ties, mean lengths, RM agreement
    {output_dir}/results.md            the same as markdown tables: per run, and per method over seeds
    {output_dir}/length_vs_winrate.png win rate against log(summary length / reference length) (Figure 8)
    {output_dir}/judged/<run>.csv      every comparison: A/B order, raw reply, verdict, lengths, scores
    {output_dir}/args.json             these flags, the prompt version and the git commit (never a key)

    # the tiny world's gold judge: offline, instant, no key
    python judge.py --judge gold --tables sft=runs/sft/samples.csv ppo__seed1=runs/ppo/samples.csv \
        --output_dir runs/judge_gold
    # the paper's judge, gpt-3.5-turbo-0125 (key from OPENAI_API_KEY only), PPO also against SFT
    python judge.py --tables sft__seed1=sft1.csv ppo__seed1=ppo1.csv --pairs ppo__seed1:sft__seed1
    # any OpenAI-compatible server (vLLM, llama.cpp ...): OPENAI_API_KEY=unused for a keyless one
    python judge.py --base_url http://127.0.0.1:8000/v1 --model Qwen/Qwen2.5-7B-Instruct --tables dpo=dpo.csv

Run labels are `<method>` or `<method>__seed<seed>` (`sft`, `ppo__seed1`); results.md averages
each method over its seeds. Unlike the reference judge (eval/oai.py: a blocking sleep in async code,
an unseeded and unrecorded A/B shuffle, the API's default temperature, malformed verdicts counted
for the reference), the A/B order is drawn per row from a seed and recorded, the temperature is
fixed and recorded, a malformed verdict counts for neither side, and no paid call is repeated: the
cache is keyed by (model, prompt version, temperature, post, summary A, summary B), so a rerun after
a crash or Ctrl-C asks only what is missing.

Details: 17 (agreement of the reward model's ordering with the judge, when scores are present).
Printed: a progress bar, then the results tables (results.md).
"""

import asyncio
import csv
import hashlib
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
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
    model: str = "gpt-3.5-turbo-0125"
    """Judge model name sent to the server (paper: gpt-3.5-turbo-0125)"""
    base_url: Optional[str] = None
    """OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (None: $OPENAI_BASE_URL, else api.openai.com)"""
    temperature: float = 0.0
    """Judge sampling temperature, fixed and recorded (the reference set none: the API default 1.0)"""
    seed: int = 1
    """Seed of the per-row A/B order draw (same seed: same order, so a rerun hits the cache)"""

    # calling
    max_concurrency: int = 8
    """Calls in flight at once (the reference used 11 for gpt-3.5 to stay under the token rate limit)"""
    timeout: float = 60.0
    """Seconds one call may take before it is abandoned and retried"""
    max_retries: int = 6
    """Retries of one call on 408/409/429, 5xx, timeouts and connection errors before the run stops"""
    retry_base_delay: float = 1.0
    """First backoff delay in seconds; doubles each retry, with jitter in [1/2, 1] of it"""
    retry_max_delay: float = 60.0
    """Cap of one backoff delay in seconds (also caps a server's Retry-After)"""
    max_new_judgments: int = -1
    """Stop after this many new (uncached) judgments, e.g. to bound the cost of one run (-1: no limit)"""

    # report
    length_bins: int = 10
    """Equal-width bins of log(summary length / reference length) in the length plot (reference: 10)"""


# ------------------------------------------------------------------------------------------------
# The prompt (paper, Appendix I, modified by the authors from Rafailov et al. 2023). The appendix's
# backslashes are the line continuations of the reference's Python string, not part of the prompt.
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
GOLD_MODEL, GOLD_PROMPT_VERSION = "tiny_world.gold_score", "gold-v1"
EOS_TEXT = "<|endoftext|>"
LABEL_RE = re.compile(r"[\w.-]+")
Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile


def parse_table_spec(spec: str) -> tuple[str, str]:
    """`LABEL=PATH` -> (label, path); the label becomes a file name, so it is `[\\w.-]+`."""
    label, sep, path = spec.partition("=")
    if not sep or not LABEL_RE.fullmatch(label) or not path:
        raise ValueError(f"--tables entry {spec!r}: want LABEL=PATH.csv with LABEL made of letters, digits, _ . -")
    return label, path


def parse_run_label(label: str) -> tuple[str, Optional[str]]:
    """`ppo__seed1` -> ("ppo", "1"); `sft` -> ("sft", None)."""
    method, sep, seed = label.partition("__seed")
    return (method, seed) if sep and seed else (label, None)


def read_table(path: str, n: int) -> list[dict]:
    """The first n rows (-1: all) of a sample CSV as dicts; empty cells stay empty strings."""
    with open(path, newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    missing = {"query", "response"} - set(rows[0] if rows else {})
    if missing:
        raise ValueError(f"{path}: missing columns {sorted(missing)} (want query, response, reference)")
    return rows if n < 0 else rows[:n]


def optional_float(row: dict, column: str) -> Optional[float]:
    """A numeric cell, or None when the column is absent or empty."""
    value = row.get(column, "")
    return float(value) if value not in ("", None) else None


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

    Strict on purpose: `Preferred: "A"`, `A.`, two Preferred lines or none are all malformed (the
    reference counted every one of them for the reference summary)."""
    lines = [line.strip() for line in (reply or "").splitlines() if line.strip().startswith("Preferred:")]
    if len(lines) != 1:
        return None
    value = lines[0].removeprefix("Preferred:").strip()
    return value if value in ("A", "B") or (allow_tie and value == "tie") else None


def preferred_side(verdict: Optional[str], ours_a: bool, other_name: str) -> str:
    """Map a verdict in A/B terms to "ours", `other_name` ("reference" or "other"), "tie" or "malformed"."""
    if verdict is None:
        return "malformed"
    if verdict == "tie":
        return "tie"
    return "ours" if verdict == ("A" if ours_a else "B") else other_name


def wilson_interval(wins: int, n: int, z: float = Z_95) -> tuple[float, float]:
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
    pairs = [(p == "ours", s > o) for p, s, o in zip(preferred, ours_scores, other_scores)
             if p not in ("malformed", "tie", "unjudged") and s is not None and o is not None]
    return (sum(judge == rm for judge, rm in pairs) / len(pairs) if pairs else None), len(pairs)


def summarize(rows: list[dict], other_name: str) -> dict:
    """Per-run statistics from judged rows (keys preferred, ours_words, other_words, ours_score, other_score)."""
    preferred = [r["preferred"] for r in rows]
    wins, losses = preferred.count("ours"), preferred.count(other_name)
    # Ties and malformed verdicts are reported, never counted for either side: the reference counted
    # a malformed verdict as a loss, which pulls every win rate down by the malformed fraction.
    n = wins + losses
    low, high = wilson_interval(wins, n) if n else (None, None)
    agreement, n_agreement = rm_agreement(preferred, [r["ours_score"] for r in rows], [r["other_score"] for r in rows])
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return dict(n=n, wins=wins, win_rate=wins / n if n else None, ci_low=low, ci_high=high,
                malformed=preferred.count("malformed"), ties=preferred.count("tie"),
                unjudged=preferred.count("unjudged"), rows=len(rows),
                mean_words=mean([r["ours_words"] for r in rows]), mean_other_words=mean([r["other_words"] for r in rows]),
                rm_agreement=agreement, n_rm_agreement=n_agreement)


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Seconds to wait before retry number `attempt` (0-based): base * 2**attempt, capped, times U(1/2, 1).

    The jitter spreads the retries of calls that failed together (one 429 burst) over time."""
    return min(cap, base * 2**attempt) * rng.uniform(0.5, 1.0)


def is_retryable(error: BaseException) -> bool:
    """Rate limits, server errors, timeouts and lost connections are worth a retry; 400/401/404 are not."""
    if isinstance(error, (TimeoutError, openai.APIConnectionError)):  # APITimeoutError is a connection error
        return True
    return isinstance(error, openai.APIStatusError) and (error.status_code in (408, 409, 429) or error.status_code >= 500)


def retry_after(error: BaseException) -> float:
    """The server's Retry-After header in seconds (0 when absent or not a number)."""
    response = getattr(error, "response", None)
    try:
        return max(0.0, float(response.headers.get("retry-after", 0))) if response is not None else 0.0
    except ValueError:
        return 0.0


async def call_with_retries(call, timeout: float, max_retries: int, base: float, cap: float,
                            rng: random.Random) -> tuple[str, int]:
    """Await `call()` with a wall-clock timeout, retrying retryable errors with backoff; (reply, attempts)."""
    for attempt in range(max_retries + 1):
        try:
            return await asyncio.wait_for(call(), timeout), attempt + 1
        except Exception as error:
            if not is_retryable(error) or attempt == max_retries:
                raise
            # asyncio.sleep yields to the other calls; the reference's time.sleep(30) froze them all.
            await asyncio.sleep(max(backoff_delay(attempt, base, cap, rng), min(cap, retry_after(error))))
    raise AssertionError("unreachable")


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


async def judge_all(todo: list[dict], ask, cache: dict, cache_file, meta: dict, max_concurrency: int,
                    retry: dict) -> None:
    """Judge every item of `todo` (distinct keys) with `ask(post, a, b) -> reply`; append each record at once.

    `retry`: call_with_retries' timeout, max_retries, base, cap. The first call that fails for good
    (not retryable, or retries spent) cancels the rest and raises; all finished ones are on disk."""
    semaphore = asyncio.Semaphore(max_concurrency)
    rng = random.Random()  # jitter only: deliberately unseeded, it changes no result
    bar = tqdm(total=len(todo), desc=f"judging ({meta['model']})", unit="call")

    async def one(item: dict) -> None:
        a, b = (item["ours"], item["other"]) if item["ours_is_a"] else (item["other"], item["ours"])
        async with semaphore:
            start = time.monotonic()
            reply, attempts = await call_with_retries(lambda: ask(item["post"], a, b), rng=rng, **retry)
        verdict = parse_verdict(reply, allow_tie=meta["allow_tie"])
        record = dict(key=item["key"], model=meta["model"], prompt_version=meta["prompt_version"],
                      temperature=meta["temperature"], label=item["label"], row=item["row"],
                      ours_is_a=item["ours_is_a"], reply=reply, verdict=verdict,
                      preferred=preferred_side(verdict, item["ours_is_a"], item["other_name"]),
                      attempts=attempts, seconds=round(time.monotonic() - start, 3), time=time.time())
        # One write, no await in between: whole lines in completion order; flushed, a kill loses none.
        # ASCII JSON: a line torn by a kill can never break the decoding of the whole file.
        cache_file.write(json.dumps(record) + "\n")
        cache_file.flush()
        cache[item["key"]] = record
        bar.update(1)

    try:
        async with asyncio.TaskGroup() as group:
            for item in todo:
                group.create_task(one(item))
    finally:
        bar.close()


def gold_reply(post: str, summary_a: str, summary_b: str) -> str:
    """The tiny world's gold judge as a reply in the LLM's format (`Preferred: tie` when the scores are equal)."""
    import tiny_world  # off the training path and only needed here: `import judge` stays light

    score_a, score_b = tiny_world.gold_score(post, summary_a), tiny_world.gold_score(post, summary_b)
    verdict = "A" if score_a > score_b else "B" if score_b > score_a else "tie"
    return f"Comparison: gold score of summary A {score_a:.4f}, of summary B {score_b:.4f}.\nPreferred: {verdict}"


def length_curve(log_ratios: list[float], preferred: list[str], edges: list[float], other_name: str) -> list:
    """[(bin center, win rate, count)] of decided judgments per bin of log length ratio (empty bins skipped)."""
    counts = [[0, 0] for _ in range(len(edges) - 1)]  # [wins, decided] per bin
    for x, p in zip(log_ratios, preferred):
        if p in ("ours", other_name):
            i = min(max(0, sum(x >= e for e in edges[1:-1])), len(counts) - 1)
            counts[i][0] += p == "ours"
            counts[i][1] += 1
    return [((edges[i] + edges[i + 1]) / 2, wins / total, total)
            for i, (wins, total) in enumerate(counts) if total]


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
    figure.savefig(path)
    plt.close(figure)


def fmt(x: Optional[float], digits: int = 3) -> str:
    """A number for a table cell: "-" for None."""
    return "-" if x is None else f"{x:.{digits}f}"


def markdown_tables(runs: dict, header: str) -> str:
    """results.md: one row per run, then one row per method averaged over its seeds (vs reference only)."""
    lines = [header, "", "| run | method | seed | vs | n | win rate | 95% CI (Wilson) | malformed | ties | unjudged "
             "| words (ours / other) | RM agreement (n) |", "|" + "---|" * 12]
    for label, r in runs.items():
        lines.append(f"| {label} | {r['method']} | {r['seed'] or '-'} | {r['vs']} | {r['n']} | {fmt(r['win_rate'])} "
                     f"| [{fmt(r['ci_low'])}, {fmt(r['ci_high'])}] | {r['malformed']} | {r['ties']} | {r['unjudged']} "
                     f"| {fmt(r['mean_words'], 1)} / {fmt(r['mean_other_words'], 1)} "
                     f"| {fmt(r['rm_agreement'])} ({r['n_rm_agreement']}) |")
    methods: dict = {}
    for r in runs.values():
        if r["vs"] == "reference" and r["n"]:
            methods.setdefault(r["method"], []).append(r)
    if methods:
        lines += ["", "| method | runs | mean win rate | std over runs | mean words |", "|---|---|---|---|---|"]
        for method, rs in methods.items():
            rates = [r["win_rate"] for r in rs]
            std = statistics.stdev(rates) if len(rates) > 1 else None  # sample std over seeds
            lines.append(f"| {method} | {len(rs)} | {fmt(statistics.mean(rates))} | {fmt(std)} "
                         f"| {fmt(statistics.mean(r['mean_words'] for r in rs), 1)} |")
    return "\n".join(lines) + "\n"


def git_commit(folder: str) -> Optional[str]:
    """The git commit checked out in `folder`, None outside a git checkout."""
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True)
    except OSError:
        return None
    return result.stdout.strip() if result.returncode == 0 else None


if __name__ == "__main__":
    args = tyro.cli(Args)

    # ---- runs: tables and the comparisons to judge ----
    tables = dict(parse_table_spec(spec) for spec in args.tables)
    if not tables or len(tables) != len(args.tables):
        sys.exit("judge.py: pass --tables LABEL=PATH.csv ... with distinct labels")
    rows = {label: read_table(path, args.n) for label, path in tables.items()}
    comparisons = {}  # run name -> its items (one per row), the other side's name, our label, what we face
    if args.reference:
        for label in tables:
            comparisons[label] = dict(items=make_items(label, rows[label], None, args.seed),
                                      other_name="reference", ours_label=label, vs="reference")
    for pair in args.pairs:
        ours, sep, other = pair.partition(":")
        if not sep or ours not in tables or other not in tables:
            sys.exit(f"judge.py: --pairs {pair!r}: want OURS:OTHER, both labels of --tables {list(tables)}")
        name = f"{ours}_vs_{other}"
        items = make_items(name, rows[ours], rows[other], args.seed)
        print(f"{name}: {len(items)} of {len(rows[ours])} posts of {ours} also sampled by {other}")
        comparisons[name] = dict(items=items, other_name="other", ours_label=ours, vs=other)
    if not comparisons:
        sys.exit("judge.py: nothing to compare: keep --reference or pass --pairs")

    # ---- the judge: an LLM behind an OpenAI-compatible API, or the tiny world's gold score ----
    if args.judge == "gold":
        meta = dict(model=GOLD_MODEL, prompt_version=GOLD_PROMPT_VERSION, temperature=None, allow_tie=True)
    else:
        meta = dict(model=args.model, prompt_version=PROMPT_VERSION, temperature=args.temperature, allow_tie=False)
        if not os.environ.get("OPENAI_API_KEY"):  # read here and by the client only, never written anywhere
            sys.exit("judge.py: set OPENAI_API_KEY (any non-empty value for a local server without keys)")

    # ---- outputs and the cache: what is already judged is never asked again ----
    os.makedirs(os.path.join(args.output_dir, "judged"), exist_ok=True)
    with open(os.path.join(args.output_dir, "args.json"), "w") as file:
        json.dump({**asdict(args), "prompt_version": meta["prompt_version"],
                   "git_commit": git_commit(os.path.dirname(os.path.abspath(__file__)))}, file, indent=2)
    cache_path = os.path.join(args.output_dir, "judgments.jsonl")
    cache, unreadable = load_cache(cache_path)
    if unreadable:
        print(f"{cache_path}: {unreadable} unreadable line(s) skipped (a kill mid-write); they are judged again")
    todo, queued = [], set()
    for run in comparisons.values():
        for item in run["items"]:
            a, b = (item["ours"], item["other"]) if item["ours_is_a"] else (item["other"], item["ours"])
            item["key"] = judgment_key(meta["model"], meta["prompt_version"], meta["temperature"], item["post"], a, b)
            item["other_name"] = run["other_name"]
            if item["key"] not in cache and item["key"] not in queued:  # the same pair twice is asked once
                queued.add(item["key"])
                todo.append(item)
    total = sum(len(run["items"]) for run in comparisons.values())
    if 0 <= args.max_new_judgments < len(todo):
        print(f"--max_new_judgments {args.max_new_judgments}: {len(todo) - args.max_new_judgments} left for a rerun")
        todo = todo[: args.max_new_judgments]
    print(f"{total} comparisons in {len(comparisons)} runs; {len(todo)} to ask {meta['model']}, the rest cached")

    retry = dict(timeout=args.timeout, max_retries=args.max_retries, base=args.retry_base_delay,
                 cap=args.retry_max_delay)

    async def judge_todo(cache_file) -> None:
        """Judge `todo` with the chosen backend; the client lives and closes inside the event loop."""
        # max_retries=0: the retries are ours (backoff with jitter, counted, bounded), not the client's.
        client = openai.AsyncOpenAI(base_url=args.base_url, max_retries=0, timeout=args.timeout) \
            if args.judge == "openai" else None

        async def ask(post: str, summary_a: str, summary_b: str) -> Optional[str]:
            if client is None:
                return gold_reply(post, summary_a, summary_b)
            response = await client.chat.completions.create(
                model=args.model, temperature=args.temperature,
                messages=[{"role": "system", "content": SYSTEM_PROMPT},
                          {"role": "user", "content": build_prompt(post, summary_a, summary_b)}])
            return response.choices[0].message.content

        try:
            await judge_all(todo, ask, cache, cache_file, meta, args.max_concurrency, retry)
        finally:
            if client is not None:
                await client.close()

    with open_cache_for_append(cache_path) as cache_file:
        try:
            asyncio.run(judge_todo(cache_file))
        except ExceptionGroup as group:  # the first call that failed for good; the others were cancelled
            sys.exit(f"judge.py: stopped: {group.exceptions[0]!r}. Judgments made so far are in {cache_path}; "
                     "rerun the same command to continue")
        except KeyboardInterrupt:
            sys.exit(f"judge.py: interrupted. Judgments made so far are in {cache_path}; rerun to continue")

    # ---- results: per run, then across runs ----
    # Recomputed from the cache every time, so a run resumed after a crash reports exactly what one
    # uninterrupted run would have; a cached verdict is in A/B terms and `ours_is_a` maps it back.
    runs, log_ratios = {}, {}
    for name, run in comparisons.items():
        judged = []
        for item in run["items"]:
            record = cache.get(item["key"])
            verdict = record["verdict"] if record else None
            judged.append(dict(
                row=item["row"], ours_is_a=item["ours_is_a"], verdict=verdict,
                preferred=preferred_side(verdict, item["ours_is_a"], run["other_name"]) if record else "unjudged",
                ours_words=len(item["ours"].split()), other_words=len(item["other"].split()),
                ours_score=item["ours_score"], other_score=item["other_score"],
                post=item["post"], ours=item["ours"], other=item["other"], reply=record["reply"] if record else ""))
        with open(os.path.join(args.output_dir, "judged", f"{name}.csv"), "w", newline="", encoding="utf-8") as file:
            writer = csv.DictWriter(file, fieldnames=list(judged[0]) if judged else ["row"])
            writer.writeheader()
            writer.writerows(judged)
        method, seed = parse_run_label(run["ours_label"])
        runs[name] = dict(method=method, seed=seed, vs=run["vs"], table=tables[run["ours_label"]],
                          **summarize(judged, run["other_name"]))
        if run["vs"] == "reference":
            # Words, not tokens: the tables hold text only. max(1, .) keeps empty summaries on the plot.
            log_ratios[name] = ([math.log(max(1, j["ours_words"]) / max(1, j["other_words"])) for j in judged],
                                [j["preferred"] for j in judged])

    header = (f"Judge `{meta['model']}`, prompt `{meta['prompt_version']}`, temperature {fmt(meta['temperature'], 2)}, "
              f"A/B order seed {args.seed}. Win rate = wins / (wins + losses); malformed verdicts, ties and "
              "unjudged rows count for neither side. 95% CI: Wilson score interval.")
    with open(os.path.join(args.output_dir, "results.json"), "w") as file:
        json.dump(dict(judge=args.judge, **{k: meta[k] for k in ("model", "prompt_version", "temperature")},
                       seed=args.seed, ci="wilson 95%", runs=runs), file, indent=2)
    with open(os.path.join(args.output_dir, "results.md"), "w") as file:
        file.write(markdown_tables(runs, header))
    if log_ratios:
        pooled = [x for xs, _ in log_ratios.values() for x in xs]
        low, high = (min(pooled), max(pooled)) if pooled else (0.0, 0.0)
        low, high = (low - 0.5, high + 0.5) if high - low < 1e-9 else (low, high)
        edges = [low + (high - low) * k / args.length_bins for k in range(args.length_bins + 1)]
        plot_length_curves({name: length_curve(xs, ps, edges, "reference") for name, (xs, ps) in log_ratios.items()},
                           os.path.join(args.output_dir, "length_vs_winrate.png"))
    print(markdown_tables(runs, header))
    print(f"saved {args.output_dir}/results.json, results.md, length_vs_winrate.png, judged/, judgments.jsonl")
