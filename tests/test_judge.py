"""Tests of judge.py: pure helpers against hand computations, then the real `openai` client over HTTP.

The HTTP tests start a small OpenAI-compatible server on 127.0.0.1 (stdlib ThreadingHTTPServer)
that prefers the longer summary, answers malformed verdicts for marked posts, and injects faults by
request number or by post row: 429 (with Retry-After), 500, a reply that hangs past the client
timeout, 401, 400, HTTP 200 bodies without a usable reply. judge.py runs as a subprocess, as a user
runs it, with short timeouts and backoff delays. tests/test_judge_faults.py reuses this server.
"""

import csv
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import judge
import tiny_world
from conftest import WORLD, run_python

REPO = Path(__file__).resolve().parent.parent
SECRET = "sk-test-DO-NOT-WRITE-ME-0123456789"
QUICK_RETRIES = ["--retry_base_delay", "0.01", "--retry_max_delay", "0.1"]
# 1.5 s: a judge's first call also pays for what the client imports and builds on first use, up to 0.38 s with cold
# bytecode on the AVX2 EPYC in a slow hour (0.05 s for later calls); a call past the timeout is retried and breaks the
# tests' exact call counts. Replies that hang (6 s) stay well past it.
FAST = ["--timeout", "1.5", *QUICK_RETRIES]


# ------------------------------------------------------------------------------------------------
# Pure helpers
# ------------------------------------------------------------------------------------------------


def test_parse_verdict_is_strict():
    assert judge.parse_verdict("Comparison: A is shorter.\nPreferred: A") == "A"
    assert judge.parse_verdict("Comparison: B covers more.\n  Preferred: B  \n") == "B"
    # What the prompt's format line (`Preferred: <"A" or "B">`) and markdown put around a clear answer
    for reply, verdict in (('Comparison: x\nPreferred: "A"', "A"), ("Preferred: A.", "A"), ("**Preferred:** B", "B"),
                           ("**Preferred**: B", "B"), ("__Preferred__: A", "A"),
                           ("Preferred: **B**", "B"), ("Preferred: Summary A", "A"), ("### Preferred: `B`", "B"),
                           ("Preferred: 'A'", "A")):
        assert judge.parse_verdict(reply) == verdict, reply
    for malformed in ["Preferred: a", "Comparison: A", "Preferred: A\nPreferred: B", "Preferred: A or B", "", None,
                      "Preferred: tie", "Preferred:\nA", "Preferred: Summary  A", "Preferred: AB", "Preferred: A, B"]:
        assert judge.parse_verdict(malformed) is None, malformed
    assert judge.parse_verdict("Comparison: equal\nPreferred: tie", allow_tie=True) == "tie"
    # A/B bookkeeping: the verdict names a position, `ours_is_a` says which text sat there.
    assert judge.preferred_side("A", True, "reference") == "ours"
    assert judge.preferred_side("A", False, "reference") == "reference"
    assert judge.preferred_side("B", False, "other") == "ours"
    assert judge.preferred_side(None, True, "reference") == "malformed"
    assert judge.preferred_side("tie", False, "reference") == "tie"


def test_build_prompt_is_appendix_i():
    prompt = judge.build_prompt("SUBREDDIT: r/x\n\nPOST: a {summary_b} brace", "first", "second")
    assert prompt.startswith("Which of the following summaries does a better job of summarizing the most "
                             "important points in the given forum post, without including unimportant or "
                             "irrelevant details? Judge based on accuracy, coverage, and coherence.")
    assert "Post:\nSUBREDDIT: r/x\n\nPOST: a {summary_b} brace\n\nSummary A:\nfirst\n\nSummary B:\nsecond\n\n" in prompt
    assert prompt.endswith('Comparison: <one-sentence comparison and explanation>\nPreferred: <"A" or "B">')
    assert "\\" not in prompt  # the appendix's line-end backslashes are layout (Rafailov et al.'s), not prompt text


def test_order_is_balanced_seeded_and_recorded():
    draws = [judge.ours_is_a(1, row) for row in range(4000)]
    assert abs(sum(draws) / len(draws) - 0.5) < 0.03  # 4 binomial standard deviations (0.0079 each)
    assert draws == [judge.ours_is_a(1, row) for row in range(4000)]  # a rerun draws the same order
    assert draws != [judge.ours_is_a(2, row) for row in range(4000)]
    rows = [dict(query=f" q{i} ", response=f" r{i} ", reference=f" ref{i}<|endoftext|>", score="1.5",
                 reference_score="") for i in range(6)]
    items = judge.make_items("sft", rows, None, seed=1)
    assert [i["ours_is_a"] for i in items] == draws[:6]
    assert (items[2]["post"], items[2]["ours"], items[2]["other"]) == ("q2", "r2", "ref2")
    assert (items[2]["ours_score"], items[2]["other_score"]) == (1.5, None)
    other = [dict(query=f"q{i}", response=f"s{i}", score=str(i)) for i in (4, 1)]  # other run: rows matched by query
    pairs = judge.make_items("a_vs_b", rows, other, seed=1)
    assert [(p["row"], p["ours"], p["other"], p["other_score"]) for p in pairs] == [(1, "r1", "s1", 1.0),
                                                                                    (4, "r4", "s4", 4.0)]


def test_win_rate_ci_and_malformed_by_hand():
    preferred = ["ours"] * 7 + ["reference"] * 3 + ["malformed"] * 2 + ["tie", "unjudged", "unjudged", "unjudged"]
    status = ["judged"] * 13 + ["unjudged", "failed", "failed"]  # a failed row has no verdict: it counts for nobody
    rows = [dict(preferred=p, status=s, ours_words=w, other_words=4, ours_score=None, other_score=None)
            for p, s, w in zip(preferred, status, [10, 2] * 7 + [6, 6])]
    stats = judge.summarize(rows, "reference")
    # the tie counts 1/2: (7 + 1/2) / (7 + 3 + 1); malformed, unjudged and failed rows count for nobody
    assert (stats["n"], stats["wins"], stats["malformed"], stats["ties"], stats["unjudged"]) == (11, 7, 2, 1, 1)
    assert (stats["judged"], stats["failed"], stats["rows"]) == (13, 2, 16)
    assert stats["win_rate"] == pytest.approx(7.5 / 11)
    # Wilson by hand, z = 1.96, p = 7.5/11 = 0.681818, n = 11: center (p + 3.8415/22) / (1 + 3.8415/11) =
    # 0.856430 / 1.349224 = 0.634757; half 1.96 * sqrt(0.216942 / 11 + 3.8415/484) / 1.349224 = 0.241593
    assert stats["ci_low"] == pytest.approx(0.39316, abs=1e-4) and stats["ci_high"] == pytest.approx(0.87635, abs=1e-4)
    without_tie = judge.summarize(rows[:12] + rows[13:], "reference")  # 7 of 10: the rule's other half, no tie
    assert (without_tie["n"], without_tie["win_rate"]) == (10, 0.7)
    assert without_tie["ci_low"] == pytest.approx(0.39678, abs=1e-4) and without_tie["ci_high"] == pytest.approx(0.89222, abs=1e-4)
    assert stats["mean_words"] == 6.0 and stats["mean_other_words"] == 4.0
    low, high = judge.wilson_interval(0, 5)
    assert low == pytest.approx(0.0, abs=1e-12) and high == pytest.approx(0.43448, abs=1e-4)  # never below 0
    assert judge.summarize(rows[10:12] + rows[13:], "reference")["win_rate"] is None  # nothing judged: no win rate
    assert judge.summarize(rows[10:], "reference")["win_rate"] == 0.5  # a lone tie


@pytest.mark.parametrize("stage", ["judge", "reward"])  # judge.py's results and reward.py's --judged_file
def test_rm_agreement_by_hand(stage):
    rm_agreement = __import__(stage).rm_agreement
    preferred = ["ours", "ours", "reference", "reference", "malformed", "tie", "ours", "ours"]
    ours = [2.0, 0.0, -1.0, 3.0, 5.0, 5.0, None, 1.0]
    other = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    # decided with both scores: rows 0 (agree), 1 (no), 2 (agree), 3 (no), 7 (RM tie: agrees with nobody)
    assert rm_agreement(preferred, ours, other) == (pytest.approx(2 / 5), 5)
    assert rm_agreement(["ours"], [None], [None]) == (None, 0)
    assert rm_agreement(["reference", "ours"], [1.0, 1.0], [1.0, 1.0]) == (0.0, 2)  # a tie agrees with no side


def test_rm_agreement_leaves_rows_not_yet_judged_out():
    """An interrupted judge.py run leaves rows "unjudged": no verdict, so no agreement either way (reward.py's
    --judged_file reads such tables)."""
    preferred = ["ours", "unjudged", "reference", "unjudged"]
    assert judge.rm_agreement(preferred, [2.0, 0.0, 0.0, 5.0], [1.0, 1.0, 1.0, 0.0]) == (1.0, 2)


def test_length_curve_by_hand():
    xs = [-1.0, -0.9, 0.1, 0.2, 0.3, 1.0, 1.0]
    ps = ["ours", "reference", "ours", "ours", "malformed", "reference", "ours"]
    curve = judge.length_curve(xs, ps, [-1.0, 0.0, 1.0], "reference")
    assert curve == [(-0.5, 0.5, 2), (0.5, 0.75, 4)]  # the top edge belongs to the last bin
    # a point on an interior edge belongs to the bin above it; a tie counts 1/2: (3 + 1 + 1/2) / 6
    curve = judge.length_curve(xs + [0.0, 0.5], ps + ["ours", "tie"], [-1.0, 0.0, 1.0], "reference")
    assert curve == [(-0.5, 0.5, 2), (0.5, 0.75, 6)]
    # the edges span every run's ratios in equal steps, the largest ratio on the top edge
    assert judge.length_bin_edges([0.3, -0.6, 1.2], 3) == pytest.approx([-0.6, 0.0, 0.6, 1.2])
    assert judge.length_bin_edges([0.2, 0.2], 2) == pytest.approx([-0.3, 0.2, 0.7])  # all equal: one unit around
    # x is log(ours / other): longer than the reference is positive; an empty summary counts as one word
    assert judge.log_length_ratio(20, 10) == pytest.approx(math.log(2)) and judge.log_length_ratio(0, 1) == 0.0


def test_method_table_std_is_over_seeds_sample_std():
    """results.md's per-method row: the mean win rate over the method's seeds and their sample standard deviation
    (n - 1): seeds at 0.6 and 0.7 give 0.071, not the population's 0.050."""
    run = lambda rate, seed: dict(method="ppo", seed=seed, vs="reference", n=10, win_rate=rate, ci_low=0.3,  # noqa: E731
                                  ci_high=0.9, malformed=0, ties=0, unjudged=0, failed=0, mean_words=12.0,
                                  mean_other_words=10.0, rm_agreement=None, n_rm_agreement=0, calls=10,
                                  possibly_billed_twice=0)
    markdown = judge.markdown_tables({"ppo__seed1": run(0.6, 1), "ppo__seed2": run(0.7, 2)}, "# results")
    assert "| ppo | 2 | 0.650 | 0.071 | 12.0 | 20 | 0, 0 |" in markdown
    # A mean over part of the posts says so: the rows left beside it.
    partial = judge.markdown_tables({"ppo__seed1": {**run(0.6, 1), "n": 3, "unjudged": 6, "failed": 1}}, "# results")
    assert "| ppo | 1 | 0.600 | - | 12.0 | 3 | 6, 1 |" in partial


def test_backoff_and_retry_classification():
    import openai

    try:
        import httpx2 as httpx  # the transport openai 3 is built on
    except ImportError:
        import httpx

    class Fixed:
        def uniform(self, low, high):
            return high

    delays = [judge.backoff_delay(k, 0.5, 3.0, Fixed()) for k in range(5)]
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]
    rng = random.Random(0)
    assert all(1.0 <= judge.backoff_delay(1, 1.0, 60, rng) <= 2.0 for _ in range(100))
    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")

    def status(code, headers=None):
        response = httpx.Response(code, request=request, headers=headers or {})
        return openai.APIStatusError("x", response=response, body=None)

    assert all(judge.is_retryable(status(c)) for c in (408, 409, 429, 500, 503))
    assert not any(judge.is_retryable(status(c)) for c in (400, 401, 403, 404, 422))
    assert judge.is_retryable(TimeoutError()) and judge.is_retryable(openai.APITimeoutError(request=request))
    assert not judge.is_retryable(ValueError())
    assert judge.retry_after(status(429, {"retry-after": "2.5"})) == 2.5
    assert judge.retry_after(status(429, {"retry-after": "Wed, 21 Oct"})) == 0.0
    assert judge.retry_after(status(429, {"retry-after-ms": "250", "retry-after": "1"})) == 0.25  # the finer one
    # A 429 that waiting never clears (no credit left, a spend limit; or a server's x-should-retry: false) stops
    # the run; a plain rate limit is retried.
    quota = openai.RateLimitError("x", response=httpx.Response(429, request=request), body={
        "error": {"message": "You exceeded your current quota", "type": "insufficient_quota", "code": "insufficient_quota"}})
    told = status(429, {"x-should-retry": "false"})
    for error in (quota, told):
        assert judge.out_of_quota(error) and judge.stops_run(error) and not judge.is_retryable(error)
    limited = openai.RateLimitError("x", response=httpx.Response(429, request=request), body={
        "error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}})
    assert not judge.out_of_quota(limited) and not judge.stops_run(limited) and judge.is_retryable(limited)
    assert judge.stops_run(status(410)) and not judge.stops_run(status(400))  # a retired model, a bad request
    # Two 400s are the same fault when their code (a string), param and message agree: vLLM and llama.cpp put the
    # status 400 in `code`, so the message tells them apart; a row's own 400 (a post too long) is never a run's.
    bad = lambda body: openai.BadRequestError("Error code: 400 - " + json.dumps(body),  # noqa: E731
                                              response=httpx.Response(400, request=request), body=body)
    vllm = lambda message: bad({"object": "error", "message": message, "type": "BadRequestError", "param": None,  # noqa: E731
                                "code": 400})
    assert judge.bad_request_kind(vllm("context 2048, requested 2100")) != \
        judge.bad_request_kind(vllm("context 2048, requested 2300"))
    # vLLM's int code 400 is no code: the message alone (the error's text) names the fault
    assert judge.bad_request_kind(vllm("temperature must be 1")) == (None, None, str(vllm("temperature must be 1"))[:300])
    assert judge.bad_request_kind(bad({"error": {"message": "This model's maximum context length is 128000 tokens",
                                                 "type": "invalid_request_error", "param": "messages",
                                                 "code": "context_length_exceeded"}})) is None
    # A cached reply is parsed again: a verdict an older, stricter parse_verdict cached as malformed now counts.
    assert judge.cached_verdict({"reply": 'Comparison: x\nPreferred: "A"', "verdict": None, "model": "m"}) == "A"
    assert judge.cached_verdict({"reply": "Preferred: tie", "verdict": "tie", "model": judge.GOLD_MODEL}) == "tie"
    assert judge.cached_verdict({"verdict": "B"}) == "B"  # a record without its reply keeps its verdict


def test_cache_survives_a_torn_line(tmp_path):
    path = tmp_path / "judgments.jsonl"
    path.write_text(json.dumps({"key": "k1", "verdict": "A"}) + "\n" + '{"key": "k2", "ver')  # killed mid-write
    cache, bad = judge.load_cache(str(path))
    assert list(cache) == ["k1"] and bad == 1
    with judge.open_cache_for_append(str(path)) as file:
        file.write(json.dumps({"key": "k3"}) + "\n")
    cache, bad = judge.load_cache(str(path))
    assert list(cache) == ["k1", "k3"] and bad == 1
    assert judge.load_cache(str(tmp_path / "absent.jsonl")) == ({}, 0)


# ------------------------------------------------------------------------------------------------
# An OpenAI-compatible test server
# ------------------------------------------------------------------------------------------------
PROMPT_RE = re.compile(r"Post:\n(.*)\n\nSummary A:\n(.*)\n\nSummary B:\n(.*)\n\nFIRST provide", re.S)


class JudgeServer:
    """Serves POST /v1/chat/completions: prefers the longer summary; `faults` by 1-based request number.

    `row_faults` {post row: [fault, ...]}: the row's k-th request gets the k-th fault, later ones a
    normal reply. Faults: 429, quota (429 insufficient_quota), 500, 401, 400 (its message echoes the request's path and
    Authorization header, as some servers do), hang, and HTTP 200s: nonjson (a JSON content type
    over an HTML body), html (served as text/html), nochoices, echo (a normal verdict after the
    path and Authorization header). `hold_after` N: the replies to requests after the N-th wait until `released`
    is set (a client killed meanwhile has exactly N answers)."""

    def __init__(self, faults=None, delay=0.0, hang=6.0, row_faults=None, hold_after=None):
        self.faults, self.delay, self.hang = dict(faults or {}), delay, hang
        self.hold_after, self.released = hold_after, threading.Event()
        self.row_faults = {row: list(faults) for row, faults in (row_faults or {}).items()}
        self.lock = threading.Lock()
        self.requests = []  # (request number, post row id, fault or None, request body)
        self.seen = []  # (request path with query, Authorization header) of each request
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][-1]["content"]
                post, a, b = PROMPT_RE.search(prompt).groups()
                row = int(re.search(r"post (\d+)", post).group(1))
                with server.lock:
                    number = len(server.requests) + 1
                    queued = server.row_faults.get(row)
                    fault = server.faults.get(number) or (queued.pop(0) if queued else None)
                    server.requests.append((number, row, fault, body))
                    server.seen.append((self.path, self.headers.get("Authorization")))
                echoed = f"{self.path} {self.headers.get('Authorization')}"
                if fault == "hang":
                    time.sleep(server.hang)  # the client gave up long ago
                    return
                if fault in ("429", "500", "401", "400"):
                    message = f"injected {fault}" + (f" for {echoed}" if fault == "400" else "")
                    payload = {"error": {"message": message, "type": "test", "code": None}}
                    return self.send(int(fault), payload, {"retry-after": "0.02"} if fault == "429" else {})
                if fault == "quota":  # OpenAI's answer to an account out of credit: a 429 that waiting never clears
                    payload = {"error": {"message": "You exceeded your current quota, please check your plan and "
                                         "billing details.", "type": "insufficient_quota", "param": None,
                                         "code": "insufficient_quota"}}
                    return self.send(429, payload, {"retry-after": "0.02"})
                if fault in ("nonjson", "html"):
                    return self.send(200, None, raw=b"<html>upstream hiccup</html>",
                                     content_type="text/html" if fault == "html" else "application/json")
                time.sleep(server.delay)
                if server.hold_after is not None and number > server.hold_after:
                    server.released.wait(60)
                if "MALFORMED" in post:
                    content = "Comparison: both are fine.\nPreferred: A or B"
                else:
                    content = f"Comparison: the longer one says more.\nPreferred: {'A' if len(a) > len(b) else 'B'}"
                if fault == "echo":
                    content = f"You sent {echoed}.\n{content}"
                choices = [] if fault == "nochoices" else [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}]
                self.send(200, {
                    "id": f"chatcmpl-{number}", "object": "chat.completion", "created": int(time.time()),
                    "model": body["model"], "choices": choices,
                    "usage": {"prompt_tokens": 100, "completion_tokens": 12, "total_tokens": 112}})

            def send(self, code, payload, headers=None, raw=None, content_type="application/json"):
                data = raw if raw is not None else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            daemon_threads, block_on_close = True, False

            def handle_error(self, request, client_address):
                pass  # a client that timed out closed the socket under a hanging reply

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def rows(self, start=0):
        """Post row ids of the requests from number start+1 on."""
        with self.lock:
            return [r[1] for r in self.requests[start:]]


@pytest.fixture
def server_factory():
    servers = []

    def make(**kwargs):
        servers.append(JudgeServer(**kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.httpd.shutdown()
        server.httpd.server_close()


def write_table(path, rows):
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def llm_rows(n, malformed=()):
    """Rows whose summaries differ in length (ours longer when row % 3 != 0); marked posts get malformed replies."""
    return [dict(query=f"SUBREDDIT: r/test\n\nTITLE: post {i}\n\nPOST: story {i}{' MALFORMED' * (i in malformed)}"
                       f".\n\nTL;DR:",
                 response=f" ours {i} " + ("long " * 8 if i % 3 else ""), reference=f"the reference {i} of mid length")
            for i in range(n)]


def judge_cmd(*flags):
    """judge.py with `flags`, after a judge model of the test server's (a later --model in `flags` wins)."""
    return [sys.executable, str(REPO / "judge.py"), "--model", "judge-test", *flags]


def judge_env():
    return {**os.environ, "OPENAI_API_KEY": SECRET, "NO_PROXY": "127.0.0.1,localhost"}


def run_judge(*flags, timeout=120):
    """judge.py with `flags` (judge_cmd), run to its end as a fresh start (conftest.run_python) -> CompletedProcess."""
    return run_python(judge_cmd(*flags), timeout=timeout, env=judge_env())


def read_csv(path):
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


# ------------------------------------------------------------------------------------------------
# The real client over HTTP
# ------------------------------------------------------------------------------------------------


def test_llm_judge_over_http_with_faults(tmp_path, server_factory):
    server = server_factory(faults={1: "429", 2: "500", 3: "hang"})
    rows = llm_rows(16, malformed={5})
    table = write_table(tmp_path / "sft.csv", rows)
    out = tmp_path / "out"
    flags = ["--base_url", server.url, "--tables", f"sft__seed3={table}", "--output_dir", str(out),
             "--max_concurrency", "4", "--model", "judge-test", *FAST]
    proc = run_judge(*flags)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # Every fault was retried once, nothing else was asked twice: 16 rows + 3 retries.
    assert len(server.requests) == 16 + 3
    assert sorted(server.rows()) == sorted(list(range(16)) + [r for _, r, f, _ in server.requests if f])
    assert {(b["model"], b["temperature"]) for *_, b in server.requests} == {("judge-test", 1.0)}
    records = [json.loads(line) for line in (out / "judgments.jsonl").read_text().splitlines()]
    assert len(records) == 16 and sum(r["attempts"] for r in records) == 19
    # The hang was abandoned at the timeout and may have been billed: its re-ask is counted.
    hung = server.requests[2][1]
    assert [(r["row"], r["abandoned"], r["billed_twice"]) for r in records if r["abandoned"]] == [(hung, 1, 1)]
    assert {r["temperature"] for r in records} == {1.0} and {r["prompt_version"] for r in records} == {"appendix-i-v1"}

    # The server prefers the longer summary: ours wins exactly where it is longer; row 5 is malformed.
    longer = [len(r["response"].strip()) > len(r["reference"].strip()) for r in rows]
    decided = [i for i in range(16) if i != 5]
    wins = sum(longer[i] for i in decided)
    result = json.loads((out / "results.json").read_text())
    stats = result["runs"]["sft__seed3"]
    assert (stats["n"], stats["wins"], stats["malformed"], stats["ties"]) == (15, wins, 1, 0)
    assert (stats["judged"], stats["failed"], stats["unjudged"], stats["calls"], stats["possibly_billed_twice"]) == \
        (16, 0, 0, 19, 1)
    assert result["this_run"] == dict(to_ask=16, judged=16, malformed=1, failed=0, unjudged=0, calls=19,
                                      possibly_billed_twice=1, stopped=None)
    assert result["totals"] == dict(rows=16, judged=16, malformed=1, failed=0, unjudged=0, calls=19,
                                    possibly_billed_twice=1)
    assert stats["win_rate"] == pytest.approx(wins / 15)
    assert (stats["ci_low"], stats["ci_high"]) == pytest.approx(judge.wilson_interval(wins, 15))
    assert (stats["method"], stats["seed"], result["temperature"]) == ("sft", "3", 1.0)  # the paper's (the API default)
    judged = read_csv(out / "judged" / "sft__seed3.csv")
    assert {j["ours_is_a"] for j in judged} == {"True", "False"}  # both orders occur, each recorded
    for j, is_longer in zip(judged, longer):
        want = "malformed" if j["row"] == "5" else "ours" if is_longer else "reference"
        assert j["preferred"] == want, j
        assert j["verdict"] == ("" if want == "malformed" else "A" if is_longer == (j["ours_is_a"] == "True") else "B")
    assert "| sft__seed3 | sft | 3 | reference | 15 |" in (out / "results.md").read_text()
    assert (out / "length_vs_winrate.png").stat().st_size > 0

    # A rerun asks nothing and reports the same; the key is written nowhere.
    again = run_judge(*flags)
    assert again.returncode == 0 and len(server.requests) == 19
    rerun = json.loads((out / "results.json").read_text())
    assert rerun["runs"] == result["runs"] and rerun["totals"] == result["totals"]
    assert (rerun["this_run"]["to_ask"], rerun["this_run"]["calls"]) == (0, 0)
    for path in out.rglob("*"):
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path
    assert SECRET not in proc.stdout + proc.stderr + again.stdout + again.stderr


def test_killed_run_resumes_without_repeats(tmp_path, server_factory):
    server = server_factory(delay=0.2, hold_after=5 + 6)  # run 2's replies after its 6th wait: the kill comes then
    n = 24
    table = write_table(tmp_path / "ppo.csv", llm_rows(n, malformed={7}))
    out = tmp_path / "out"
    flags = ["--base_url", server.url, "--tables", f"ppo={table}", "--output_dir", str(out),
             "--max_concurrency", "2", *QUICK_RETRIES, "--timeout", "30"]
    # A long request timeout: on a busy machine a short one can expire and be retried, and the checks below count
    # every ask (a retry is not a repeat of cached work, but it would be counted as one).

    def cached_rows():
        return sorted(r["row"] for r in judge.load_cache(str(out / "judgments.jsonl"))[0].values())

    # 1. A budget stop: exactly 5 judgments, the rest reported as unjudged.
    proc = run_judge(*flags, "--max_new_judgments", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(server.requests) == 5 and len(cached_rows()) == 5
    assert json.loads((out / "results.json").read_text())["runs"]["ppo"]["unjudged"] == n - 5
    first = cached_rows()

    # 2. Killed half-way (SIGKILL: no cleanup at all).
    process = subprocess.Popen(judge_cmd(*flags), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=judge_env())
    deadline = time.time() + 60
    while (len(cached_rows()) < 5 + 6 or len(server.requests) < 5 + 6 + 2) and time.time() < deadline:
        time.sleep(0.01)  # 6 more saved, and the next 2 asked and held
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    server.released.set()
    asked_2 = server.rows(5)
    assert not set(asked_2) & set(first), "run 2 asked again what run 1 had cached"
    second = cached_rows()
    assert len(second) == 11, second
    in_flight = set(asked_2) - set(second)  # asked but not answered when the kill came
    assert len(in_flight) == 2  # max_concurrency judgments are lost in flight, none written is

    # 3. Started again: asks exactly what is missing, once, and completes.
    before = len(server.requests)
    proc = run_judge(*flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    asked_3 = server.rows(before)
    assert sorted(asked_3) == sorted(set(range(n)) - set(second))
    records = (out / "judgments.jsonl").read_text().splitlines()
    assert len(records) == n and cached_rows() == list(range(n))  # every row exactly once, none lost
    stats = json.loads((out / "results.json").read_text())["runs"]["ppo"]
    assert (stats["n"], stats["malformed"], stats["unjudged"]) == (n - 1, 1, 0)


def test_run_level_faults_stop_the_run_row_faults_do_not(tmp_path, server_factory):
    table = write_table(tmp_path / "t.csv", llm_rows(3))
    # A 401 is not retried and every other row would meet it too: the run stops at once, with the
    # error, caches nothing, and still writes results that say so.
    server = server_factory(faults={1: "401"})
    proc = run_judge("--base_url", server.url, "--tables", f"t={table}", "--output_dir", str(tmp_path / "a"),
                     "--max_concurrency", "1", *FAST)
    assert proc.returncode == 1 and "AuthenticationError" in proc.stderr and "rerun" in proc.stderr
    assert len(server.requests) == 1 and (tmp_path / "a" / "judgments.jsonl").read_text() == ""
    result = json.loads((tmp_path / "a" / "results.json").read_text())
    assert result["runs"]["t"]["unjudged"] == 3 and "AuthenticationError" in result["this_run"]["stopped"]
    # Retries are bounded per row: 1 call + 2 retries of 500, then the row is recorded as failed and
    # the next row is asked; the run finishes, exit status 3, every failure counted and listed.
    server = server_factory(faults={k: "500" for k in range(1, 10)})
    proc = run_judge("--base_url", server.url, "--tables", f"t={table}", "--output_dir", str(tmp_path / "b"),
                     "--max_concurrency", "1", "--max_retries", "2", *FAST)
    assert proc.returncode == 3 and "InternalServerError" in proc.stderr and "a rerun asks 3 of them" in proc.stderr
    assert sorted(server.rows()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    result = json.loads((tmp_path / "b" / "results.json").read_text())
    assert (result["runs"]["t"]["failed"], result["runs"]["t"]["calls"], result["runs"]["t"]["n"]) == (3, 9, 0)
    assert [(f["row"], f["failed_runs"], f["asked_by_rerun"]) for f in result["failures"]] == \
        [(0, 1, True), (1, 1, True), (2, 1, True)]
    assert all(f["error"].startswith("InternalServerError") for f in result["failures"])
    # A server that cannot be reached fails every row alike: the run stops instead of burning retries.
    closed = server_factory()
    closed.httpd.shutdown()
    closed.httpd.server_close()
    proc = run_judge("--base_url", closed.url, "--tables", f"t={table}", "--output_dir", str(tmp_path / "d"),
                     "--max_retries", "1", *FAST)
    assert proc.returncode == 1 and "APIConnectionError" in proc.stderr
    assert "cannot reach 127.0.0.1 (is this machine offline? another server: --base_url;" in proc.stderr, proc.stderr
    assert json.loads((tmp_path / "d" / "results.json").read_text())["runs"]["t"]["unjudged"] == 3
    # No key, no call, and nothing written.
    env = {k: v for k, v in judge_env().items() if k != "OPENAI_API_KEY"}
    proc = run_python(judge_cmd("--tables", f"t={table}", "--output_dir", str(tmp_path / "c")), timeout=60, env=env)
    assert proc.returncode == 1 and "OPENAI_API_KEY" in proc.stderr and not (tmp_path / "c").exists()



def test_an_exhausted_quota_stops_the_run_instead_of_retrying_every_row(tmp_path, server_factory):
    """An account out of credit gets 429 insufficient_quota on every call: retrying each row for minutes would take
    hours over a validation split. The run stops at the first one, keeps the verdicts it has, and says why."""
    table = write_table(tmp_path / "t.csv", llm_rows(4))
    server = server_factory(faults={2: "quota"})
    proc = run_judge("--base_url", server.url, "--tables", f"t={table}", "--output_dir", str(tmp_path / "q"),
                     "--max_concurrency", "1", *FAST)
    assert proc.returncode == 1 and "no quota left (429 insufficient_quota" in proc.stderr and "rerun" in proc.stderr
    assert len(server.requests) == 2  # row 0 judged, row 1's first 429 not retried, rows 2 and 3 never asked
    result = json.loads((tmp_path / "q" / "results.json").read_text())
    assert (result["runs"]["t"]["n"], result["runs"]["t"]["unjudged"]) == (1, 3)
    assert "RateLimitError" in result["this_run"]["stopped"]


def test_the_openai_judge_needs_a_model_named(tmp_path):
    """The paper's judge (gpt-3.5-turbo-0125) is shut down, so no model is a default: without --model the run stops
    before writing anything and says why; the tiny world's gold judge needs none."""
    table = write_table(tmp_path / "t.csv", llm_rows(2))
    proc = run_python([sys.executable, str(REPO / "judge.py"), "--tables", f"t={table}", "--output_dir",
                       str(tmp_path / "o")], timeout=60, env=judge_env())
    assert proc.returncode == 1 and "--model: required with --judge openai" in proc.stderr
    assert "gpt-3.5-turbo-0125, was shut down" in proc.stderr and not (tmp_path / "o").exists()
    assert judge.flag_problems(judge.Args(judge="gold", tables=(f"t={table}",), output_dir=str(tmp_path / "g"))) == []

# ------------------------------------------------------------------------------------------------
# The gold judge: several tables at once, a head-to-head pair, the markdown table
# ------------------------------------------------------------------------------------------------


def gold_rows(variant, n=12):
    """Tiny-world posts; `variant` picks our summary: faithful, padded with filler, or the reference itself."""
    rows = []
    for i in range(n):
        actor, verb, obj = tiny_world.ACTORS[i % 7], tiny_world.VERBS[i % 5], tiny_world.OBJECTS[i % 9]
        feeling, food = tiny_world.FEELINGS[i % 4], tiny_world.FOODS[i % 5]
        query = (f"SUBREDDIT: r/relationships\n\nTITLE: my {actor} {verb} my {obj}\n\nPOST: My {actor} {verb} my "
                 f"{obj} yesterday. It was rainy and I was eating {food}. I am so {feeling}.\n\nTL;DR:")
        reference = f"my {actor} {verb} my {obj}"
        response = {"sft": [f" my {actor} {verb} my {obj} and i feel {feeling}", f" my {actor} {verb} my {obj}",
                            f" i ate {food}"][i % 3],
                    "ppo": [f" my {actor} {verb} my {obj} and i am {feeling} about it", f" it was rainy and {food}",
                            f" my {actor} {verb} my {obj} {feeling} {feeling} {food}"][i % 3]}[variant]
        rows.append(dict(query=query, response=response, reference=reference,
                         score=f"{(i % 5) - 2.0}", reference_score="0.0"))
    return rows


def test_the_gold_judge_refuses_posts_that_are_not_the_tiny_worlds(tmp_path):
    """The gold judge scores any text, a real post's summary as confidently as a world's (a win rate of 1.000 on a
    Reddit post): tables whose posts hold words no world post can hold are refused, named, before anything is written;
    every post of the committed world passes."""
    import datasets

    world = datasets.load_dataset(str(WORLD / "tldr_3_filtered"))  # the world's posts, as preprocess formats them
    queries = [f"SUBREDDIT: r/{row['subreddit']}\n\nTITLE: {row['title']}\n\nPOST: {row['post']}\n\nTL;DR:"
               for split in world.values() for row in split]
    assert judge.not_the_tiny_world([{"query": query} for query in queries]) is None
    real = dict(query="SUBREDDIT: r/relationships\n\nTITLE: My boyfriend forgot my birthday\n\nPOST: We have been "
                      "together for two years and he completely forgot it.\n\nTL;DR:",
                response=" boyfriend forgot my birthday", reference="my boyfriend forgot my birthday")
    table = write_table(tmp_path / "real.csv", [*gold_rows("sft", 2), real])
    result = run_python(judge_cmd("--judge", "gold", "--tables", f"real={table}", "--output_dir", str(tmp_path / "out")),
                        timeout=60, env=judge_env())
    assert result.returncode == 1 and "data row 2's post is not the tiny world's (it holds 'completely', 'have', " \
        "'he', 'together', ..., words no world post holds)" in result.stderr, result.stderr[-2000:]
    assert "judge these with --judge openai" in result.stderr and not (tmp_path / "out").exists()


def test_gold_judge_tables_and_pairs(tmp_path):
    tables = {"sft": gold_rows("sft"), "ppo__seed1": gold_rows("ppo"), "ppo__seed2": gold_rows("ppo")[:9]}
    flags = []
    for label, rows in tables.items():
        flags.append(f"{label}={write_table(tmp_path / f'{label}.csv', rows)}")
    out = tmp_path / "out"
    proc = run_judge("--judge", "gold", "--tables", *flags, "--pairs", "ppo__seed1:sft", "--output_dir", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert list(runs) == ["sft", "ppo__seed1", "ppo__seed2", "ppo__seed1_vs_sft"]

    def naive(rows, others):  # gold scores compared in a plain loop; the post is query.strip()
        win = loss = tie = agree = 0
        for row, other in zip(rows, others):
            post = row["query"].strip()
            ours, theirs = tiny_world.gold_score(post, row["response"].strip()), tiny_world.gold_score(post, other)
            win, loss, tie = win + (ours > theirs), loss + (ours < theirs), tie + (ours == theirs)
            if ours != theirs:  # the RM agrees when it ranks the gold judge's winner higher (an RM tie: never)
                rm_ours, rm_theirs = float(row["score"]), float(row["reference_score"])
                agree += rm_ours > rm_theirs if ours > theirs else rm_ours < rm_theirs
        return win, loss, tie, agree

    for label, rows in tables.items():
        win, loss, tie, agree = naive(rows, [r["reference"] for r in rows])
        stats = runs[label]
        assert (stats["wins"], stats["n"], stats["ties"], stats["malformed"]) == (win, win + loss + tie, tie, 0), label
        assert stats["win_rate"] == pytest.approx((win + tie / 2) / (win + loss + tie))  # a tie counts 1/2
        assert stats["rm_agreement"] == pytest.approx(agree / (win + loss)) and stats["n_rm_agreement"] == win + loss
        words = sum(len(r["response"].split()) for r in rows) / len(rows)
        assert stats["mean_words"] == pytest.approx(words)
    assert runs["sft"]["ties"] == 4  # every third sft summary is the reference itself
    win, loss, tie, _ = naive(tables["ppo__seed1"], [r["response"].strip() for r in tables["sft"]])
    pair = runs["ppo__seed1_vs_sft"]
    assert (pair["wins"], pair["n"], pair["ties"], pair["vs"]) == (win, win + loss + tie, tie, "sft")
    markdown = (out / "results.md").read_text()
    assert f"| ppo__seed2 | ppo | 2 | reference | {runs['ppo__seed2']['n']} |" in markdown
    mean = (runs["ppo__seed1"]["win_rate"] + runs["ppo__seed2"]["win_rate"]) / 2
    assert f"| ppo | 2 | {mean:.3f} |" in markdown and "| sft | 1 |" in markdown
    assert markdown in proc.stdout  # the same table is printed
    assert (out / "length_vs_winrate.png").stat().st_size > 0
    assert json.loads((out / "args.json").read_text())["judge"] == "gold"
    judged = read_csv(out / "judged" / "ppo__seed2.csv")  # every comparison with its recorded order and reply
    assert len(judged) == 9 and all(j["reply"].startswith("Comparison: gold score") for j in judged)

    # A second call into the same folder judges only PPO: judged/ then holds its runs alone, as results.md
    # does (reward.py --judged_file reads judged/), while the cache keeps the first call's verdicts.
    cache = (out / "judgments.jsonl").read_text()
    proc = run_judge("--judge", "gold", "--tables", flags[1], "--output_dir", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(out / "judged")) == ["ppo__seed1.csv"]
    assert list(json.loads((out / "results.json").read_text())["runs"]) == ["ppo__seed1"]
    assert (out / "judgments.jsonl").read_text() == cache  # every verdict cached: nothing asked again, nothing lost


def test_input_notes_name_what_a_start_may_not_mean():
    """Printed, not refused: flags the gold judge reads none of, a seed label with one underscore (results.md would
    make it a method of its own), tables of different lengths (each win rate over its own posts)."""
    from types import SimpleNamespace

    def table(*queries):
        return [{"query": query} for query in queries]

    gold = SimpleNamespace(judge="gold", model=None, base_url=None, temperature=1.0)
    assert judge.input_notes(gold, {"sft": table("a", "b"), "ppo__seed1": table("a", "b")}) == []
    notes = judge.input_notes(SimpleNamespace(**{**vars(gold), "temperature": 0.0}),
                              {"ppo_seed1": table("a", "b"), "sft": table("a")})
    assert notes[0].startswith("--judge gold scores with tiny_world.gold_score")
    assert "label ppo_seed1: seeds are written with two underscores (ppo__seed1)" in notes[1]
    assert notes[2] == ("the tables hold different numbers of posts (ppo_seed1 2, sft 1): each win rate is over its "
                        "own table's posts")
    llm = SimpleNamespace(judge="openai", model="m", base_url=None, temperature=0.0)
    assert judge.input_notes(llm, {"my_seedless_run": table("a")}) == []
    assert judge.input_notes(llm, {"sft": table("a", "b ", " b", "a", "c")}) == [
        "table sft: 2 row(s) repeat an earlier row's query (data row 2 repeats row 1...): each row is a comparison "
        "against the references, and in a pair against this table the last row of a query is the one compared"]


def test_a_sample_table_with_a_bare_carriage_return_reads_back_whole(tmp_path):
    """A sampled token can be a bare "\r" (Pythia's vocabulary has it). The stages write their tables with "\r\n" row
    ends, so csv quotes such a cell; with pandas' "\n" it stayed bare, and judge.py's reader ended the row there and
    refused the whole table after the run."""
    import dpo
    import sft

    rows = [{"query": "SUBREDDIT: r/a\n\nTL;DR:", "response": " first\rsecond", "reference": " a ref, a comma"},
            {"query": "x", "response": "\r", "reference": " \r\n"}]
    for module in (sft, dpo):
        module.write_summaries(str(tmp_path), rows, f"{module.__name__}.csv", None)
        assert judge.read_table(str(tmp_path / f"{module.__name__}.csv"), -1, ("query", "response", "reference")) == rows
    # every table a stage writes with pandas ends its rows so (reward.py's and dpo.py's eval tables, ppo.py's samples)
    for script in ("sft.py", "reward.py", "dpo.py", "ppo.py"):
        calls = re.findall(r"\.to_csv\((.*)$", (REPO / script).read_text(), re.M)  # each call fits on its line
        assert calls and all('lineterminator="\\r\\n"' in call for call in calls), (script, calls)
