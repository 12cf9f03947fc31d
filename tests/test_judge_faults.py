"""judge.py under faults and bad input (issue 16): nothing computed is lost, nothing secret is written.

The HTTP tests run judge.py as a subprocess against the OpenAI-compatible test server of
tests/test_judge.py, with faults injected per post row: a 400 on every request, HTTP 200 bodies
without a usable reply, replies that hang past the client timeout, a server echoing credentials.
Each one checks that the verdicts judged before the fault are still in the cache and the results.
"""

import asyncio
import base64
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

import judge
from conftest import run_python
from test_judge import (FAST, REPO, SECRET, judge_cmd, judge_env, llm_rows, read_csv, run_judge,  # noqa: F401
                        server_factory, write_table)


def cached(out):
    """judgments.jsonl as {row: last record} (rows of one table, so rows are distinct)."""
    return {r["row"]: r for r in judge.load_cache(str(out / "judgments.jsonl"))[0].values()}


def verdicts(out):
    """{row: verdict} of the rows the judge answered."""
    return {row: r["verdict"] for row, r in cached(out).items() if r.get("status", "judged") == "judged"}


def results(out):
    return json.loads((out / "results.json").read_text())


def flags_for(server_url, table, out, *extra):
    """judge.py's flags for one table `sft`; `extra` last, so it overrides FAST (the last value wins)."""
    return ["--base_url", server_url, "--tables", f"sft={table}", "--output_dir", str(out), *FAST, *extra]


# ------------------------------------------------------------------------------------------------
# Pure helpers
# ------------------------------------------------------------------------------------------------


def test_redact_url_and_scrub():
    url = "http://judge-user:pa%2Fss-word@host:8000/v1?api_key=K-123456&token=T-654321&api-version=2024#frag-abcdef"
    assert judge.redact_url(url) == "http://***@host:8000/v1?api_key=***&token=***&api-version=***"
    assert judge.redact_url("https://sk-bare-key-123456@host/v1?sk-bare-token-12") == "https://***@host/v1?***"
    assert judge.redact_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/v1" and judge.redact_url(None) is None
    secrets = judge.url_secrets(url)
    assert {"judge-user", "pa%2Fss-word", "pa/ss-word", "K-123456", "T-654321", "frag-abcdef"} <= set(secrets)
    assert base64.b64encode(b"judge-user:pa/ss-word").decode() in secrets  # what httpx sends as Basic auth
    text = "401 for /v1?api_key=K-123456 Basic " + base64.b64encode(b"judge-user:pa/ss-word").decode()
    assert judge.scrub(text, secrets) == "401 for /v1?api_key=*** Basic ***"
    # Short strings are no keys: scrubbing them would eat the verdict.
    assert judge.scrub("Comparison: x\nPreferred: A", ["A", "x"]) == "Comparison: x\nPreferred: A"
    assert judge.scrub(None, secrets) is None
    # A server's masked quote of the key keeps its last characters: gone too, the rest of the message kept.
    key = "sk-proj-abcdefghijklmnop1234"
    assert judge.scrub(f"Incorrect API key provided: sk-proj-{'*' * 16}1234. You can find", [key]) == \
        "Incorrect API key provided: ***. You can find"
    assert judge.scrub("x ****1235 y", [key]) == "x ****1235 y"  # another key's tail
    assert judge.split_endpoint("http://u:p@h:1/v1?api_key=K&x=") == ("http://u:p@h:1/v1", {"api_key": "K", "x": ""})
    assert judge.split_endpoint(None) == (None, {})
    for good in ("http://127.0.0.1:8000/v1", "https://api.example.com", "http://u:p@h/v1?k=v"):
        assert judge.endpoint_is_valid(good), good
    for bad in ("127.0.0.1:8000/v1", "user:KEY@host/v1", "ftp://h/v1", "http://", "http://h:port/v1", ""):
        assert not judge.endpoint_is_valid(bad), bad


def test_flag_problems_name_every_bad_flag(tmp_path):
    table = write_table(tmp_path / "t.csv", llm_rows(2))
    good = judge.Args(tables=(f"t={table}",), output_dir=str(tmp_path / "out"), model="judge-test")
    assert judge.flag_problems(good) == []
    (tmp_path / "a_file").write_text("")
    bad = {"n": 0, "temperature": -0.1, "max_concurrency": 0, "timeout": 0.0, "max_retries": -1,
           "retry_base_delay": -1.0, "retry_max_delay": 0.5, "max_new_judgments": -2, "failed_row_retries": -1,
           "length_bins": 0, "model": " "}
    for flag, value in bad.items():
        problems = judge.flag_problems(dataclasses.replace(good, **{flag: value}))
        assert len(problems) == 1 and problems[0].startswith(f"--{flag} "), (flag, problems)
    cases = {"tables": ((f"t={table}", f"t={table}"), "--tables"), "pairs": (("t:other",), "--pairs t:other"),
             "output_dir": (str(tmp_path / "a_file"), "--output_dir"),
             "base_url": ("user:KEY-123456@host/v1", "--base_url (not shown")}
    for flag, (value, start) in cases.items():
        problems = judge.flag_problems(dataclasses.replace(good, **{flag: value}))
        assert len(problems) == 1 and problems[0].startswith(start) and "KEY-123456" not in problems[0], problems
    problems = judge.flag_problems(dataclasses.replace(good, tables=("t=missing.csv", "no label")))
    assert problems[0] == "--tables t=missing.csv: no file missing.csv" and problems[1].startswith("--tables entry")
    assert judge.flag_problems(dataclasses.replace(good, reference=False))[0].startswith("--no_reference")


def test_call_with_retries_counts_abandoned_calls():
    async def run(outcomes, tally, max_retries=3):
        outcomes = list(outcomes)

        async def call():
            outcome = outcomes.pop(0)
            if outcome == "hang":
                await asyncio.sleep(5)  # abandoned at the 0.05 s timeout
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        try:
            return await judge.call_with_retries(call, tally, timeout=0.05, max_retries=max_retries, base=0.0,
                                                 cap=0.0, rng=random.Random(0))
        except Exception as error:
            return error

    fresh = lambda: dict(calls=0, abandoned=0, billed_twice=0, failed_runs=0)  # noqa: E731
    tally = fresh()
    assert asyncio.run(run(["hang", "hang", "ok"], tally)) == "ok"
    assert tally == dict(calls=3, abandoned=2, billed_twice=2, failed_runs=0)  # both re-asks may pay twice
    tally = fresh()
    assert isinstance(asyncio.run(run(["hang", "hang"], tally, max_retries=1)), TimeoutError)  # retries spent
    assert tally == dict(calls=2, abandoned=2, billed_twice=1, failed_runs=0)
    tally = fresh()
    bad = judge.BadReply("HTTP 200 without choices")
    assert asyncio.run(run([bad, "ok"], tally)) is bad  # a 200 may be billed: not re-asked at once
    assert tally == dict(calls=1, abandoned=1, billed_twice=0, failed_runs=0)
    tally = dict(calls=3, abandoned=1, billed_twice=0, failed_runs=1)  # a row that timed out in an earlier run
    assert asyncio.run(run(["ok"], tally)) == "ok" and tally["billed_twice"] == 1


def test_write_atomic_keeps_the_old_file_when_a_write_fails(tmp_path):
    path = str(tmp_path / "results.json")
    judge.write_text_atomic(path, '{"old": 1}')

    def killed_half_way(partial):
        with open(partial, "w") as file:
            file.write('{"new": ')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        judge.write_atomic(path, killed_half_way)
    assert json.loads(open(path).read()) == {"old": 1}  # a reader never sees half a file
    judge.write_text_atomic(path, '{"new": 2}')
    assert json.loads(open(path).read()) == {"new": 2} and os.listdir(tmp_path) == ["results.json"]


# ------------------------------------------------------------------------------------------------
# The real client over HTTP
# ------------------------------------------------------------------------------------------------


def test_the_same_400_on_the_first_rows_stops_the_run_but_not_once_a_row_was_judged(tmp_path, server_factory):
    """A flag the server rejects (a temperature a reasoning model refuses) gets every row the same 400: the first 3
    rows asked, none judged, stop the run with a message that says so. The same 400s after a verdict with these
    settings (in this run or a cached one) are row faults: the run goes on and lists them."""
    table = write_table(tmp_path / "sft.csv", llm_rows(6))
    server = server_factory(row_faults={row: ["400"] for row in range(6)})
    proc = run_judge(*flags_for(server.url, table, tmp_path / "a", "--max_concurrency", "1"))
    assert proc.returncode == 1 and "the first 3 rows asked all got the same 400" in proc.stderr
    assert sorted(server.rows()) == [0, 1, 2] and results(tmp_path / "a")["runs"]["sft"]["failed"] == 3
    server = server_factory(row_faults={row: ["400"] for row in range(1, 6)})  # row 0 is judged first
    proc = run_judge(*flags_for(server.url, table, tmp_path / "b", "--max_concurrency", "1"))
    assert proc.returncode == 3 and sorted(server.rows()) == list(range(6))
    assert (results(tmp_path / "b")["runs"]["sft"]["n"], results(tmp_path / "b")["runs"]["sft"]["failed"]) == (1, 5)

def test_row_that_always_fails_is_counted_and_retried_a_bounded_number_of_times(tmp_path, server_factory):
    server = server_factory(row_faults={2: ["400"] * 99})  # e.g. a post the server refuses
    table = write_table(tmp_path / "sft.csv", llm_rows(6))
    out = tmp_path / "out"
    flags = flags_for(server.url, table, out, "--max_concurrency", "2", "--failed_row_retries", "2")
    proc = run_judge(*flags)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "failed: sft row 2 in 1 run(s): BadRequestError" in proc.stderr and "a rerun asks 1" in proc.stderr
    assert sorted(server.rows()) == list(range(6))  # a 400 is not retried within a run
    first = results(out)
    stats = first["runs"]["sft"]
    assert (stats["judged"], stats["failed"], stats["unjudged"], stats["n"], stats["calls"]) == (5, 1, 0, 5, 6)
    assert first["this_run"]["failed"] == 1 and first["totals"]["failed"] == 1
    assert [(f["run"], f["row"], f["failed_runs"], f["asked_by_rerun"]) for f in first["failures"]] == \
        [("sft", 2, 1, True)]
    judged = {int(j["row"]): j for j in read_csv(out / "judged" / "sft.csv")}
    assert (judged[2]["status"], judged[2]["preferred"]) == ("failed", "unjudged")
    assert judged[2]["error"].startswith("BadRequestError") and judged[0]["status"] == "judged"
    before = verdicts(out)
    assert sorted(before) == [0, 1, 3, 4, 5]

    # Reruns 1 and 2 ask row 2 again (and nothing else); rerun 3 leaves it failed and asks nothing.
    for rerun in (1, 2, 3):
        start = len(server.requests)
        proc = run_judge(*flags)
        assert proc.returncode == 3, proc.stderr[-3000:]
        assert server.rows(start) == ([2] if rerun <= 2 else [])
        failure = results(out)["failures"][0]
        assert (failure["failed_runs"], failure["asked_by_rerun"]) == (min(rerun + 1, 3), rerun < 2)
        assert verdicts(out) == before  # nothing judged before the fault is lost or asked again
        assert results(out)["runs"]["sft"] == {**stats, "calls": 6 + min(rerun, 2)}
    assert "a rerun asks 0 of them again" in proc.stderr and "the other 1 failed in more than --failed_row_retries 2 reruns" in proc.stderr
    # The bound is the flag: raising it asks the row once more.
    start = len(server.requests)
    assert run_judge(*flags, "--failed_row_retries", "3").returncode == 3
    assert server.rows(start) == [2] and verdicts(out) == before


def test_http_200_without_a_usable_reply_fails_only_its_row(tmp_path, server_factory):
    server = server_factory(row_faults={1: ["nonjson"], 3: ["nochoices"], 4: ["html"]})
    table = write_table(tmp_path / "sft.csv", llm_rows(6))
    out = tmp_path / "out"
    flags = flags_for(server.url, table, out, "--max_concurrency", "2", "--max_retries", "3")
    proc = run_judge(*flags)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    # A 200 may have been billed: the row fails at once (no re-ask within the run), the others go on.
    assert sorted(server.rows()) == list(range(6))
    records = cached(out)
    assert sorted(row for row, r in records.items() if r["status"] == "failed") == [1, 3, 4]
    assert "not a chat completion" in records[1]["error"] and "without choices" in records[3]["error"]
    assert "without choices" in records[4]["error"]  # a text/html body comes back as a str
    assert all(records[row]["abandoned"] == 1 for row in (1, 3, 4))
    stats = results(out)["runs"]["sft"]
    assert (stats["judged"], stats["failed"], stats["possibly_billed_twice"]) == (3, 3, 0)
    before = verdicts(out)

    # The rerun asks exactly the three failed rows, once; each re-ask may pay a second time.
    start = len(server.requests)
    proc = run_judge(*flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(server.rows(start)) == [1, 3, 4]
    result = results(out)
    stats = result["runs"]["sft"]
    assert (stats["judged"], stats["failed"], stats["n"], stats["malformed"]) == (6, 0, 6, 0)
    assert (stats["calls"], stats["possibly_billed_twice"], result["this_run"]["possibly_billed_twice"]) == (9, 3, 3)
    assert {row: v for row, v in verdicts(out).items() if row in before} == before and result["failures"] == []


def test_calls_abandoned_at_the_timeout_are_counted_as_possibly_billed_twice(tmp_path, server_factory):
    # The slow-server case: every row's first call hangs past the timeout, row 5's first three.
    server = server_factory(row_faults={**{row: ["hang"] for row in range(8)}, 5: ["hang"] * 3})
    table = write_table(tmp_path / "sft.csv", llm_rows(8))
    out = tmp_path / "out"
    flags = flags_for(server.url, table, out, "--max_concurrency", "4", "--max_retries", "2")
    proc = run_judge(*flags)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = cached(out)
    assert records[5]["status"] == "failed" and "Timeout" in records[5]["error"]
    assert (records[5]["attempts"], records[5]["abandoned"], records[5]["billed_twice"]) == (3, 3, 2)
    others = [(r["attempts"], r["abandoned"], r["billed_twice"]) for row, r in records.items() if row != 5]
    assert others == [(2, 1, 1)] * 7
    result = results(out)
    # 7 rows re-asked once after an abandoned call, row 5 twice: 9 calls that may have been billed twice.
    assert result["this_run"] == dict(to_ask=8, judged=7, malformed=0, failed=1, unjudged=0, calls=17,
                                      possibly_billed_twice=9, stopped=None)
    assert result["runs"]["sft"]["possibly_billed_twice"] == 9 and "possibly_billed_twice 9" in proc.stdout
    before = verdicts(out)

    # The rerun asks row 5 once; its call follows abandoned ones, so it counts too, in both totals.
    start = len(server.requests)
    proc = run_judge(*flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert server.rows(start) == [5]
    result = results(out)
    assert (result["this_run"]["calls"], result["this_run"]["possibly_billed_twice"]) == (1, 1)
    assert (result["totals"]["calls"], result["totals"]["possibly_billed_twice"]) == (18, 10)
    assert cached(out)[5]["totals"] == dict(calls=4, abandoned=3, billed_twice=3, failed_runs=1)
    assert {row: v for row, v in verdicts(out).items() if row != 5} == before


def test_credentials_in_base_url_are_written_nowhere(tmp_path, server_factory):
    password, query_key, token = "url-pass-NEVER-WRITE-4711", "query-key-NEVER-WRITE-0815", "token-NEVER-WRITE-1234"
    basic = base64.b64encode(f"judge-user:{password}".encode()).decode()
    secrets = [SECRET, password, query_key, token, basic]
    table = write_table(tmp_path / "sft.csv", llm_rows(5))
    outputs = []
    for name, userinfo in (("userinfo", f"judge-user:{password}@"), ("bearer", "")):
        # The server echoes the path and the Authorization header in a 400 and in a reply.
        server = server_factory(row_faults={1: ["400"] * 9, 2: ["echo"], 3: ["hang"]})
        url = server.url.replace("http://", "http://" + userinfo) + f"?api_key={query_key}&token={token}"
        out = tmp_path / name
        # A failed start first: the message names the flag, shows no key and writes nothing.
        bad = run_judge(*flags_for(url, table, out, "--max_concurrency", "0"))
        assert bad.returncode == 1 and "--max_concurrency 0" in bad.stderr and not out.exists()
        bad_url = run_judge(*flags_for(f"judge-user:{password}@127.0.0.1/v1", table, out))
        assert bad_url.returncode == 1 and "--base_url (not shown" in bad_url.stderr and not out.exists()
        proc = run_judge(*flags_for(url, table, out, "--max_concurrency", "2"))
        assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
        # The credentials were sent: Basic auth from the URL (else the key), the query on every call.
        auth = f"Basic {basic}" if userinfo else f"Bearer {SECRET}"
        assert set(server.seen) == {(f"/v1/chat/completions?api_key={query_key}&token={token}", auth)}
        assert judge.load_cache(str(out / "judgments.jsonl"))[0]  # something was written to scan
        records = cached(out)
        # The echo reached the cache scrubbed, not left out: the row's error and reply say ***.
        assert records[1]["status"] == "failed" and records[1]["reply"] is None
        assert f"?api_key=***&token=*** {auth.split()[0]} ***" in records[1]["error"], records[1]["error"]
        assert records[2]["status"] == "judged" and records[2]["verdict"] in ("A", "B") and "***" in records[2]["reply"]
        assert sorted(verdicts(out)) == [0, 2, 3, 4]  # the fault lost no verdict
        args_json = json.loads((out / "args.json").read_text())
        redacted = server.url.replace("http://", "http://***@" if userinfo else "http://")
        assert args_json["base_url"] == f"{redacted}?api_key=***&token=***"
        rerun = run_judge(*flags_for(url, table, out, "--max_concurrency", "2"))  # the failed row asked again
        assert rerun.returncode == 3 and sorted(verdicts(out)) == [0, 2, 3, 4]
        outputs += [proc.stdout, proc.stderr, bad.stdout, bad.stderr, bad_url.stdout, bad_url.stderr,
                    rerun.stdout, rerun.stderr]
        files = [path for path in out.rglob("*") if path.is_file()]
        assert {"args.json", "judgments.jsonl", "results.json", "results.md", "sft.csv"} <= {p.name for p in files}
        for path in files:
            data = path.read_bytes()
            for secret in secrets:
                assert secret.encode() not in data, (path, secret)
    for text in outputs:
        for secret in secrets:
            assert secret not in text, secret


def test_bad_flags_write_nothing_and_the_corrected_run_goes_on(tmp_path, server_factory):
    server = server_factory()
    table = write_table(tmp_path / "sft.csv", llm_rows(4))
    out = tmp_path / "out"
    proc = run_judge(*flags_for(server.url, table, out, "--max_concurrency", "0", "--timeout", "-1",
                                "--failed_row_retries", "-1", "--n", "0", "--pairs", "sft:ppo"))
    assert proc.returncode == 1
    for named in ("--max_concurrency 0", "--timeout -1", "--failed_row_retries -1", "--n 0", "--pairs sft:ppo"):
        assert named in proc.stderr, named
    assert not out.exists() and server.requests == []
    # Table contents are checked before anything is written too: the file, the row and the column.
    rows = llm_rows(4)
    rows[2]["score"] = "high"
    for i in (0, 1, 3):
        rows[i]["score"] = "1.0"
    bad_table = write_table(tmp_path / "bad.csv", rows)
    proc = run_judge(*flags_for(server.url, bad_table, out))
    assert proc.returncode == 1 and f"{bad_table}: data row 2, column score: 'high' is not a number" in proc.stderr
    assert not out.exists() and server.requests == []
    # The corrected command runs in the same folder: nothing left behind blocks it.
    proc = run_judge(*flags_for(server.url, table, out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert results(out)["runs"]["sft"]["judged"] == 4 and sorted(server.rows()) == [0, 1, 2, 3]


def test_torn_last_cache_line_is_asked_again_and_nothing_else(tmp_path, server_factory):
    server = server_factory()
    table = write_table(tmp_path / "sft.csv", llm_rows(6, malformed={4}))
    out = tmp_path / "out"
    flags = flags_for(server.url, table, out, "--max_concurrency", "2")
    assert run_judge(*flags).returncode == 0
    first = results(out)["runs"]
    before = verdicts(out)
    # A kill in the middle of the last append: half a line, no newline.
    path = out / "judgments.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    torn_row = json.loads(lines[-1])["row"]
    path.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    start = len(server.requests)
    proc = run_judge(*flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 unreadable line(s) skipped" in proc.stdout
    assert server.rows(start) == [torn_row]  # only the torn row is asked again
    assert verdicts(out) == before and results(out)["runs"]["sft"] == {**first["sft"]}
    assert len(judge.load_cache(str(path))[0]) == 6 and path.read_text().endswith("\n")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])  # Ctrl-C; SLURM, `timeout`, `docker stop`
def test_interrupted_run_writes_results_and_counts_calls_in_flight(tmp_path, server_factory, stop):
    server = server_factory(delay=1.0)  # slow replies: calls are in flight when Ctrl-C comes
    table = write_table(tmp_path / "sft.csv", llm_rows(8))
    out = tmp_path / "out"
    flags = flags_for(server.url, table, out, "--max_concurrency", "2", "--timeout", "10")
    # Ctrl-C reaches a foreground process whose SIGINT is the default; a test run from a background job inherits
    # SIGINT ignored (bash ignores it in `&` jobs without job control), and so would the judge: give it the default.
    process = subprocess.Popen(judge_cmd(*flags), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=judge_env(), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while len(server.requests) < 4 and time.time() < deadline:  # two judged, two more in flight
        time.sleep(0.01)
    process.send_signal(stop)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 1 and "stopped: interrupted" in stderr, stdout[-3000:] + stderr[-3000:]
    records = cached(out)
    judged = {row for row, r in records.items() if r["status"] == "judged"}
    abandoned = {row for row, r in records.items() if r["status"] == "abandoned"}
    # Every call the server saw is either a verdict in the cache or recorded as abandoned in flight.
    assert judged and abandoned and judged | abandoned == set(server.rows()) and not judged & abandoned
    result = results(out)
    assert result["this_run"]["stopped"] == "interrupted" and result["runs"]["sft"]["judged"] == len(judged)
    assert result["runs"]["sft"]["unjudged"] == 8 - len(judged) and result["runs"]["sft"]["failed"] == 0
    before = verdicts(out)

    # The rerun asks what has no verdict, once; re-asking a call abandoned in flight may pay twice.
    start = len(server.requests)
    proc = run_judge(*flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(server.rows(start)) == sorted(set(range(8)) - judged)
    result = results(out)
    assert result["this_run"]["possibly_billed_twice"] == len(abandoned) == result["totals"]["possibly_billed_twice"]
    assert result["runs"]["sft"]["judged"] == 8 and {row: verdicts(out)[row] for row in before} == before


SIGTERM_INSIDE_A_CALL = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import judge

build_prompt = judge.build_prompt


def build_prompt_then_sigterm(post, summary_a, summary_b):
    # Row 3's call starts while row 2's is in flight; SIGTERM arrives as its code runs.
    if "TITLE: post 3" in post:
        os.kill(os.getpid(), signal.SIGTERM)
    return build_prompt(post, summary_a, summary_b)


judge.build_prompt = build_prompt_then_sigterm
judge.main()
"""


def test_sigterm_inside_a_call_still_records_every_call_in_flight(tmp_path, server_factory):
    """SIGTERM stops the run at the event loop's next turn, never inside a call's code: a KeyboardInterrupt raised
    there ended the loop before the other calls in flight were recorded as abandoned (1 run in 30 of the test
    above on a loaded 2-core machine)."""
    server = server_factory(delay=1.0)
    table = write_table(tmp_path / "sft.csv", llm_rows(8))
    out = tmp_path / "out"
    driver = tmp_path / "judge_driver.py"
    driver.write_text(SIGTERM_INSIDE_A_CALL.format(repo=str(REPO)))
    flags = flags_for(server.url, table, out, "--max_concurrency", "2", "--timeout", "10")
    proc = run_python([sys.executable, str(driver), "--model", "judge-test", *flags], env=judge_env(), timeout=120)
    assert proc.returncode == 1 and "stopped: interrupted" in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = cached(out)
    status = {row: record["status"] for row, record in records.items()}
    # Rows 0 and 1 answered; row 2's call was in flight and row 3's had begun: both may be billed.
    assert status == {0: "judged", 1: "judged", 2: "abandoned", 3: "abandoned"}, status
    assert set(server.rows()) <= set(status) and records[2]["attempts"] == records[3]["attempts"] == 1
    assert results(out)["this_run"]["stopped"] == "interrupted"


def test_unreadable_tables_and_a_bad_endpoint_are_named_without_the_secret(tmp_path, monkeypatch, capsys):
    """read_inputs: an $OPENAI_BASE_URL that is no URL (its credentials never shown); once the flags are fine, a
    table with no rows and one without the reference column, both in one message; nothing written."""
    header_only = tmp_path / "sft.csv"
    header_only.write_text("query,response,reference\n")
    no_reference = tmp_path / "ppo.csv"
    no_reference.write_text("query,response\npost,summary\n")
    monkeypatch.setenv("OPENAI_BASE_URL", "ftp://user:hunter2-secret@judge.example")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-real")
    args = judge.Args(output_dir=str(tmp_path / "out"), tables=(f"sft_1={header_only}", f"ppo_1={no_reference}"),
                      model="judge-test")
    with pytest.raises(SystemExit) as stop:
        judge.read_inputs(args)
    assert str(stop.value.code) == ("judge.py: cannot start (nothing was written):\n  $OPENAI_BASE_URL (not shown: "
                                    "it may hold a key): want http(s)://host[:port][/path]")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://user:hunter2-secret@judge.example:8080/v1")  # a URL: the tables next
    with pytest.raises(SystemExit) as stop:
        judge.read_inputs(args)
    message = str(stop.value.code)
    assert f"--tables sft_1={header_only}: {header_only}: no data rows" in message
    assert (f"--tables ppo_1={no_reference}: {no_reference}: missing columns ['reference'] "
            "(want query, response, reference)") in message
    assert "hunter2" not in message + capsys.readouterr().out and not (tmp_path / "out").exists()


def test_ragged_rows_pairs_that_clash_and_a_padded_key_stop_the_start(tmp_path, monkeypatch, capsys):
    """read_inputs refuses a CSV row shorter or longer than its header (named), a table paired with itself, two
    comparisons saved under one name and a key with a trailing newline (not shown); repeated queries are a note."""
    short, long_, good = tmp_path / "short.csv", tmp_path / "long.csv", tmp_path / "good.csv"
    short.write_text('query,response,reference\n"q1"," a",r\n"q2"\n')
    long_.write_text('query,response,reference\n"q1"," a",r,extra\n')
    good.write_text('query,response,reference\nq1, a,r\nq2, b,r\nq1, c,r\n')
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-real-key\r\n")
    args = judge.Args(output_dir=str(tmp_path / "out"), model="judge-test",
                      tables=(f"sft={short}", f"ppo={long_}", f"a_vs_b={good}", f"a={good}", f"b={good}"),
                      pairs=("sft:sft", "a:b"))
    with pytest.raises(SystemExit) as stop:
        judge.read_inputs(args)
    message = str(stop.value.code)
    assert "OPENAI_API_KEY (not shown) begins or ends with whitespace" in message and "sk-not" not in message
    assert "--pairs sft:sft: a table against itself" in message
    assert "two comparisons would be saved as a_vs_b" in message
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-real-key")  # the flags are fine: the tables are read next
    with pytest.raises(SystemExit) as stop:
        judge.read_inputs(judge.Args(output_dir=str(tmp_path / "out"), model="judge-test",
                                     tables=(f"sft={short}", f"ppo={long_}")))
    message = str(stop.value.code)
    assert f"--tables sft={short}: {short}: data row 1 has 1 field(s), the header 3; quote cells" in message
    assert f"--tables ppo={long_}: {long_}: data row 0 has 4 field(s), the header 3; quote cells" in message
    judge.read_inputs(judge.Args(output_dir=str(tmp_path / "out"), model="judge-test", tables=(f"a={good}",)))
    assert "table a: 1 row(s) repeat an earlier row's query (data row 2 repeats row 0...)" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_an_output_folder_that_cannot_be_made_is_named(tmp_path):
    """start_outputs: --output_dir below a file cannot be created; the exit names the flag, the OS error and the fix."""
    a_file = tmp_path / "results.csv"
    a_file.write_text("not a folder")
    args = judge.Args(output_dir=str(a_file / "judge"))
    with pytest.raises(SystemExit) as stop:
        judge.start_outputs(args, {"prompt_version": "v1"})
    message = str(stop.value.code)
    assert message.startswith(f"judge.py: --output_dir {a_file / 'judge'}: cannot create it (")
    assert "Not a directory" in message and message.endswith("); choose a writable folder")
    assert a_file.read_text() == "not a folder"


# ------------------------------------------------------------------------------------------------
# From a mutation audit of the calling and caching machinery
# ------------------------------------------------------------------------------------------------


def test_scrub_takes_six_character_secrets_and_the_longer_of_two_first():
    assert judge.scrub("pw abcdef at host", ["abcdef"]) == "pw *** at host"  # 6 characters are a secret
    assert judge.scrub("pw abcde", ["abcde"]) == "pw abcde"
    # a password that is a prefix of a query value: the value goes whole, no tail of it is written
    assert judge.scrub("key=hunter2-read&pw=hunter2", ["hunter2", "hunter2-read"]) == "key=***&pw=***"


def test_retries_wait_their_backoff_and_at_most_the_cap(monkeypatch):
    """call_with_retries sleeps base * 2**k * U(1/2, 1) before retry k, or the server's Retry-After when longer,
    never more than --retry_max_delay; a 500 each time, so every retry is spent."""
    import httpx
    import openai

    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    slept = []

    async def sleep(seconds):
        slept.append(seconds)

    monkeypatch.setattr(judge.asyncio, "sleep", sleep)

    def failing(headers):
        async def call():
            raise openai.InternalServerError("x", response=httpx.Response(500, request=request, headers=headers),
                                             body=None)
        return call

    for headers, check in (({}, lambda k, s: 0.5 * min(8, 2 ** k) <= s <= min(8, 2 ** k)),  # the backoff, capped
                           ({"retry-after": "3600"}, lambda k, s: s == 8)):  # a long Retry-After: the cap
        slept.clear()
        tally = dict(calls=0, abandoned=0, billed_twice=0)
        with pytest.raises(openai.InternalServerError):
            asyncio.run(judge.call_with_retries(failing(headers), tally, timeout=5, max_retries=5, base=1.0, cap=8.0,
                                                rng=random.Random(0)))
        assert tally["calls"] == 6 and len(slept) == 5
        assert all(check(k, s) for k, s in enumerate(slept)), (headers, slept)


def test_a_stopped_run_exits_1_even_with_failed_rows_and_a_timeout_does_not_stop_it(capsys):
    import httpx
    import openai

    failures = [dict(run="sft", row=3, failed_runs=1, error="BadRequestError: x", asked_by_rerun=True)]
    with pytest.raises(SystemExit) as stop:
        judge.exit_with_status("AuthenticationError: 401", failures, "out/judgments.jsonl", 2)
    assert str(stop.value.code).startswith("judge.py: stopped: AuthenticationError: 401")
    with pytest.raises(SystemExit) as stop:
        judge.exit_with_status(None, failures, "out/judgments.jsonl", 2)
    assert stop.value.code == 3 and "1 row(s) failed" in capsys.readouterr().err
    timeout = openai.APITimeoutError(request=httpx.Request("POST", "http://127.0.0.1/v1"))
    assert not judge.stops_run(timeout) and judge.is_retryable(timeout)  # a slow call is one row's fault


def test_cache_records_of_an_older_judge_are_read_as_judged(tmp_path):
    """A judgments.jsonl written before `status` and `totals` existed (its records hold `attempts`): a rerun asks
    nothing again, counts every row judged and its calls from `attempts`."""
    from test_judge import gold_rows

    table = write_table(tmp_path / "a.csv", gold_rows("sft", 6))
    out = tmp_path / "out"
    command = judge_cmd("--judge", "gold", "--tables", f"sft={table}", "--output_dir", str(out))
    assert run_python(command, timeout=120, env=judge_env()).returncode == 0
    cache = out / "judgments.jsonl"
    records = [json.loads(line) for line in cache.read_text().splitlines()]
    newer = ("status", "totals", "abandoned", "billed_twice")
    cache.write_text("".join(json.dumps({k: v for k, v in r.items() if k not in newer}) + "\n" for r in records))
    proc = run_python(command, timeout=120, env=judge_env())
    assert proc.returncode == 0 and "0 to ask" in proc.stdout, proc.stdout[-2000:]
    totals = results(out)["totals"]
    assert (totals["judged"], totals["unjudged"], totals["calls"]) == (6, 0, 6)


def test_a_comparison_in_two_runs_is_asked_once(tmp_path, server_factory):
    """Two --tables labels with the same rows (two seeds whose samples agree) share every comparison: one call
    each, both runs judged, the totals over the distinct comparisons."""
    server = server_factory()
    table = write_table(tmp_path / "t.csv", llm_rows(4))
    proc = run_judge("--base_url", server.url, "--tables", f"a={table}", f"b={table}", "--output_dir",
                     str(tmp_path / "o"), *FAST)
    assert proc.returncode == 0 and len(server.requests) == 4
    result = results(tmp_path / "o")
    assert result["runs"]["a"]["n"] == result["runs"]["b"]["n"] == 4
    assert (result["totals"]["rows"], result["totals"]["calls"], result["this_run"]["unjudged"]) == (4, 4, 0)


def test_each_verdict_is_on_disk_before_the_next_call(tmp_path, server_factory):
    """A judge killed outright (SIGKILL, an OOM kill, scancel -s KILL) keeps every verdict it had received: each
    cache line is flushed as it is written. Killed once the server has answered 4 calls (one at a time), the cache
    holds at least 3 of them (the 4th may be between its reply and its write); a buffered file would hold none."""
    server = server_factory(delay=0.3)
    table = write_table(tmp_path / "t.csv", llm_rows(12))
    out = tmp_path / "out"
    process = subprocess.Popen(judge_cmd("--base_url", server.url, "--tables", f"t={table}", "--output_dir", str(out),
                                         "--max_concurrency", "1", "--timeout", "30"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=judge_env())
    deadline = time.time() + 60
    while len(server.requests) < 5 and time.time() < deadline:  # the 5th call arrives: 4 have been answered
        time.sleep(0.01)
    time.sleep(0.1)  # the 4th reply's record written (its write follows the reply at once)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert len(server.requests) >= 5 and len(judge.load_cache(str(out / "judgments.jsonl"))[0]) >= 3


def test_only_failed_rows_are_listed_as_failures():
    """results.json's `failures`: a row whose last ask failed, with its error and whether a rerun asks it again; a row
    abandoned when a run stopped (asked again by the next run, not failed) or judged is not listed."""
    items = [dict(key=k, row=i) for i, k in enumerate(("judged", "failed", "abandoned", "unasked"))]
    cache = {"judged": dict(status="judged", verdict="A"),
             "failed": dict(status="failed", error="BadRequestError: x", totals=dict(failed_runs=3)),
             "abandoned": dict(status="abandoned", error=None)}
    listed = judge.failed_rows("sft", dict(items=items), cache, failed_row_retries=2)
    assert listed == [dict(run="sft", row=1, error="BadRequestError: x", failed_runs=3, asked_by_rerun=False)]


def test_a_rows_seconds_are_its_own_time_not_its_wait_for_a_slot():
    """With one slot and three rows of 0.3 s calls, the last row waits 0.6 s for the slot: its record's `seconds`
    is its call's time (0.3 s and a little), not its wait as well (0.9 s and more). The bound, 0.85 s, leaves a
    busy machine half a second of delay."""
    import io

    async def ask(post, a, b):
        await asyncio.sleep(0.3)
        return "Comparison: fine.\nPreferred: A"

    todo = [dict(key=f"k{i}", ours="x", other="y", ours_is_a=True, post="p", label="ours", row=i,
                 other_name="reference") for i in range(3)]
    meta = dict(model="m", prompt_version=1, temperature=0.0, allow_tie=False)
    cache, cache_file = {}, io.StringIO()
    asyncio.run(judge.judge_all(todo, ask, cache, cache_file, meta, max_concurrency=1,
                                retry=dict(timeout=5.0, max_retries=0, base=0.0, cap=0.0), run_id=1.0, secrets=[]))
    seconds = sorted(record["seconds"] for record in cache.values())
    assert len(seconds) == 3 and all(0.29 < value < 0.85 for value in seconds), seconds
    assert {record["preferred"] for record in cache.values()} == {"ours"}
