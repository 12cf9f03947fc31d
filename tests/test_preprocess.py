"""Tests of preprocess_tldr.py: hand-computed token layouts (Details 1-6) and one offline smoke run.

The tokenizer is a byte-level BPE trained here in a fraction of a second (GPT-NeoX's kind, in
miniature): EOS is `<|endoftext|>` and there is no pad token, so the script's [PAD] path runs.
"""

import ast
import dataclasses
import inspect
import json
import os
import random
import re
import sys
import time
from pathlib import Path

import datasets
import pytest
from conftest import run_python
import tyro
from datasets import Features, List, Value
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import preprocess_tldr as pre

REPO = Path(__file__).resolve().parent.parent
EOS = "<|endoftext|>"
CORPUS = [
    "SUBREDDIT: r/cats\n\nTITLE: my cat\n\nPOST: the cat sat on the mat.\n\nTL;DR: cat sat",
    "Article:\nthe dog sat on the log. the bird sat on the cat.\n\nTL;DR:\n the dog sat",
    "my cat and my dog sat on the mat; the bird did not. a dog, a cat, a mat, a log.",
] * 20
SFT_FEATURES = Features({name: Value("string") for name in ("id", "subreddit", "title", "post", "summary")})
PREFERENCE_FEATURES = Features({
    "info": {name: Value("string") for name in ("id", "post", "title", "subreddit", "site", "article")},
    "summaries": List({"text": Value("string"), "policy": Value("string"), "note": Value("string")}),
    "choice": Value("int32"),
    "worker": Value("string"),
    "batch": Value("string"),
    "split": Value("string"),
    "extra": {"confidence": Value("int32")},
})


def make_tokenizer(pad_token=None):
    """A byte-level BPE tokenizer with EOS `<|endoftext|>` and the given pad token (None: none)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=pad_token,
                                   model_max_length=4096)


def make_pythia_like_tokenizer():
    """Pythia's tokenizer in miniature: NFC, byte-level BPE, special <|endoftext|> and <|padding|> (not the pad
    token), and the runs of 2-24 spaces as ordinary (non-special) added tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS, "<|padding|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_tokens([AddedToken(" " * n, normalized=True) for n in range(24, 1, -1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, model_max_length=2048)


def encode(tokenizer, text):
    """Token ids of `text`, no template tokens (a plain encode, as the reference's script does it)."""
    return tokenizer.encode(text, add_special_tokens=False)


def naive_query_ids(tokenizer, format_str, fields, field, length):
    """The reference's truncation loop: cut the last paragraph (or character), re-tokenize, until it fits."""
    fields = dict(fields)
    ids = encode(tokenizer, format_str.format(**fields))
    while len(ids) > length:
        fields[field] = pre.truncate_last_paragraph(fields[field])
        ids = encode(tokenizer, format_str.format(**fields))
    return ids


def reference_columns(tokenizer, format_str, fields, field, query_length, response, response_length=None,
                      query_response_length=None):
    """One row's columns built as the reference's dataset script builds them (for text without special strings):
    query = decoded query_token, lstripped; query+response = tokenize(query.strip() + response), where `response`
    ends with the EOS text; the label masks the first query_token_len positions."""
    pad = tokenizer.pad_token_id
    ids = naive_query_ids(tokenizer, format_str, fields, field, query_length)
    query_token = [pad] * (query_length - len(ids)) + ids
    query = tokenizer.decode(query_token, skip_special_tokens=True).lstrip()
    response_ids = encode(tokenizer, response)
    query_response = encode(tokenizer, query.strip() + response)
    query_response_length = query_response_length or len(query_response)
    query_response_token = query_response + [pad] * (query_response_length - len(query_response))
    n_q = sum(token != pad for token in query_token)
    return {"query": query, "query_token": query_token, "query_token_len": n_q,
            "response": response, "response_token_len": len(response_ids),
            "response_token": response_ids + [pad] * ((response_length or len(response_ids)) - len(response_ids)),
            "query_response": query.strip() + response, "query_response_token": query_response_token,
            "query_response_token_len": len(query_response),
            "query_response_token_response_label": [pad] * n_q + query_response_token[n_q:]}


@pytest.fixture(scope="module")
def tok():
    tokenizer = make_tokenizer()
    assert pre.add_pad_token(tokenizer)
    return tokenizer


def sft_row(row_id="t1", post="the cat sat on the mat.", summary="cat sat"):
    return {"id": row_id, "subreddit": "cats", "title": "my cat", "post": post, "summary": summary}


def preference_row(row_id="p1", batch="batch3", choice=0, cnndm=False, texts=(" the cat sat", " a dog"),
                   policies=("sup2", "ref"), post="the cat sat on the mat.\nthe dog sat on the log.", confidence=None):
    info = {"id": row_id, "post": None, "title": None, "subreddit": None, "site": None, "article": None}
    if cnndm:
        info["article"] = "the dog sat on the log.\nthe bird sat on the cat."
    else:
        info.update(post=post, title="my cat", subreddit="cats")
    return {"info": info, "choice": choice, "worker": "w1", "batch": batch, "split": "train",
            "summaries": [{"text": t, "policy": p, "note": None} for t, p in zip(texts, policies)],
            "extra": {"confidence": confidence}}


# ---- Detail 3: a [PAD] that is not EOS ----

def test_eos_and_pad_distinct():
    tokenizer = make_tokenizer()
    assert tokenizer.pad_token is None
    assert pre.add_pad_token(tokenizer) is True
    assert tokenizer.pad_token == "[PAD]" and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert pre.add_pad_token(tokenizer) is False  # a distinct pad stays as it is


def test_another_pad_is_replaced_by_pad():
    # transformers 5 loads Pythia's tokenizer with the pad <|padding|> (id 1); the reference's ids have [PAD] at the end
    tokenizer = make_pythia_like_tokenizer()
    tokenizer.pad_token = "<|padding|>"
    assert tokenizer.pad_token_id == 1
    assert pre.add_pad_token(tokenizer) is True
    assert tokenizer.pad_token == "[PAD]" and tokenizer.pad_token_id == len(tokenizer) - 1
    assert tokenizer.convert_ids_to_tokens(1) == "<|padding|>"  # kept as a token, no longer the pad


def test_pad_equal_to_eos_is_replaced():
    tokenizer = make_tokenizer(pad_token=EOS)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert pre.add_pad_token(tokenizer) is True
    assert tokenizer.pad_token == "[PAD]" and tokenizer.pad_token_id != tokenizer.eos_token_id


# ---- Details 2, 3, 5: the exact token layout ----

def test_sft_token_layout(tok):
    pad, eos = tok.pad_token_id, tok.eos_token_id
    out = pre.process_sft_row(sft_row(), tok, EOS, pad, query_length=64, response_length=12,
                              query_response_length=80, split="train")
    text = "SUBREDDIT: r/cats\n\nTITLE: my cat\n\nPOST: the cat sat on the mat.\n\nTL;DR:"
    query = encode(tok, text)
    assert out["query"] == text  # no trailing space after "TL;DR:"
    assert out["query_token"] == [pad] * (64 - len(query)) + query
    assert out["query_token_len"] == len(query)
    # " cat sat" tokenizes word by word (the leading space belongs to each word), then EOS
    response = encode(tok, " cat") + encode(tok, " sat") + [eos]
    assert out["reference_response"] == " cat sat" + EOS
    assert out["reference_response_token"] == response + [pad] * (12 - len(response))
    assert out["reference_response_token_len"] == len(response)
    assert out["query_reference_response"] == text + " cat sat" + EOS
    assert out["query_reference_response_token"] == query + response + [pad] * (80 - len(query) - len(response))
    assert out["query_reference_response_token_len"] == len(query) + len(response)


@pytest.mark.parametrize("query_length", [40, 64, 100])
def test_left_pad_count(tok, query_length):
    pad = tok.pad_token_id
    out = pre.process_sft_row(sft_row(), tok, EOS, pad, query_length=query_length, response_length=12,
                              query_response_length=query_length + 12, split="train")
    n_pads = next(i for i, token in enumerate(out["query_token"]) if token != pad)
    assert len(out["query_token"]) == query_length
    assert n_pads == query_length - out["query_token_len"]
    assert pad not in out["query_token"][n_pads:]
    assert pre.left_pad([5, 6], 4, 0) == [0, 0, 5, 6]
    assert pre.right_pad([5, 6, 7], 2, 0) == [5, 6] and pre.right_pad([5], 3, 0) == [5, 0, 0]


def test_label_mask_is_query(tok):
    assert pre.response_label([7, 8, 9, 1, 0, 0], 2, 0) == [0, 0, 9, 1, 0, 0]
    pad = tok.pad_token_id
    out = pre.process_sft_row(sft_row(), tok, EOS, pad, query_length=64, response_length=12,
                              query_response_length=80, split="train")
    n, full = out["query_token_len"], out["query_reference_response_token"]
    label = out["query_reference_response_token_response_label"]
    assert pad not in full[:n]  # the masked positions are exactly the (non-pad) query ids
    assert label == [pad] * n + full[n:]
    response = out["reference_response_token"][:out["reference_response_token_len"]]
    assert [token for token in label if token != pad] == response


# Three byte-level BPEs: the test's own, a Pythia-like one (NFC, <|padding|>, added runs of spaces)
# and the tiny world's pythia-tiny (whose [PAD] comes with it).
TOKENIZERS = {"bpe": make_tokenizer, "pythia-like": make_pythia_like_tokenizer,
              "tiny-world": lambda: AutoTokenizer.from_pretrained(str(REPO / "assets" / "tiny_world" / "pythia-tiny"))}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def any_tok(request):
    tokenizer = TOKENIZERS[request.param]()
    pre.add_pad_token(tokenizer)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    return tokenizer


def test_token_layout_equals_reference(any_tok):
    """TL;DR and CNN/DM rows, truncated or not, against rows built the reference's way, token for token."""
    tok, pad = any_tok, any_tok.pad_token_id
    long_post = "the cat sat on the mat.\n" + "the dog sat on the log. " * 8
    long_article = "the dog sat on the log.\n\nthe bird sat on the cat.\nmy cat and my dog sat on the mat.\n"
    cases = [  # (kind, fields, response with the EOS text, shortened by this many ids)
        ("sft", sft_row("s1", summary="cat sat"), " cat sat" + EOS, 0),
        ("sft", sft_row("s2", post=long_post, summary="a dog,  a cat"), " a dog,  a cat" + EOS, 3),
        ("tldr", preference_row("p1")["info"], " the cat sat" + EOS, 0),
        ("tldr", preference_row("p2", post=long_post)["info"], " a dog" + EOS, 5),
        ("cnndm", preference_row("c1", cnndm=True)["info"], " a dog" + EOS, 0),
        ("cnndm", {**preference_row("c2", cnndm=True)["info"], "article": long_article}, " the cat  sat" + EOS, 2),
        # OpenAI's CNN/DM summaries follow "TL;DR:\n" and have no leading space; the reference strips the "\n"
        ("cnndm", preference_row("c3", cnndm=True)["info"], "a dog" + EOS, 0),
        ("cnndm", {**preference_row("c4", cnndm=True)["info"], "article": long_article}, "the cat  sat" + EOS, 2),
    ]
    for kind, fields, response, cut in cases:
        format_str, field = (pre.CNNDM_FORMAT, "article") if kind == "cnndm" else (pre.TLDR_FORMAT, "post")
        length = len(encode(tok, format_str.format(**fields))) - cut
        name = "reference_response" if kind == "sft" else "chosen"
        ref = reference_columns(tok, format_str, fields, field, length, response, 20, length + 24)
        if kind == "sft":
            out = pre.process_sft_row(fields, tok, EOS, pad, query_length=length, response_length=20,
                                      query_response_length=length + 24, split="train")
        else:
            row = preference_row(fields["id"], cnndm=kind == "cnndm", texts=(response[:-len(EOS)], " a cat"))
            row["info"] = fields
            out = pre.process_preference_row(row, tok, EOS, pad, cnndm=kind == "cnndm", query_length=length,
                                             response_length=20, query_response_length=length + 24, split="x")
        for column in ("query", "query_token", "query_token_len"):
            assert out[column] == ref[column], (kind, column)
        for suffix in ("", "_token", "_token_len"):
            assert out[name + suffix] == ref["response" + suffix], (kind, suffix)
            assert out[f"query_{name}{suffix}"] == ref["query_response" + suffix], (kind, suffix)
        assert cut == 0 or out["query_token_len"] < len(encode(tok, format_str.format(**fields)))  # truncated
        label, ref_label = out[f"query_{name}_token_response_label"], ref["query_response_token_response_label"]
        n_q, full = out["query_token_len"], out[f"query_{name}_token"]
        if kind != "cnndm":
            assert label == ref_label  # the reference's mask, exactly
        else:
            # The query ends in "\n", which strip() drops: the row holds n_q - 1 query ids. The reference
            # masks n_q positions, the first response id included; the exact mask keeps that id.
            assert out["query"].endswith("TL;DR:\n")
            assert encode(tok, out["query"].strip()) == out["query_token"][-n_q:-1]
            assert label[: n_q - 1] == [pad] * (n_q - 1) and label[n_q - 1] == full[n_q - 1] != pad
            assert ref_label[n_q - 1] == pad and label[:n_q - 1] + label[n_q:] == ref_label[:n_q - 1] + ref_label[n_q:]
        response_ids = out[f"{name}_token"][:out[f"{name}_token_len"]]
        assert [token for token in label if token != pad] == response_ids  # unmasked: exactly the response


def test_a_cnndm_summary_that_merges_with_the_prompts_colon_is_labelled_from_the_merged_id():
    """'TL;DR:' + '"the cat': a BPE that learned ':"' joins the prompt's last id and the summary's first; the label
    keeps that joined id and everything after it, as tokenize(query.strip() + text) gives them."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS + ['TL;DR:"the cat"'] * 50, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)
    pre.add_pad_token(tok)
    pad, prompt, text = tok.pad_token_id, "Article:\nthe dog sat.\n\nTL;DR:", '"the cat'
    prompt_ids, joined = encode(tok, prompt), encode(tok, prompt + text)
    assert joined[:len(prompt_ids) - 1] == prompt_ids[:-1] and joined[len(prompt_ids) - 1] != prompt_ids[-1]  # merged
    out = pre.response_columns(tok, prompt, prompt_ids, "chosen", text, EOS, 10, 30, pad, "row c1")
    label = out["query_chosen_token_response_label"]
    assert out["query_chosen_token"][:out["query_chosen_token_len"]] == joined + [tok.eos_token_id]
    assert label[:len(prompt_ids) - 1] == [pad] * (len(prompt_ids) - 1)
    assert label[len(prompt_ids) - 1:out["query_chosen_token_len"]] == joined[len(prompt_ids) - 1:] + [tok.eos_token_id]
    # only a summary that opens with punctuation may merge so; a word may not ("my ca" + "t sat", below)
    with pytest.raises(pre.DataError, match="do not start with the ids of the query alone"):
        pre.response_columns(tok, "my ca", encode(tok, "my ca"), "chosen", "t sat", EOS, 10, 30, pad, "row r1")


def test_label_mask_needs_the_query_ids_to_open_the_row(tok):
    # "my ca" + "t sat": BPE merges " ca" + "t" into " cat", so the prompt's ids are no prefix
    assert encode(tok, "my cat sat")[:2] != encode(tok, "my ca")
    where = "split 'train', row id 'r1'"
    with pytest.raises(pre.DataError, match=rf"{where}: the ids of the query \+ chosen do not start with"):
        pre.response_columns(tok, "my ca", encode(tok, "my ca"), "chosen", "t sat", EOS, 10, 20, tok.pad_token_id,
                             where)


# ---- Detail 3: a special-token string typed by a user stays text ----

TYPED = "x [PAD] y <|endoftext|> z"


@pytest.mark.parametrize("field", ["title", "post", "summary", "article", "summaries.text"])
def test_special_token_strings_stay_text(any_tok, field):
    tok, pad, eos = any_tok, any_tok.pad_token_id, any_tok.eos_token_id
    assert {pad, eos} <= set(encode(tok, TYPED))  # a plain encode would turn them into the special ids
    if field in ("title", "post", "summary"):
        row = sft_row("s1")
        row[field] = f"the cat {TYPED}"
        out, names = pre.process_sft_row(row, tok, EOS, pad, query_length=120, response_length=40,
                                         query_response_length=160, split="train"), ["reference_response"]
    else:
        row = preference_row("c1", cnndm=field == "article", texts=(f" the cat {TYPED}", " a dog"))
        if field == "article":
            row["info"]["article"] = f"the dog sat on the log.\n{TYPED}"
        out, names = pre.process_preference_row(row, tok, EOS, pad, cnndm=field == "article", query_length=120,
                                                response_length=40, query_response_length=160,
                                                split="validation"), ["chosen", "rejected"]
    # query_token: pads on the left only, no EOS; the decoded `query` keeps the typed text
    query_token, n_q = out["query_token"], out["query_token_len"]
    assert query_token[:-n_q] == [pad] * (len(query_token) - n_q) and pad not in query_token[-n_q:]
    assert eos not in query_token
    assert (TYPED in out["query"]) == (field in ("title", "post", "article"))
    for name in names:  # every response: the EOS id once, at its end; pads after it only
        for ids, n in ((out[f"{name}_token"], out[f"{name}_token_len"]),
                       (out[f"query_{name}_token"], out[f"query_{name}_token_len"])):
            assert ids[n - 1] == eos and eos not in ids[:n - 1] and pad not in ids[:n] and set(ids[n:]) <= {pad}
        assert TYPED in out[f"query_{name}"] or field in ("summary", "summaries.text")
    text_column = "reference_response" if field == "summary" else "chosen"
    if field in ("summary", "summaries.text"):  # the typed text is in the response ids, as text
        ids = out[f"{text_column}_token"][:out[f"{text_column}_token_len"] - 1]
        assert TYPED in tok.decode(ids) and TYPED in out[text_column]


def test_encode_text_remembers_recent_texts_and_equals_a_plain_encode(any_tok):
    """encode_text's cache (recent_encodings) returns what tokenizer.encode(..., split_special_tokens=True)
    returns, for texts seen before or not, and hands out a new list each time (a caller may change it)."""
    texts = [f"the cat {TYPED}", "  two  spaces", "the cat", f"the cat {TYPED}", "", "the cat"]
    for text in texts:
        plain = any_tok.encode(text, add_special_tokens=False, split_special_tokens=True)
        ids = pre.encode_text(any_tok, text)
        assert ids == plain
        ids.append(-1)
        assert pre.encode_text(any_tok, text) == plain
    row = preference_row("c1", texts=(" a cat", " a dog"))  # the prompt is the query just tokenized: a hit
    pre.recent_encodings.cache_clear()
    pre.process_preference_row(row, any_tok, EOS, any_tok.pad_token_id, cnndm=False, query_length=120,
                               response_length=40, query_response_length=160, split="train")
    assert pre.recent_encodings.cache_info().hits >= 1


# ---- Detail 2 at speed: the reference's cut rule, without re-tokenizing every prefix ----

def test_truncation_cuts_follow_the_reference_rule():
    assert pre.truncation_cuts("a\n\nb\nc") == [6, 4, 2, 1, 0]
    assert pre.truncation_cuts("abc") == [3, 2, 1, 0] and pre.truncation_cuts("") == [0]
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice("ab \n") for _ in range(rng.randint(0, 30)))
        visited = [text]  # the naive loop: cut again and again, down to ""
        while visited[-1]:
            visited.append(pre.truncate_last_paragraph(visited[-1]))
        assert pre.truncation_cuts(text) == [len(prefix) for prefix in visited]
        assert all(text.startswith(prefix) for prefix in visited)


def reference_loop(tok, format_str, fields, field, length):
    """The reference's loop on `encode_text` ids: None where even an empty field does not fit."""
    fields = dict(fields)
    ids = pre.encode_text(tok, format_str.format(**fields))
    while len(ids) > length:
        if not fields[field]:
            return None
        fields[field] = pre.truncate_last_paragraph(fields[field])
        ids = pre.encode_text(tok, format_str.format(**fields))
    return ids


PIECES = ["the", "cat", " sat", "mat.", "\n", "\n\n", "  ", "aaaaaaaaaaaaaaaaaaaaaaa", "é", "日本語", "🙂",
          "!!!!!!", "http://x.com/a?b=c", "catcatcatcatcatcat", "[PAD]", "<|endoftext|>", "dog,"]


def mismatches_with_reference_loop(tok, seed, cases):
    """How many random posts / articles and budgets make tokenize_query differ from `reference_loop`."""
    rng, mismatches = random.Random(seed), 0
    for _ in range(cases):
        separator = rng.choice([" ", "", "\n"])
        body = separator.join(rng.choice(PIECES) for _ in range(rng.randint(1, 80)))
        format_str, field = rng.choice([(pre.TLDR_FORMAT, "post"), (pre.CNNDM_FORMAT, "article")])
        fields = {"subreddit": "cats", "title": "my cat", field: body}
        length = rng.randint(5, len(pre.encode_text(tok, format_str.format(**fields))) + 1)
        try:
            ids = pre.tokenize_query(tok, format_str, fields, field, length, "row")
        except pre.DataError:
            ids = None
        mismatches += ids != reference_loop(tok, format_str, fields, field, length)
    return mismatches


def test_tokenize_query_equals_the_reference_loop_on_random_posts(any_tok, monkeypatch):
    assert mismatches_with_reference_loop(any_tok, seed=1, cases=150) == 0
    # The comparison has teeth: skipping prefixes with a negative slack (more than the byte count
    # allows) is caught on the same posts.
    monkeypatch.setattr(pre, "RETOKENIZE_SLACK", -4)
    assert mismatches_with_reference_loop(any_tok, seed=1, cases=150) > 0


def test_tokenize_query_counts_the_bytes_a_normalizing_tokenizer_reads():
    """Pythia's tokenizer applies NFC, which spells U+0958 in 6 bytes, not its 3: the skip must not count 3, or it
    passes over prefixes that fit and cuts the post shorter than the reference's loop does."""
    tok = make_pythia_like_tokenizer()  # NFC, as Pythia's
    pre.add_pad_token(tok)
    fields = {"subreddit": "cats", "title": "my cat", "post": "I went home.\nThen " + "\u0958" * 100}
    length = len(pre.encode_text(tok, pre.TLDR_FORMAT.format(**{**fields, "post": "I went home."}))) + 5
    expected = reference_loop(tok, pre.TLDR_FORMAT, fields, "post", length)
    assert "I went home." in tok.decode(expected)  # the loop keeps the first paragraph
    assert pre.tokenize_query(tok, pre.TLDR_FORMAT, fields, "post", length, "row") == expected


def test_truncating_a_25k_character_post_without_newlines_is_fast(any_tok):
    post = ("the cat sat on the mat, the dog on the log; " * 600)[:25000]
    assert len(post) == 25000 and "\n" not in post
    fields = {"subreddit": "cats", "title": "my cat", "post": post}
    start = time.perf_counter()
    ids = pre.tokenize_query(any_tok, pre.TLDR_FORMAT, fields, "post", 512, "row")
    elapsed = time.perf_counter() - start
    assert elapsed < 2, f"{elapsed:.2f} s"  # the one-character-per-pass loop: minutes
    # the reference's answer: the longest character prefix that fits (one character more does not)
    kept = any_tok.decode(ids).split("POST: ", 1)[1].rsplit("\n\nTL;DR:", 1)[0]
    assert len(ids) <= 512 and post.startswith(kept) and len(kept) < len(post)
    longer = pre.TLDR_FORMAT.format(**{**fields, "post": post[:len(kept) + 1]})
    assert len(pre.encode_text(any_tok, longer)) > 512


# ---- Detail 2: truncate the paragraph, not the sentence ----

def test_truncate_last_paragraph():
    assert pre.truncate_last_paragraph("a\n\nb\nc") == "a\n\nb"
    assert pre.truncate_last_paragraph("a\n\nb") == "a\n"
    assert pre.truncate_last_paragraph("abc") == "ab"


def test_truncation_cuts_at_last_newline(tok):
    paragraphs = ["the cat sat on the mat.", "the dog sat on the log.", "the bird sat on the cat."]
    fields = {"subreddit": "cats", "title": "t", "post": "\n".join(paragraphs)}

    def ids(post):
        return encode(tok, pre.TLDR_FORMAT.format(**{**fields, "post": post}))

    two = ids("\n".join(paragraphs[:2]))
    assert pre.tokenize_query(tok, pre.TLDR_FORMAT, fields, "post", 1000, "row") == ids(fields["post"])  # fits: untouched
    assert pre.tokenize_query(tok, pre.TLDR_FORMAT, fields, "post", len(two), "row") == two  # one paragraph cut
    assert pre.tokenize_query(tok, pre.TLDR_FORMAT, fields, "post", len(two) - 1, "row") == ids(paragraphs[0])


def test_tokenize_query_drops_characters_without_newline(tok):
    fields = {"subreddit": "cats", "title": "t", "post": "the cat sat on the mat and the dog sat on the log"}

    def ids(post):
        return encode(tok, pre.TLDR_FORMAT.format(**{**fields, "post": post}))

    budget = len(ids(fields["post"])) - 2
    post = fields["post"]  # naive reference: one character at a time until it fits
    while len(ids(post)) > budget:
        post = post[:-1]
    result = pre.tokenize_query(tok, pre.TLDR_FORMAT, fields, "post", budget, "row")
    assert result == ids(post) and len(result) <= budget and post != fields["post"]


def test_unfittable_query_raises_naming_split_and_row(tok):
    with pytest.raises(pre.DataError, match=r"split 'test', row id 't9'.* > 5 tokens even with an empty post"):
        pre.process_sft_row(sft_row("t9"), tok, EOS, tok.pad_token_id, query_length=5, response_length=12,
                            query_response_length=20, split="test")


# ---- Details 1 and 3 on preference rows ----

def test_split_surgery_cnndm(tok):
    pad, eos = tok.pad_token_id, tok.eos_token_id
    rows = [preference_row("v1"), preference_row("c1", batch="cnndm0", cnndm=True, choice=1),
            preference_row("v2", batch="batch9"), preference_row("c2", batch="batch0_cnndm", cnndm=True),
            preference_row("c3", batch="cnndm2", cnndm=True)]
    validation = datasets.Dataset.from_list(rows, features=PREFERENCE_FEATURES)
    tldr, cnndm = pre.split_off_cnndm(validation, pre.CNNDM_BATCHES)
    assert [row["info"]["id"] for row in tldr] == ["v1", "v2"]
    assert [row["info"]["id"] for row in cnndm] == ["c1", "c2", "c3"]
    out = pre.process_preference_row(cnndm[0], tok, EOS, pad, cnndm=True, query_length=48, response_length=10,
                                     query_response_length=60, split="validation_cnndm")
    text = "Article:\nthe dog sat on the log.\nthe bird sat on the cat.\n\nTL;DR:\n"
    query = encode(tok, text)
    assert out["query"] == text and out["query_token"] == [pad] * (48 - len(query)) + query
    # choice 1: the second summary is chosen; its text already starts with a space, only EOS is added
    assert out["chosen"] == " a dog" + EOS and out["rejected"] == " the cat sat" + EOS
    chosen = encode(tok, " a") + encode(tok, " dog") + [eos]
    assert out["chosen_token"] == chosen + [pad] * (10 - len(chosen))
    # the reference's layout: the stripped query (its final newline dropped) re-tokenized with the response
    prompt = encode(tok, text.strip())
    assert prompt == query[:-1] and tok.decode(query[-1:]) == "\n"
    assert out["query_chosen"] == text.strip() + " a dog" + EOS
    assert out["query_chosen_token"] == prompt + chosen + [pad] * (60 - len(prompt) - len(chosen))
    assert out["query_chosen_token_len"] == len(prompt) + len(chosen)
    label = out["query_chosen_token_response_label"]
    assert label == [pad] * len(prompt) + chosen + [pad] * (60 - len(prompt) - len(chosen))
    assert (out["chosen_policy"], out["rejected_policy"], out["policies"]) == ("ref", "sup2", "ref--sup2")


# ---- bad input: a clear error before any tokenization ----

@pytest.mark.parametrize("kind, change, expected", [
    ("sft", lambda row: row.pop("title"), "expected title to be a string, got None"),
    ("sft", lambda row: row.update(summary=3), "expected summary to be a string, got 3"),
    ("sft", lambda row: row.update(post=" \n"), "expected a non-empty post"),
    ("tldr", lambda row: row["info"].update(post=None), "expected info.post to be a string, got None"),
    ("tldr", lambda row: row["info"].update(post=""), "expected a non-empty info.post"),
    ("tldr", lambda row: row["summaries"][1].update(text="no space"), "summaries[1].text"),
    ("tldr", lambda row: row["summaries"].pop(), "a list of 2 summaries"),
    ("tldr", lambda row: row.update(choice=2), "expected `choice` to be the integer 0 or 1, got 2"),
    ("tldr", lambda row: row.update(batch=None), "expected `batch` to be a string"),
    ("cnndm", lambda row: row["info"].update(article=None), "expected info.article to be a string, got None"),
])
def test_bad_rows_are_named_by_split_and_row(kind, change, expected):
    good = sft_row("ok") if kind == "sft" else preference_row("ok", cnndm=kind == "cnndm")
    bad = sft_row("bad7") if kind == "sft" else preference_row("bad7", cnndm=kind == "cnndm")
    change(bad)
    assert pre.bad_rows([good, good], "validation", kind) == []
    found = pre.bad_rows([good, bad], "validation", kind)
    assert len(found) == 1
    message = pre.bad_row_message("validation", *found[0])
    assert "split 'validation', row 1 (id 'bad7')" in message and expected in message


def test_missing_split_names_it_and_the_existing_ones():
    rows = datasets.Dataset.from_list([sft_row()], features=SFT_FEATURES)
    with pytest.raises(pre.DataError, match=r"missing split\(s\) \['test'\]; it has splits \['train', 'validation'\]"):
        pre.require_splits(datasets.DatasetDict(train=rows, validation=rows), pre.SFT_SPLITS, "src")


# ---- Detail 4: length flags against the computed maxima ----

def test_length_check():
    flag, maxima = "max_sft_response_length", {"sft/train reference_response_token_len": 53,
                                               "sft/test reference_response_token_len": 50}
    assert pre.length_problem(flag, 53, maxima, exact=True) is None
    too_small = pre.length_problem(flag, 52, maxima, exact=False)  # an error even without the exact check
    assert "sft/train" in too_small and "data would be cut" in too_small and "pass --max_sft_response_length 53" in too_small
    assert pre.length_problem(flag, 60, maxima, exact=False) is None
    mismatch = pre.length_problem(flag, 60, maxima, exact=True)
    assert "--max_sft_response_length is 60" in mismatch and "pass --max_sft_response_length 53" in mismatch


def test_length_report_prints_every_flag_then_names_each_problem(capsys):
    """report_lengths: the table of every flag against the data (to copy values from), then one DataError naming
    each flag that cuts data or, with the exact check, differs; without the exact check only a cut fails."""
    checks = [("query_length", 192, {"sft/train query_token_len": 192}, True),
              ("max_sft_response_length", 60, {"sft/train reference_response_token_len": 67}, True),
              ("max_rm_response_length", 80, {"preference/train chosen_token_len": 70}, True)]
    with pytest.raises(pre.DataError) as error:
        pre.report_lengths(checks, check_length_correctness=True)
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 4 and table[2].split() == ["max_sft_response_length", "60", "67", "sft/train",
                                                     "reference_response_token_len"]
    problems = str(error.value).splitlines()
    assert problems[0] == "length flags do not match the data:" and len(problems) == 3
    assert "--max_sft_response_length 60, so data would be cut: pass --max_sft_response_length 67" in problems[1]
    assert "--max_rm_response_length is 80 but the longest is 70" in problems[2]
    with pytest.raises(pre.DataError) as error:
        pre.report_lengths(checks, check_length_correctness=False)
    assert len(str(error.value).splitlines()) == 2  # the cut only
    pre.report_lengths([checks[0], checks[2]], check_length_correctness=False)  # nothing cut, nothing exact: passes


def test_length_check_passes_on_cnndm_shaped_rows(tok):
    """CNN/DM queries end in a newline that the reference strips: the widths it computed (2021 for Pythia) pass."""
    articles = ["the dog sat on the log.\nthe bird sat on the cat.", "my cat and my dog sat on the mat.",
                "a dog, a cat, a mat, a log.\n\nthe bird did not."]
    rows = [preference_row(f"c{i}", batch="cnndm0", cnndm=True, texts=(" the cat sat on the mat", " a dog"))
            for i in range(len(articles))]
    for row, article in zip(rows, articles):
        row["info"]["article"] = article
    refs = [reference_columns(tok, pre.CNNDM_FORMAT, row["info"], "article", 48, s["text"] + EOS)
            for row in rows for s in row["summaries"]]
    widest = max(ref["query_response_token_len"] for ref in refs)
    assert widest == max(ref["query_token_len"] - 1 + ref["response_token_len"] for ref in refs)
    outs = [pre.process_preference_row(row, tok, EOS, tok.pad_token_id, cnndm=True, query_length=48,
                                       response_length=12, query_response_length=widest, split="validation_cnndm")
            for row in rows]
    maxima = pre.column_maxima({"preference/validation_cnndm": datasets.Dataset.from_list(outs)},
                               ("query_chosen_token_len", "query_rejected_token_len"))
    assert pre.length_problem("cnndm_max_rm_query_response_length", widest, maxima, exact=True) is None
    assert "pass --cnndm_max_rm_query_response_length" in pre.length_problem(
        "cnndm_max_rm_query_response_length", widest + 1, maxima, exact=True)  # the concatenated layout's width


# ---- Detail 6 ----

def test_policy_pair_counts():
    rows = [{"policies": "a--b"}, {"policies": "a--c"}, {"policies": "a--b"}]
    dataset_dict = {"train": datasets.Dataset.from_list(rows), "validation": datasets.Dataset.from_list(rows[1:])}
    assert pre.policy_pair_counts(dataset_dict, ("train", "validation")) == {
        "train": {"a--b": 2, "a--c": 1}, "validation": {"a--c": 1, "a--b": 1}}


# ---- reading datasets in one batch (plumbing) ----

def test_rows_and_columns_read_in_one_batch_equal_the_row_by_row_reads():
    """as_rows(d) == list(d) and d[column][:] == list(d[column]), on the committed world's preference validation rows
    (nested `info`, a list of `summaries` dicts, `extra` with None confidences), reordered and thinned by `select`."""
    source = datasets.load_dataset(str(REPO / "assets" / "tiny_world" / "summarize_from_feedback"), "comparisons",
                                   split="validation")
    dataset = source.select([5, 3, 1, *range(40, 80, 7)])  # an indices mapping over the Arrow table
    assert pre.as_rows(dataset) == list(dataset) and len(pre.as_rows(dataset)) == 9
    for column in dataset.column_names:
        assert dataset[column][:] == list(dataset[column]), column
    assert pre.as_rows(dataset.select([])) == []


def test_map_processes_forks_only_for_splits_worth_it(monkeypatch):
    monkeypatch.setattr(pre, "usable_cpus", lambda: 4)
    assert [pre.map_processes(None, rows) for rows in (0, 5, 1999, 2000, 3999, 16384)] == [None, None, None, 2, 3, 4]
    assert pre.map_processes(1, 5) == 1 and pre.map_processes(3, 16384) == 3  # --num_proc is taken as given
    monkeypatch.setattr(pre, "usable_cpus", lambda: None)  # unknown: one process
    assert pre.map_processes(None, 16384) is None


def test_map_splits_writes_the_table_of_a_row_by_row_map(tok):
    """map_splits hands the row function batches of rows (row_by_row): the table is the one a plain row-by-row `map`
    writes (columns, their order and types, values), in this process and in 2 worker processes, an empty split too."""
    rows = [sft_row(f"t{i}", post="the cat sat on the mat. " * (i % 4 + 1), summary="cat sat " * (i % 3 + 1))
            for i in range(9)]
    splits = datasets.DatasetDict(train=datasets.Dataset.from_list(rows), test=datasets.Dataset.from_list(rows[:4]),
                                  validation=datasets.Dataset.from_list(rows).select([]))

    def kwargs(split):
        return dict(tokenizer=tok, eos_text=tok.eos_token, pad_id=tok.pad_token_id, query_length=96,
                    response_length=16, query_response_length=112, split=split)

    for num_proc in (None, 2):
        ours = pre.map_splits(splits, pre.process_sft_row, num_proc, "sft", kwargs)
        for split, dataset in splits.items():
            plain = dataset.map(pre.process_sft_row, fn_kwargs=kwargs(split))
            assert ours[split].column_names == plain.column_names and ours[split].features == plain.features
            assert ours[split].data.table.equals(plain.data.table) and len(ours[split]) == len(dataset), split
        assert "query_token" in ours["train"].column_names and len(ours["validation"]) == 0


def test_usable_cpus_are_the_affinity_of_this_process_not_the_node(monkeypatch):
    """A SLURM task of 16 CPUs on a node of 224 threads: os.cpu_count() says 224, the affinity 16."""
    monkeypatch.setattr(pre.os, "cpu_count", lambda: 224)
    monkeypatch.setattr(pre.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert pre.usable_cpus() == 16 and pre.map_processes(None, 116722) == 16
    monkeypatch.delattr(pre.os, "sched_getaffinity")  # not on Linux: the CPU count
    assert pre.usable_cpus() == 224


# ---- --help: tyro builds it from the field docstrings ----

def test_help_shows_every_flag_with_its_docstring(capsys):
    tree = ast.parse(inspect.getsource(pre.Args))
    body = tree.body[0].body
    docstrings = {node.target.id: body[i + 1].value.value for i, node in enumerate(body[:-1])
                  if isinstance(node, ast.AnnAssign) and isinstance(body[i + 1], ast.Expr)}
    assert set(docstrings) == {field.name for field in dataclasses.fields(pre.Args)}
    with pytest.raises(SystemExit):
        tyro.cli(pre.Args, args=["--help"], use_underscores=True)  # as the script calls it
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().out).split())
    for name, docstring in docstrings.items():
        assert f"--{name}" in text
        assert " ".join(docstring.split()) in text, name


# ---- smoke: the script end to end on hub-style local folders ----

def write_hub_style_dataset(folder, config, splits, features):
    """Parquet files plus a README whose YAML `configs:` makes `load_dataset(folder, config)` work."""
    lines = ["---", "configs:", f"- config_name: {config}", "  data_files:"]
    for split, rows in splits.items():
        (folder / config).mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(rows, features=features).to_parquet(str(folder / config / f"{split}.parquet"))
        lines += [f"  - split: {split}", f"    path: {config}/{split}.parquet"]
    (folder / "README.md").write_text("\n".join(lines + ["---", ""]))


def smoke_sources():
    """Small SFT and preference sources ({split: [row]}): one post to truncate, two CNN/DM comparisons."""
    long_post = "the cat sat on the mat.\n" + "the dog sat on the log. " * 8
    sft = {"train": [sft_row("a1"), sft_row("a2", summary="my cat sat on the mat and the dog did not"),
                     sft_row("a3", post=long_post)],
           "validation": [sft_row("b1", summary="a dog")], "test": [sft_row("c1", summary="a cat, a mat")]}
    preference = {
        "train": [preference_row("p1", confidence=3), preference_row("p2", choice=1, policies=("sup1", "sup2"))],
        "validation": [preference_row("v1", confidence=8, policies=("ref", "ppo")),
                       preference_row("c1", batch="cnndm0", cnndm=True),
                       # CNN/DM summaries as OpenAI wrote them, after "TL;DR:\n": no leading space
                       preference_row("c2", batch="batch0_cnndm", cnndm=True, texts=("a dog sat", '"the cat'))],
    }
    return sft, preference


def reference_flags(tok, sft, preference, query_length=40):
    """The length flags for rows built the reference's way (the script's check accepts exactly these), and the
    (query, response, query+response) ids of each response: {"sft" | "tldr" | "cnndm": [(q, r, qr)]}.

    Query budgets the data reach (a budget above a query+response width is a flag error): `query_length`
    cuts long posts; the CNN/DM budget is the longest article query, untruncated. Without CNN/DM rows the
    cnndm_* flags keep their defaults."""
    def widths(format_str, field, length, fields, response):
        ref = reference_columns(tok, format_str, fields, field, length, response)
        return ref["query_token_len"], ref["response_token_len"], ref["query_response_token_len"]
    cnndm_rows = [row for row in preference["validation"] if row["batch"] in pre.CNNDM_BATCHES]
    tldr_rows = preference["train"] + [row for row in preference["validation"] if row not in cnndm_rows]
    cnndm_query_length = max((len(encode(tok, pre.CNNDM_FORMAT.format(**row["info"]))) for row in cnndm_rows),
                             default=None)
    found = {
        "sft": [widths(pre.TLDR_FORMAT, "post", query_length, row, " " + row["summary"] + EOS)
                for rows in sft.values() for row in rows],
        "tldr": [widths(pre.TLDR_FORMAT, "post", query_length, row["info"], s["text"] + EOS)
                 for row in tldr_rows for s in row["summaries"]],
        "cnndm": [widths(pre.CNNDM_FORMAT, "article", cnndm_query_length, row["info"], s["text"] + EOS)
                  for row in cnndm_rows for s in row["summaries"]],
    }
    flags = {"query_length": query_length,
             "max_sft_response_length": max(r for _, r, _ in found["sft"]),
             "max_sft_query_response_length": max(qr for _, _, qr in found["sft"]),
             "max_rm_response_length": max(r for _, r, _ in found["tldr"]),
             "max_rm_query_response_length": max(qr for _, _, qr in found["tldr"])}
    if cnndm_rows:
        flags.update(cnndm_query_length=cnndm_query_length,
                     cnndm_max_rm_response_length=max(r for _, r, _ in found["cnndm"]),
                     cnndm_max_rm_query_response_length=max(qr for _, _, qr in found["cnndm"]))
    return flags, found


def write_world(folder, sft, preference) -> list:
    """Write a tokenizer (no pad token) and hub-style sources into `folder`; return the script's command
    without --output_dir and length flags."""
    make_tokenizer().save_pretrained(str(folder / "tokenizer"))  # no pad token: the script must add one
    write_hub_style_dataset(folder / "sft_src", "default", sft, SFT_FEATURES)
    write_hub_style_dataset(folder / "pref_src", "comparisons", preference, PREFERENCE_FEATURES)
    return [sys.executable, str(REPO / "preprocess_tldr.py"), "--base_model", str(folder / "tokenizer"),
            "--sft_dataset", str(folder / "sft_src"), "--preference_dataset", str(folder / "pref_src")]


def flag_args(flags: dict) -> list:
    """{flag: value} as command-line arguments."""
    return [arg for flag, value in flags.items() for arg in (f"--{flag}", str(value))]


def test_script_smoke(tmp_path, tok):
    sft, preference = smoke_sources()
    # Expected maxima of rows built the reference's way (the long post truncated, the stripped query
    # re-tokenized with each response): the script's length check must accept exactly these.
    flags, widths = reference_flags(tok, sft, preference)
    query_length = flags["query_length"]
    # Shaped like the real CNN/DM: the query's final newline is stripped, so query ids + response ids
    # (the layout before) would be one id longer than the reference's rows and fail this check.
    assert all(qr == q - 1 + r for q, r, qr in widths["cnndm"])
    assert all(qr == q + r for q, r, qr in widths["tldr"] + widths["sft"])
    out = tmp_path / "out"
    command = write_world(tmp_path, sft, preference) + ["--output_dir", str(out), "--num_proc", "2"]
    command += flag_args(flags)
    result = run_python(command, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "added the pad token '[PAD]'" in result.stdout
    # the outputs and nothing else: the scratch folder is gone when the script returns
    assert sorted(os.listdir(out)) == ["args.json", "dropped_rows.json", "policy_pairs.json", "preference", "sft",
                                       "visuals"]
    assert json.loads((out / "dropped_rows.json").read_text()) == []  # every row was usable

    sft_out = datasets.load_from_disk(str(out / "sft"))
    preference_out = datasets.load_from_disk(str(out / "preference"))
    assert dict(sft_out.num_rows) == {"train": 3, "validation": 1, "test": 1}
    assert dict(preference_out.num_rows) == {"train": 2, "validation": 1, "validation_cnndm": 2}
    assert set(sft_out["train"].column_names) == set(pre.SFT_DESCRIPTIONS)
    assert set(preference_out["train"].column_names) == set(pre.PREFERENCE_DESCRIPTIONS)
    long = sft_out["train"][2]  # the long post lost its last paragraph, not a sentence
    assert long["query"].endswith("the cat sat on the mat.\n\nTL;DR:") and long["query_token_len"] <= query_length
    cnndm_rows = preference_out["validation_cnndm"]
    assert [row["info"]["id"] for row in cnndm_rows] == ["c1", "c2"]
    assert all(row["query"].startswith("Article:\n") for row in cnndm_rows)
    assert {len(row["query_token"]) for row in cnndm_rows} == {flags["cnndm_query_length"]}
    assert {len(row["query_chosen_token"]) for row in cnndm_rows} == {flags["cnndm_max_rm_query_response_length"]}
    assert {len(row["query_chosen_token"]) for row in preference_out["validation"]} == {flags["max_rm_query_response_length"]}

    saved = json.loads((out / "args.json").read_text())
    assert saved["pad_token_id"] == len(make_tokenizer()) and saved["pad_token_id"] != saved["eos_token_id"]
    assert saved["base_model"] == str(tmp_path / "tokenizer") and "git_commit" in saved
    pairs = json.loads((out / "policy_pairs.json").read_text())
    assert pairs["train"] == {"ref--sup2": 1, "sup1--sup2": 1} and pairs["validation"] == {"ppo--ref": 1}
    for name, dataset_dict in (("sft", sft_out), ("preference", preference_out)):
        card = (out / name / "README.md").read_text()
        assert all(f"`{column}`" in card for column in dataset_dict["train"].column_names)
    for png in ("token_len.png", "confidence.png", "policies.png"):
        assert (out / "visuals" / png).stat().st_size > 0


def test_length_checks_see_every_split_and_both_summaries():
    """Detail 4: right_pad cuts silently, so the length check is the only guard: its maxima cover every SFT split (a
    validation or test reference longer than train's) and both summaries of a pair (a rejected summary longer than
    every chosen one, which would otherwise lose its EOS and be scored at another token)."""
    from types import SimpleNamespace

    table = lambda **columns: datasets.Dataset.from_dict({name: [value] for name, value in columns.items()})  # noqa: E731
    sft = {split: table(query_token_len=5, reference_response_token_len=n, query_reference_response_token_len=5 + n)
           for split, n in (("train", 3), ("validation", 9), ("test", 7))}
    pair = lambda chosen, rejected, query=5: table(  # noqa: E731
        query_token_len=query, chosen_token_len=chosen, rejected_token_len=rejected,
        query_chosen_token_len=query + chosen, query_rejected_token_len=query + rejected)
    preference = {"train": pair(4, 11), "validation": pair(6, 2), "validation_cnndm": pair(3, 8, query=20)}
    args = SimpleNamespace(**dict.fromkeys(("query_length", "max_sft_response_length", "max_sft_query_response_length",
                                            "max_rm_response_length", "max_rm_query_response_length",
                                            "cnndm_query_length", "cnndm_max_rm_response_length",
                                            "cnndm_max_rm_query_response_length"), 0))
    checks = pre.length_checks(args, sft, preference)
    longest = {flag: max(maxima.values()) for flag, _, maxima, _ in checks}
    assert longest == {"query_length": 5, "max_sft_response_length": 9, "max_sft_query_response_length": 14,
                       "max_rm_response_length": 11, "max_rm_query_response_length": 16, "cnndm_query_length": 20,
                       "cnndm_max_rm_response_length": 8, "cnndm_max_rm_query_response_length": 28}
    # The query lengths are budgets the data need not reach; every response width must equal the data's maximum.
    assert {flag: exact for flag, _, _, exact in checks} == {
        "query_length": False, "max_sft_response_length": True, "max_sft_query_response_length": True,
        "max_rm_response_length": True, "max_rm_query_response_length": True, "cnndm_query_length": False,
        "cnndm_max_rm_response_length": True, "cnndm_max_rm_query_response_length": True}
