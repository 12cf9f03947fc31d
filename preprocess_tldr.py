"""Preprocess Reddit TL;DR for RLHF: tokenized SFT and preference datasets (Details 1-6).

Reads OpenAI's filtered TL;DR posts with human reference summaries (the SFT data) and OpenAI's
human comparisons of two summaries (the preference data), formats each post as a query, cuts the
post paragraph by paragraph until the query fits, and tokenizes queries and responses with the
base model's tokenizer into fixed-length columns, so that no later stage tokenizes anything:

    {output_dir}/sft                train / validation / test                 (sft.py, ppo.py)
    {output_dir}/preference         train / validation / validation_cnndm     (reward.py, dpo.py)
    {output_dir}/args.json          these flags, the eos / pad ids, the base model's name, the tokenizer's identity
                                    and the git commit
    {output_dir}/policy_pairs.json  comparisons per policy pair and split
    {output_dir}/dropped_rows.json  the source rows --drop_bad_rows left out, and why ([] without it)
    {output_dir}/visuals/           token_len.png, confidence.png, policies.png

Each dataset folder holds a card (README.md) with a one-line description of every column. Every
output is built in a scratch folder beside it and moved into place in one step, so a run that fails
or is killed leaves the previous outputs whole (and a watcher process deletes the scratch).

    # tiny world, offline, seconds on a laptop
    python preprocess_tldr.py --base_model assets/tiny_world/pythia-tiny \
        --sft_dataset assets/tiny_world/tldr_3_filtered \
        --preference_dataset assets/tiny_world/summarize_from_feedback \
        --output_dir data/tiny_tldr --query_length 192 --max_sft_response_length 67 \
        --max_sft_query_response_length 222 --max_rm_response_length 70 \
        --max_rm_query_response_length 259 --cnndm_query_length 192 \
        --cnndm_max_rm_response_length 62 --cnndm_max_rm_query_response_length 206
    # the paper's datasets with the Pythia tokenizer (every length flag at its paper value; a maximum that
    # transformers 5 computes otherwise fails the check, naming the flag to pass), into
    # data/EleutherAI/pythia-1b-deduped/tldr, where sft.py / reward.py / dpo.py / ppo.py look by default
    python preprocess_tldr.py --base_model EleutherAI/pythia-1b-deduped
    # the same into data/tldr, then publish both datasets with their cards on the Hub
    python preprocess_tldr.py --output_dir data/tldr --push_to_hub

Details (paper, Appendix B): 1 the two datasets and the split `validation_cnndm`; 2 the query
format and paragraph truncation; 3 the leading space, the EOS and a [PAD] that is not EOS;
4 maximum lengths computed, checked against the flags and plotted; 5 left-padded queries and
right-padded query+response columns; 6 comparisons per policy pair in train vs validation.
Nothing is logged to a tracker; printed: whether [PAD] was added, the computed vs configured
length table, the policy pairs per split, the output paths. Bad flags fail before anything is
loaded; bad source files and rows fail before any tokenization, naming the file and line or the
split and row id of every bad row; `--drop_bad_rows` leaves such rows out instead and lists them.
"""

import atexit
import ctypes
import errno
import functools
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass
from itertools import accumulate
from typing import Optional

import datasets
import tyro
from huggingface_hub.utils import HFValidationError
from transformers import AutoTokenizer


@dataclass
class Args:
    """Tokenize TL;DR into SFT and preference datasets (see the module docstring of preprocess_tldr.py)."""

    # experiment & output
    output_dir: Optional[str] = None
    """Folder for sft/, preference/, args.json, policy_pairs.json, dropped_rows.json and visuals/ (None: data/{base_model}/tldr, where the training stages look by default)"""
    push_to_hub: bool = False
    """Also push both datasets and their cards to the Hub (needs a login; off: nothing networked)"""
    hf_entity: Optional[str] = None
    """Hub user or organisation to push to (None: the logged-in user, from `whoami()`)"""

    # data
    sft_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered"
    """SFT source: Hub id or local dataset dir with splits train/validation/test (Detail 1)"""
    preference_dataset: str = "openai/summarize_from_feedback"
    """Preference source: Hub id (a loading script is read from its parquet export) or local dataset dir with splits train/validation (Detail 1)"""
    preference_config: str = "comparisons"
    """Config (subset) of the preference dataset to load"""
    num_proc: Optional[int] = None
    """Worker processes for each split's `datasets.map` (None: one per 1000 rows, at most the CPUs it may use, and none,
    the split mapped in this process, below 2000 rows)"""

    # model
    base_model: str = "EleutherAI/pythia-1b-deduped"
    """Tokenizer source: Hub id or local dir (the length defaults hold for Pythia's tokenizer)"""

    # lengths in tokens: budgets for queries, computed maxima for responses
    query_length: int = 512
    """Query length in tokens; longer queries are truncated (Detail 2; paper: 512)"""
    max_sft_response_length: int = 53
    """Longest SFT reference response, EOS included (Detail 4; paper: 53)"""
    max_sft_query_response_length: int = 562
    """Longest SFT stripped query + reference response, re-tokenized, pads excluded (Detail 4; paper: 562)"""
    max_rm_response_length: int = 169
    """Longest TL;DR chosen / rejected response (Detail 4; paper: 169)"""
    max_rm_query_response_length: int = 638
    """Longest TL;DR stripped query + chosen / rejected response, re-tokenized (Detail 4; paper: 638)"""
    cnndm_query_length: int = 1919
    """CNN/DM query length in tokens; longer ones are truncated (Detail 2; reference code: 2047 - 128 = 1919)"""
    cnndm_max_rm_response_length: int = 155
    """Longest CNN/DM chosen / rejected response (Detail 4; reference code: 155)"""
    cnndm_max_rm_query_response_length: int = 2021
    """Longest CNN/DM stripped query + chosen / rejected response, re-tokenized (Detail 4; paper: 2021)"""
    check_length_correctness: bool = True
    """Fail unless every computed maximum equals its flag (a larger maximum always fails; reference: True)"""
    drop_bad_rows: bool = False
    """Leave out the source rows this script cannot use (a TL;DR summary without its leading space, an empty post, an
    SFT post id repeated), each listed with its reason in dropped_rows.json; off: fail, listing them (the reference
    code tokenized such rows as they were)"""


# The query templates of OpenAI's summarize-from-feedback code. No space after "TL;DR:": the
# response brings its own leading space, so " word" tokenizes as it does in the human summaries.
# A CNN/DM summary follows "TL;DR:\n" with none (OpenAI's "{reference}"); the reference strips that newline.
TLDR_FORMAT = "SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
CNNDM_FORMAT = "Article:\n{article}\n\nTL;DR:\n"
# The `batch` names of the CNN/DM news comparisons hidden in the preference validation split.
CNNDM_BATCHES = ("batch0_cnndm", "cnndm0", "cnndm2")
SFT_SPLITS = ("train", "validation", "test")
PREFERENCE_SPLITS = ("train", "validation")


class DataError(ValueError):
    """Input data or a length flag the script cannot use; the message says where and what to fix."""


class SetupError(ValueError):
    """Flags, data, tokenizer or output folder the script cannot use; raised before any compute."""


def add_pad_token(tokenizer) -> bool:
    """Make [PAD] the pad token of `tokenizer`, whatever pad it came with (none, EOS or another); True if it changed."""
    # As the reference: transformers 5 loads Pythia's tokenizer with the pad "<|padding|>" (id 1; none under
    # 4.x), and [PAD] (id 50277) is the pad of the reference's datasets and checkpoints under either version.
    if tokenizer.pad_token == "[PAD]":
        return False
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    return True


def encode_text(tokenizer, text: str) -> list:
    """Ids of `text` read as plain text: `[PAD]` or `<|endoftext|>` typed in it stay characters, never special ids."""
    # A user who writes "<|endoftext|>" in a post must not end the sequence there (the reward is read
    # at the first EOS), nor "[PAD]" hide a token from every loss. Special ids are placed by this file
    # only (add_special_tokens=False: no template adds any); other added tokens (Pythia's runs of
    # spaces) still match, so normal text gets exactly the ids a plain `encode` gives.
    return list(recent_encodings(tokenizer, text))


def split_off_cnndm(validation, cnndm_batches: tuple) -> tuple:
    """Split a preference validation Dataset into (TL;DR rows, CNN/DM rows) by their `batch`."""
    batches = validation["batch"][:] if "batch" in validation.column_names else [None] * len(validation)
    is_cnndm = [batch in cnndm_batches for batch in batches]
    # Two complementary selections: every row lands in exactly one split, none is dropped.
    return (validation.select([i for i, cnndm in enumerate(is_cnndm) if not cnndm]),
            validation.select([i for i, cnndm in enumerate(is_cnndm) if cnndm]))


def truncate_last_paragraph(text: str, separator: str = "\n") -> str:
    """Cut `text` just before its last separator; without one, drop its last character."""
    cut = text.rfind(separator)
    return text[:cut] if cut != -1 else text[:-1]


def query_columns(tokenizer, format_str: str, fields: dict, truncate_field: str, length: int, pad_id: int,
                  where: str) -> dict:
    """The query, query_token and query_token_len columns of one row."""
    # Detail 2: Truncate the paragraph, not the sentence
    # Over budget, the post loses its last paragraph until the query fits (OpenAI's tasks.py):
    #     while len(ids) > length: post = truncate_last_paragraph(post)
    # so the model reads whole paragraphs, not a post that stops mid-sentence; a post with no newline
    # left loses one character per pass. tokenize_query computes exactly that, token for token,
    # without re-tokenizing every prefix (minutes on a 20k-character post).
    ids = tokenize_query(tokenizer, format_str, fields, truncate_field, length, where)
    query_token = left_pad(ids, length, pad_id)  # (length,): pads first, the query ends at the last column
    # Only special ids are skipped (the pads): a "[PAD]" typed in the post is text ids and stays in.
    # lstrip as in the reference (a no-op for these templates). The reference decoded under transformers
    # 4.33, whose clean_up_tokenization_spaces (then on by default) also rewrote " ," to "," and " 'm" to
    # "'m": its query text could differ from its query_token. Transformers 5 decodes the ids as they are.
    query = tokenizer.decode(query_token, skip_special_tokens=True).lstrip()
    return {"query": query, "query_token": query_token, "query_token_len": len(ids)}


def left_pad(ids: list, length: int, pad_id: int) -> list:
    """`ids` preceded by pads to exactly `length` ids (ids must fit)."""
    assert len(ids) <= length, f"{len(ids)} ids do not fit in {length}"
    return [pad_id] * (length - len(ids)) + ids


def right_pad(ids: list, length: int, pad_id: int) -> list:
    """`ids` followed by pads (or cut) to exactly `length` ids."""
    return ids[:length] + [pad_id] * (length - len(ids))


def response_label(query_response: list, query_len: int, pad_id: int) -> list:
    """Copy of `query_response` with its first `query_len` (query) ids set to pad."""
    return [pad_id] * query_len + query_response[query_len:]


def response_columns(tokenizer, prompt: str, prompt_ids: list, name: str, text: str, eos_text: str,
                     response_length: int, query_response_length: int, pad_id: int, where: str) -> dict:
    """The seven `name` columns (see `response_descriptions`) of the response `text` (no EOS) to `prompt`.

    `prompt` is the stripped query and `prompt_ids` its ids: the reference's layout, which tokenizes
    `query.strip() + response` as one text (the EOS id is appended here, never tokenized from text)."""
    eos_id = tokenizer.eos_token_id
    response_ids = encode_text(tokenizer, text) + [eos_id]
    query_response_ids = encode_text(tokenizer, prompt + text) + [eos_id]
    # The label mask covers the prompt's ids, so they must open the joined ids: a response that starts
    # with a space starts a new token (a byte-level BPE never merges across a space). A CNN/DM summary has
    # no leading space, and one that opens with punctuation ('"Four ...') may merge with the prompt's
    # closing ":" into one id, which is then the first label (the reference masked it with the query).
    shared = next((i for i, (a, b) in enumerate(zip(query_response_ids, prompt_ids)) if a != b),
                  min(len(query_response_ids), len(prompt_ids)))
    if shared < len(prompt_ids) - (not (text[:1].isspace() or text[:1].isalnum())):
        raise DataError(f"{where}: the ids of the query + {name} do not start with the ids of the query alone "
                        f"(the tokenizer merges across {prompt[-20:]!r} + {text[:20]!r}); expected the response "
                        "to start a new token (a leading space): fix the row or use a byte-level BPE tokenizer")
    query_response_token = right_pad(query_response_ids, query_response_length, pad_id)
    return {
        name: text + eos_text,
        f"{name}_token": right_pad(response_ids, response_length, pad_id),
        f"{name}_token_len": len(response_ids),
        f"query_{name}": prompt + text + eos_text,
        f"query_{name}_token": query_response_token,
        f"query_{name}_token_len": len(query_response_ids),
        # The reference masks query_token_len ids. A CNN/DM query ends in "\n", which strip() drops, so
        # there it also masked the first response id; here exactly the prompt's ids that open the row.
        f"query_{name}_token_response_label": response_label(query_response_token, shared, pad_id),
    }


def process_sft_row(row: dict, tokenizer, eos_text: str, pad_id: int, query_length: int,
                    response_length: int, query_response_length: int, split: str) -> dict:
    """Query and reference-response columns of one SFT row."""
    where = f"split '{split}', row id {row['id']!r}"
    query = query_columns(tokenizer, TLDR_FORMAT, row, "post", query_length, pad_id, where)
    prompt = query["query"].strip()
    # The human summary has no leading space: add one (" word" after "TL;DR:", as in the preference
    # data); the EOS the SFT model must learn to emit ends the response.
    return {**query, **response_columns(tokenizer, prompt, encode_text(tokenizer, prompt), "reference_response",
                                        " " + row["summary"], eos_text, response_length, query_response_length,
                                        pad_id, where)}


def process_preference_row(row: dict, tokenizer, eos_text: str, pad_id: int, cnndm: bool, query_length: int,
                           response_length: int, query_response_length: int, split: str) -> dict:
    """Query, chosen and rejected columns of one preference row (CNN/DM format if `cnndm`)."""
    format_str, truncate_field = (CNNDM_FORMAT, "article") if cnndm else (TLDR_FORMAT, "post")
    where = f"split '{split}', row id {row['info']['id']!r}"
    query = query_columns(tokenizer, format_str, row["info"], truncate_field, query_length, pad_id, where)
    prompt = query["query"].strip()
    prompt_ids = encode_text(tokenizer, prompt)
    chosen, rejected = row["summaries"][row["choice"]], row["summaries"][1 - row["choice"]]
    columns = {**query, "chosen_policy": chosen["policy"], "rejected_policy": rejected["policy"],
               "policies": "--".join(sorted([chosen["policy"], rejected["policy"]]))}
    for name, summary in (("chosen", chosen), ("rejected", rejected)):  # TL;DR: the text has its leading space
        columns.update(response_columns(tokenizer, prompt, prompt_ids, name, summary["text"], eos_text,
                                        response_length, query_response_length, pad_id, where))
    return columns


def length_checks(args: Args, sft, preference) -> list:
    """[(flag, configured value, {where: computed maximum}, must equal the flag)] for the eight length flags."""
    # Detail 4: SFT and preference lengths differ
    # The SFT summaries were filtered to be short (53 Pythia tokens at most), the preference ones
    # were not (169), and CNN/DM queries are longer still. Every padded width is a flag; compare
    # each with the true maximum: too small cuts data, too large wastes memory in every batch.
    sft_tables = {f"sft/{split}": sft[split] for split in SFT_SPLITS}
    tldr_tables = {f"preference/{split}": preference[split] for split in PREFERENCE_SPLITS}
    cnndm_tables = {"preference/validation_cnndm": preference["validation_cnndm"]}
    responses = ("chosen_token_len", "rejected_token_len")
    query_responses = ("query_chosen_token_len", "query_rejected_token_len")
    # Query lengths are budgets (truncation makes every query fit) that the data need not reach;
    # response widths are maxima of the data, so with check_length_correctness they must match.
    return [(flag, getattr(args, flag), column_maxima(tables, columns), exact) for flag, tables, columns, exact in (
        ("query_length", {**sft_tables, **tldr_tables}, ("query_token_len",), False),
        ("max_sft_response_length", sft_tables, ("reference_response_token_len",), True),
        ("max_sft_query_response_length", sft_tables, ("query_reference_response_token_len",), True),
        ("max_rm_response_length", tldr_tables, responses, True),
        ("max_rm_query_response_length", tldr_tables, query_responses, True),
        ("cnndm_query_length", cnndm_tables, ("query_token_len",), False),
        ("cnndm_max_rm_response_length", cnndm_tables, responses, True),
        ("cnndm_max_rm_query_response_length", cnndm_tables, query_responses, True),
    )]


def column_maxima(tables: dict, columns: tuple) -> dict:
    """Maximum of each integer column of each non-empty table, keyed '{table name} {column}'."""
    return {f"{name} {column}": max(table[column][:]) for name, table in tables.items() for column in columns
            if len(table) > 0}


def length_problem(flag: str, configured: int, maxima: dict, exact: bool) -> Optional[str]:
    """Why --flag=configured does not suit the computed `maxima` ({where: max}), None if it does."""
    if not maxima:
        return None
    where, computed = max(maxima.items(), key=lambda item: item[1])
    if computed > configured:  # right_pad has cut these rows: never acceptable
        return f"{where} reaches {computed} tokens > --{flag} {configured}, so data would be cut: pass --{flag} {computed}"
    if exact and computed != configured:
        return (f"--{flag} is {configured} but the longest is {computed} ({where}): pass --{flag} {computed}"
                " (or --no_check_length_correctness to keep the flag)")
    return None


def policy_pair_counts(dataset_dict, splits: tuple) -> dict:
    """{split: {"policyA--policyB": number of comparisons}}, most frequent pair first."""
    return {split: dict(Counter(dataset_dict[split]["policies"][:]).most_common()) for split in splits}


def main() -> None:
    """The stage, top to bottom (run at the end of the file, once the plumbing below the fence is defined)."""
    args = tyro.cli(Args, use_underscores=True)  # --help shows --flag_name as the docs write it; --flag-name works too
    args.output_dir = args.output_dir or os.path.join("data", model_name(args.base_model), "tldr")
    problems = preprocess_flag_problems(args)  # every flag, before anything is loaded or written
    if problems:
        raise SetupError("bad flags:\n  " + "\n  ".join(problems))

    # ---- tokenizer ----
    tokenizer = load_base_tokenizer(args.base_model)
    assert tokenizer.eos_token is not None, f"{args.base_model}: the tokenizer has no EOS token"
    # Detail 3: Leading space, EOS at the end, a distinct [PAD]
    # Pythia's tokenizer has no pad token of its own (transformers 5 fills in "<|padding|>", id 1), and
    # the common fix pad = eos would make every loss and attention mask that ignores pads ignore the
    # EOS too: the SFT model would never learn to stop. [PAD] gets the next free id, as in the
    # reference (50277 for Pythia, inside its 50304-row embedding), whatever pad the tokenizer had.
    if add_pad_token(tokenizer):
        print(f"added the pad token {tokenizer.pad_token!r} (id {tokenizer.pad_token_id}) to {args.base_model}")
    pad_id, eos_text = tokenizer.pad_token_id, tokenizer.eos_token
    assert pad_id != tokenizer.eos_token_id, f"pad id {pad_id} must differ from eos id {tokenizer.eos_token_id}"

    # ---- data: load, split, validate every row before any tokenization ----
    # Until the last step this run writes into a scratch folder only (its outputs, and a local source's caches; a Hub
    # source's download and caches go to the datasets cache, ~/.cache/huggingface/datasets, as datasets does).
    scratch = start_scratch(args.output_dir)
    sft_source = load_source(args.sft_dataset, None, scratch)
    preference_source = load_source(args.preference_dataset, args.preference_config, scratch)
    require_splits(sft_source, SFT_SPLITS, args.sft_dataset)
    require_splits(preference_source, PREFERENCE_SPLITS, args.preference_dataset)
    # Detail 1: Dataset specification
    # The preference validation split hides a few CNN/DM news comparisons (`article` instead of a
    # post): another query format and far longer queries, so they get their own split and lengths,
    # and the RM's generalisation to news is measured apart.
    validation, validation_cnndm = split_off_cnndm(preference_source["validation"], CNNDM_BATCHES)
    sft = datasets.DatasetDict({split: sft_source[split] for split in SFT_SPLITS})
    preference = datasets.DatasetDict(
        train=preference_source["train"], validation=validation, validation_cnndm=validation_cnndm)
    sft, preference, dropped = check_rows(args, sft, preference)  # bad rows fail here, in seconds, each named

    # ---- tokenize ----
    # Detail 5: Pre-tokenize; right-pad query+response, left-pad queries
    # Queries are left-padded (generation appends on the right, so every query must end in the
    # same column); query+response rows are right-padded (training reads left to right and finds
    # the EOS as the last non-pad id). Padded once here, every later batch is a plain stack. Each
    # query+response row is the reference's: `query.strip() + response` tokenized as one text, then
    # the EOS id (response_columns).
    common = dict(tokenizer=tokenizer, eos_text=eos_text, pad_id=pad_id)
    sft = map_splits(sft, process_sft_row, args.num_proc, "sft", lambda split: dict(
        **common, split=split, query_length=args.query_length, response_length=args.max_sft_response_length,
        query_response_length=args.max_sft_query_response_length))
    # CNN/DM rows get widths of their own: padding every TL;DR row to 2021 tokens would triple RM memory.
    tldr_lengths = dict(query_length=args.query_length, response_length=args.max_rm_response_length,
                        query_response_length=args.max_rm_query_response_length)
    cnndm_lengths = dict(query_length=args.cnndm_query_length, response_length=args.cnndm_max_rm_response_length,
                         query_response_length=args.cnndm_max_rm_query_response_length)
    preference = map_splits(preference, process_preference_row, args.num_proc, "preference", lambda split: dict(
        **common, split=split, cnndm=split == "validation_cnndm",
        **(cnndm_lengths if split == "validation_cnndm" else tldr_lengths)))
    if len(preference["validation_cnndm"]) == 0:  # map adds no column to an empty split: give it the schema
        preference["validation_cnndm"] = preference["validation"].select([])

    # ---- lengths: every padded width against the data's true maximum (Detail 4) ----
    checks = length_checks(args, sft, preference)
    report_lengths(checks, args.check_length_correctness)  # the table; a flag that would cut data fails here

    # ---- policy pairs ----
    # Detail 6: The preference validation split is out of distribution
    # Validation compares summaries of many more policies than train does (paper: 241 vs 47
    # pairs), so validation accuracy measures generalisation to unseen policies. Record how far
    # apart the splits are; downstream stages report accuracy per split / batch / confidence.
    pair_counts = policy_pair_counts(preference, tuple(preference))
    for split, counts in pair_counts.items():
        print(f"preference/{split}: {len(counts)} policy pairs, most frequent {list(counts.items())[:3]}")
    unseen = set(pair_counts["validation"]) - set(pair_counts["train"])
    print(f"{len(unseen)} of the {len(pair_counts['validation'])} validation policy pairs never occur in train")

    # ---- save: datasets with cards, visuals, counts, args; each replaces its old version in one step ----
    save_outputs(args, scratch, tokenizer, sft, preference, checks, pair_counts, dropped)
    if args.push_to_hub:  # opt-in: the only uploads of this script
        publish_datasets(args, sft, preference)


# ---- plumbing and fast paths: no Detail below ----
# Checks: the flags before anything is loaded, the source files and rows before any tokenization.


# (query budget, response width, query+response width) flags of each kind of row
LENGTH_FLAG_GROUPS = (("query_length", "max_sft_response_length", "max_sft_query_response_length"),
                      ("query_length", "max_rm_response_length", "max_rm_query_response_length"),
                      ("cnndm_query_length", "cnndm_max_rm_response_length", "cnndm_max_rm_query_response_length"))


def preprocess_flag_problems(args: Args) -> list:
    """What is wrong with the flags on their own (checked before anything is loaded or written); [] if nothing."""
    problems = []
    if args.num_proc is not None and args.num_proc < 1:
        problems.append(f"--num_proc {args.num_proc}: pass a number of worker processes >= 1 "
                        "(or leave the flag out: one per 1000 rows, at most one per CPU it may use)")
    lengths = {flag: getattr(args, flag) for group in LENGTH_FLAG_GROUPS for flag in group}
    problems += [f"--{flag} {value}: pass a positive number of tokens" for flag, value in lengths.items() if value < 1]
    for query, response, query_response in LENGTH_FLAG_GROUPS:
        # A row holds its stripped query (up to the budget) and a response (>= 1 id, the EOS), so a
        # width below the query budget or not above the response width can never hold the data.
        if lengths[query] > lengths[query_response]:
            problems.append(f"--{query} {lengths[query]} is larger than --{query_response} "
                            f"{lengths[query_response]}: a query of that length leaves no room for its response; "
                            f"raise --{query_response} or lower --{query}")
        if lengths[response] >= lengths[query_response]:
            problems.append(f"--{response} {lengths[response]} is not smaller than --{query_response} "
                            f"{lengths[query_response]}: every response comes after a query of at least one token; "
                            f"raise --{query_response} or lower --{response}")
    if args.output_dir is not None:  # None: the default
        problems += output_dir_problems(args.output_dir)
    return problems + push_problems(args)


def push_problems(args: Args) -> list[str]:
    """With --push_to_hub: what would stop the push at the end, after all the tokenizing; [] if nothing seen now."""
    if not args.push_to_hub:
        return []
    from huggingface_hub import constants, get_token  # imported here: only with --push_to_hub
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(f"{args.hf_entity or 'user'}/summarize_from_feedback_oai_preprocessing_0")
    except HFValidationError as error:
        return [f"--push_to_hub: --hf_entity {args.hf_entity!r} names no Hub user or organisation: {error}"]
    if constants.HF_HUB_OFFLINE:
        return ["--push_to_hub: HF_HUB_OFFLINE is set in this shell, so the push at the end would fail: unset it, "
                "or preprocess without --push_to_hub"]
    if get_token() is None:
        return ["--push_to_hub: no Hub token on this machine, so the push at the end would fail: log in first "
                "(`hf auth login`, or HF_TOKEN in the environment)"]
    return []


def output_dir_problems(output_dir: str) -> list[str]:
    """Why `output_dir` cannot take this script's outputs: not a folder name, inside a file, or another stage's
    folder (its args.json would be replaced); [] when it can."""
    if not output_dir:
        return [f"--output_dir {output_dir!r} is not a folder name: pass a new or existing folder"]
    folder = os.path.abspath(output_dir)
    while not os.path.exists(folder):  # the nearest part of the path that exists must be a folder
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return [f"--output_dir {output_dir}: {folder} is a file, not a folder: pass a new or existing folder"]
    saved = os.path.join(output_dir, "args.json")
    if os.path.isfile(saved):
        try:
            with open(saved) as file:
                ours = "preference_dataset" in json.load(file)
        except (OSError, ValueError):
            ours = False
        if not ours:
            return [f"--output_dir {output_dir} holds an args.json that this script did not write (a model's "
                    "folder?), which it would replace: pass a new folder, or the folder of an earlier preprocessing"]
    return []


def model_name(base_model: str) -> str:
    """The name of a base model in default paths: a Hub id as it is (org/name), a local model folder its own name."""
    # Every base model gets its own folders (data/{name}/tldr, models/{name}/sft_{seed}, ...), so a
    # 1B SFT model is never picked up by a 2.8B run; each stage records the name in its args.json.
    return os.path.basename(os.path.normpath(base_model)) if os.path.isdir(base_model) else base_model


def load_base_tokenizer(base_model: str):
    """AutoTokenizer of `base_model`; a SetupError naming --base_model when there is none."""
    try:
        return AutoTokenizer.from_pretrained(base_model)
    except (OSError, HFValidationError) as error:  # the latter: a path that is no folder and no Hub id
        raise SetupError(f"--base_model {base_model}: no tokenizer at {base_model}, and none of that name on the "
                         f"Hub (or the Hub cannot be reached): {error}") from error


def tokenizer_identity(tokenizer) -> str:
    """sha256 (hex) of the tokenizer's vocabulary, as sorted (token, id) pairs, and of its special tokens map."""
    # Two tokenizers with the same EOS and [PAD] ids may still map every other id to another token: a
    # model would then train on, or score, text it cannot read, silently. Every stage records this in
    # its args.json (taken after add_pad_token) and compares it across everything it loads.
    payload = json.dumps({"vocab": sorted(tokenizer.get_vocab().items()), "special_tokens": tokenizer.special_tokens_map},
                         sort_keys=True, default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def columns_problem(paths: list) -> Optional[str]:
    """Which parquet file of one dataset has other columns than the first (datasets' own error names neither)."""
    import pyarrow.parquet

    parquet = [path for path in paths if path.endswith(".parquet")]
    first = set(pyarrow.parquet.read_schema(parquet[0]).names) if parquet else set()
    for path in parquet[1:]:
        columns = set(pyarrow.parquet.read_schema(path).names)
        if columns != first:
            return (f"{parquet[0]} and {path} hold different columns: only the first has {sorted(first - columns)}, "
                    f"only the second {sorted(columns - first)}; every file of a dataset must hold the same columns")
    return None


def data_file_problem(path: str) -> Optional[str]:
    """Why the local data file `path` cannot be read (empty, not UTF-8, invalid JSON), naming the line; None if ok."""
    if os.path.getsize(path) == 0:
        return f"{path}: the file is empty"
    if not path.endswith((".json", ".jsonl")):
        return None  # parquet and other formats: their loader's error names the file (see load_source)
    with open(path, "rb") as file:
        data = file.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        return f"{path}, line {line}: byte {data[error.start]:#04x} is not UTF-8; re-encode the file as UTF-8"
    lines = text.split("\n")
    first = next((line for line in lines if line.strip()), None)
    if first is None:
        return f"{path}: the file holds only whitespace, no JSON"
    try:  # `datasets` reads one JSON object per line, or else one JSON document
        json.loads(first)
    except json.JSONDecodeError:
        try:
            json.loads(text)
        except json.JSONDecodeError as error:
            return f"{path}, line {error.lineno}: invalid JSON ({error.msg}); expected one JSON document"
        return None
    for number, line in enumerate(lines, 1):
        try:
            if line.strip():
                json.loads(line)
        except json.JSONDecodeError as error:
            return f"{path}, line {number}: invalid JSON ({error.msg}); expected one JSON object per line"
    return None


# The Hub keeps openai/summarize_from_feedback as a loading script (summarize_from_feedback.py), which datasets
# no longer runs ("Dataset scripts are no longer supported"). The Hub's own parquet export of such a repo, on its
# branch refs/convert/parquet with one folder per config, holds the same rows and features.
PARQUET_EXPORT = "refs/convert/parquet"


def load_source(path: str, config: Optional[str], scratch_dir: str):
    """`datasets.load_dataset(path, config)`; a local folder (laid out like a Hub repo) is checked file by file
    and cached in `scratch_dir`; a Hub id that is a loading script is read from its parquet export."""
    local = os.path.isdir(path)
    try:
        options = {"name": config}
        if local and config and os.path.isdir(os.path.join(path, config)) \
                and config not in datasets.get_dataset_config_names(path):
            options = {"data_dir": config}  # a download of such an export: a folder per config, no card naming it
        if local:  # datasets' own errors name neither the file nor the line: check each data file first
            builder = datasets.load_dataset_builder(path, **options, cache_dir=scratch_dir)
            for files in builder.config.data_files.values():
                problems = [problem for file in files if (problem := data_file_problem(file))]
                if problems:
                    raise DataError("; ".join(problems))
            problem = columns_problem([file for files in builder.config.data_files.values() for file in files])
            if problem:
                raise DataError(problem)
        # datasets caches a local folder under its name and config, not its content: a folder written
        # again in place would be served stale from ~/.cache, features included. So a local folder
        # gets a fresh cache of its own; a Hub id is cached by its commit and is safe.
        try:
            return datasets.load_dataset(path, **options, cache_dir=scratch_dir if local else None)
        except RuntimeError as error:
            if local or "Dataset scripts are no longer supported" not in str(error):
                raise
        print(f"{path} is a loading script, which datasets {datasets.__version__} does not run: reading the Hub's "
              f"parquet export of it instead (revision {PARQUET_EXPORT}, folder {config or 'default'})")
        return datasets.load_dataset(path, revision=PARQUET_EXPORT, data_dir=config or "default")
    except DataError:
        raise
    except Exception as error:  # a Hub id offline, a corrupt parquet file, a folder with no data files
        hint = (" (a loading script: give a folder of its parquet files instead, one folder per config as the "
                "Hub's refs/convert/parquet export lays them out)" if "Dataset scripts" in str(error) else "")
        raise DataError(f"cannot load {path} (config {config}): {type(error).__name__}: {error}{hint}; check "
                        "--sft_dataset / --preference_dataset / --preference_config") from error


def require_splits(dataset_dict, splits: tuple, source: str) -> None:
    """Raise DataError naming the missing or empty splits and the splits that exist."""
    missing = [split for split in splits if split not in dataset_dict]
    if missing:
        raise DataError(f"{source}: missing split(s) {missing}; it has splits {sorted(dataset_dict)}")
    empty = [split for split in splits if len(dataset_dict[split]) == 0]
    if empty:
        raise DataError(f"{source}: split(s) {empty} have no rows; every split in {list(splits)} needs rows")


def check_rows(args: Args, sft, preference) -> tuple:
    """(sft, preference, dropped): raise DataError listing every bad row (its split, row and id) and every repeat of
    an SFT post id; with --drop_bad_rows, return the datasets without them and what was dropped, and why."""
    require_splits(preference, PREFERENCE_SPLITS, f"{args.preference_dataset} without its CNN/DM rows")
    if len(preference["validation_cnndm"]) == 0:
        print(f"{args.preference_dataset}: no CNN/DM comparisons (batches {', '.join(CNNDM_BATCHES)}) in "
              "validation, so validation_cnndm is empty and the cnndm_* length flags are not checked")
    # A row is named by its split here and its index there (validation_cnndm: the source validation's CNN/DM rows).
    sft_bad = [dict(source=args.sft_dataset, split=split, row=i, id=row_id, problem=problem)
               for split, dataset in sft.items() for i, row_id, problem in bad_rows(as_rows(dataset), split, "sft")]
    preference_bad = [dict(source=args.preference_dataset, split=split, row=i, id=row_id, problem=problem)
                      for split, dataset in preference.items()
                      for i, row_id, problem in bad_rows(as_rows(dataset), split,
                                                         "cnndm" if split == "validation_cnndm" else "tldr")]
    # A post id twice in the SFT data is a post trained on twice or tested on after training. (In the
    # preference data it is normal: one post, several comparisons.)
    # Among the rows kept: a bad first copy goes anyway, so a good second one is no repeat (and no row is listed twice).
    ids = {split: dataset["id"][:] for split, dataset in sft.items()}
    bad_at = frozenset((row["split"], row["row"]) for row in sft_bad)
    repeats = [dict(source=args.sft_dataset, split=split, row=i, id=row_id,
                    problem=f"post id {row_id!r} is already in split '{first_split}' row {first_row}")
               for split, i, row_id, first_split, first_row in duplicate_rows(ids, bad_at)]
    dropped = sft_bad + preference_bad + repeats
    for source, dataset_dict, bad in ((args.sft_dataset, sft, sft_bad), (args.preference_dataset, preference, preference_bad)):
        for split, dataset in dataset_dict.items():  # every row with one problem: a column, not rows, to fix
            problems = {row["problem"] for row in bad if row["split"] == split}
            if len(dataset) > 1 and len(problems) == 1 and sum(row["split"] == split for row in bad) == len(dataset):
                raise DataError(f"{source}: every row of split '{split}' ({len(dataset)} rows): {problems.pop()}; "
                                "the source lacks that column or holds another schema: fix the source")
    if dropped and not args.drop_bad_rows:
        bad = sft_bad + preference_bad
        lines = [bad_row_message(row["split"], row["row"], row["id"], row["problem"]) for row in bad[:10]]
        lines += ["..."] if len(bad) > 10 else []
        if repeats:
            lines.append(f"{args.sft_dataset}: {duplicate_id_problem(ids, bad_at)}")
        raise DataError(f"{len(dropped)} row(s) this script cannot use:\n  " + "\n  ".join(lines)
                        + "\nfix the source, or pass --drop_bad_rows to leave them out (each is then listed "
                        f"with its reason in {args.output_dir}/dropped_rows.json)")
    if dropped:  # how many of each split: a split left empty (all of CNN/DM, say) must not pass unseen
        lost = []
        for name, dataset_dict, bad in (("sft", sft, sft_bad + repeats), ("preference", preference, preference_bad)):
            for split, dataset in dataset_dict.items():
                n = sum(row["split"] == split for row in bad)
                if n:
                    lost.append(f"{name}/{split} {n} of {len(dataset)}" + (" (all: the split is empty now)"
                                                                           if n == len(dataset) else ""))
        sft, preference = without_rows(sft, sft_bad + repeats), without_rows(preference, preference_bad)
        print(f"--drop_bad_rows: left out {len(dropped)} row(s) ({', '.join(lost)}), listed with their reasons in "
              "dropped_rows.json")
        require_splits(sft, SFT_SPLITS, f"{args.sft_dataset} without the dropped rows")
        require_splits(preference, PREFERENCE_SPLITS, f"{args.preference_dataset} without the dropped rows")
    print(f"rows: sft {dict(sft.num_rows)}, preference {dict(preference.num_rows)}")
    return sft, preference, dropped


def without_rows(dataset_dict, dropped: list):
    """`dataset_dict` less the rows `dropped` names ({"split", "row"} each)."""
    gone = {(row["split"], row["row"]) for row in dropped}
    return datasets.DatasetDict({split: dataset.select([i for i in range(len(dataset)) if (split, i) not in gone])
                                 for split, dataset in dataset_dict.items()})


def row_problem(row: dict, kind: str) -> Optional[str]:
    """What a source row lacks to be processed as `kind` ('sft', 'tldr' or 'cnndm'), None if nothing."""
    if kind == "sft":
        fields, prefix, needed = row, "", ("id", "subreddit", "title", "post", "summary")
    else:
        fields, prefix = row.get("info"), "info."
        needed = ("article",) if kind == "cnndm" else ("subreddit", "title", "post")
        if not isinstance(fields, dict):
            return f"expected `info` to be a dict, got {fields!r:.80}"
        summaries = row.get("summaries")
        if not isinstance(summaries, list) or len(summaries) != 2:
            return f"expected `summaries` to be a list of 2 summaries, got {summaries!r:.80}"
        for i, summary in enumerate(summaries):
            text, policy = (summary.get("text"), summary.get("policy")) if isinstance(summary, dict) else (None, None)
            # Responses are built as text + EOS only, so a TL;DR text must bring its own leading space (it was
            # written after "TL;DR:"). A CNN/DM text was written after "TL;DR:\n" and has none (OpenAI's format).
            if not isinstance(text, str) or (kind == "tldr" and not text.startswith(" ")):
                wanted = "a string starting with a space" if kind == "tldr" else "a string"
                return f"expected summaries[{i}].text to be {wanted}, got {text!r:.80}"
            if not text.strip():  # the response would be spaces and the EOS
                return f"expected summaries[{i}].text to hold a summary, not only spaces, got {text!r:.80}"
            if not isinstance(policy, str):
                return f"expected summaries[{i}].policy to be a string, got {policy!r:.80}"
        choice = row.get("choice")
        if isinstance(choice, bool) or not isinstance(choice, int) or choice not in (0, 1):  # 1.0 would index a list
            return f"expected `choice` to be the integer 0 or 1, got {choice!r:.80}"
        if not isinstance(row.get("batch"), str):
            return f"expected `batch` to be a string, got {row.get('batch')!r:.80}"
    for name in needed:
        if not isinstance(fields.get(name), str):
            return f"expected {prefix}{name} to be a string, got {fields.get(name)!r:.80}"
    # An empty body would make a query with nothing to summarize, an empty summary a response that is
    # a lone space and the EOS: refuse both rather than train on them.
    for name in ("article",) if kind == "cnndm" else ("post", "summary") if kind == "sft" else ("post",):
        if not fields[name].strip():
            return f"expected a non-empty {prefix}{name}, got {fields[name]!r:.80}"
    return None


def bad_rows(rows, split: str, kind: str) -> list:
    """[(row index, row id or None, problem)] of every row `row_problem` rejects, in order."""
    found = []
    for i, row in enumerate(rows):
        problem = row_problem(row, kind)
        if problem is not None:  # SFT rows have an `id`, preference rows an `info.id`
            found.append((i, row["info"].get("id") if isinstance(row.get("info"), dict) else row.get("id"), problem))
    return found


def bad_row_message(split: str, row: int, row_id, problem: str) -> str:
    named = "no id" if row_id is None else f"id {row_id!r}"  # a preference row whose `info` is broken has none
    return f"split '{split}', row {row} ({named}): {problem}"


def duplicate_rows(ids_by_split: dict, skip: frozenset = frozenset()) -> list:
    """[(split, row, id, split of its first row, first row)] of every repeat of an id in `ids_by_split` ({split:
    [id per row]}), the splits in their order: the first occurrence is not a repeat. Rows in `skip` ({(split,
    row)}: rows dropped anyway) are neither repeats nor first occurrences."""
    seen, repeats = {}, []
    for split, ids in ids_by_split.items():
        for i, row_id in enumerate(ids):
            if (split, i) in skip:
                continue
            if row_id in seen:
                repeats.append((split, i, row_id, *seen[row_id]))
            else:
                seen[row_id] = (split, i)
    return repeats


def duplicate_id_problem(ids_by_split: dict, skip: frozenset = frozenset()) -> Optional[str]:
    """Which ids occur twice across `ids_by_split` ({split: [id per row]}) but in rows of `skip`, with where; None
    if all differ."""
    duplicates = [f"id {row_id!r} in split '{first_split}' row {first_row} and split '{split}' row {i}"
                  for split, i, row_id, first_split, first_row in duplicate_rows(ids_by_split, skip)]
    if not duplicates:
        return None
    # One post twice would be trained on twice, or trained on and then tested on.
    return (f"{len(duplicates)} duplicate post id(s): {'; '.join(duplicates[:5])}"
            f"{' ...' if len(duplicates) > 5 else ''}; remove the repeated rows from the source")


def report_lengths(checks: list, check_length_correctness: bool) -> None:
    """Print each length flag against the data's maximum; raise DataError if one cuts data (or, checked, differs)."""
    # A table to copy flag values from when the tokenizer or the data change.
    print(f"{'length flag':<36}{'configured':>11}{'computed':>10}  longest in")
    for flag, configured, maxima, _ in checks:
        where, computed = max(maxima.items(), key=lambda item: item[1]) if maxima else ("-", "-")
        print(f"{flag:<36}{configured:>11}{computed:>10}  {where}")
    problems = [problem for flag, configured, maxima, exact in checks
                if (problem := length_problem(flag, configured, maxima, exact and check_length_correctness))]
    if problems:
        raise DataError("length flags do not match the data:\n  " + "\n  ".join(problems))
# Fast paths: the query truncation, datasets read in one batch, `map` in worker processes.


def truncation_cuts(text: str, separator: str = "\n") -> list:
    """Lengths of the prefixes that repeating `truncate_last_paragraph` visits, `text` first, "" last."""
    cuts, cut = [len(text)], text.rfind(separator)
    while cut != -1:  # before each separator, from the last one back
        cuts.append(cut)
        cut = text.rfind(separator, 0, cut)
    return cuts + list(range(cuts[-1] - 1, -1, -1))  # no separator left: one character at a time


# Cutting a text re-tokenizes its kept end (the last word, the junction with the template), which may
# then take a few ids fewer than it did inside the longer text. The skip in tokenize_query assumes
# never more than this many (a BPE word's ids differ from its prefix's near the cut only: 0-3 on the
# random posts of the tests, which compare the result with the reference's loop).
RETOKENIZE_SLACK = 32


def tokenize_query(tokenizer, format_str: str, fields: dict, truncate_field: str, length: int, where: str) -> list:
    """== the ids of `format_str` filled with `fields` after the reference loop `while too long: field =
    truncate_last_paragraph(field)` on `truncate_field`, re-tokenizing only the prefixes that the byte count below
    cannot rule out."""
    text = fields[truncate_field]
    # Tokenizing every prefix the loop visits would take minutes on a 20k-character post, so:
    cuts = truncation_cuts(text)  # candidate lengths, longest first; the answer is the first that fits
    # A tokenizer that normalizes (Pythia's: NFC) may spell a character in more bytes than the text does
    # (U+0958: 3 -> 6); the character's full compatibility decomposition (NFKD) bounds every such form.
    widths = (max(len(char.encode()), len(unicodedata.normalize("NFKD", char).encode())) for char in text)
    # [i]: at least the bytes of text[:i] as tokenized. ASCII text (most posts) has one byte a character in every
    # form, so there the list is range(len(text) + 1), without a pass over the characters (a third of the time).
    bytes_before = range(len(text) + 1) if text.isascii() else list(accumulate(widths, initial=0))
    i = 0
    while True:
        ids = encode_text(tokenizer, format_str.format(**{**fields, truncate_field: text[:cuts[i]]}))
        excess = len(ids) - length
        if excess <= 0:
            return ids
        if i == len(cuts) - 1:
            raise DataError(f"{where}: the query has {len(ids)} > {length} tokens even with an empty {truncate_field}")
        # Every id holds >= 1 byte, so a prefix b bytes shorter has at least len(ids) - b - slack ids:
        # while b < excess - slack it is still too long, and the loop would only have passed it by.
        j = i + 1
        while j < len(cuts) - 1 and bytes_before[cuts[i]] - bytes_before[cuts[j]] < excess - RETOKENIZE_SLACK:
            j += 1
        i = j


@functools.lru_cache(maxsize=4)
def recent_encodings(tokenizer, text: str) -> tuple:
    """tuple(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)), remembered for the
    last few texts: a row's prompt is the query text it just tokenized, so it is not tokenized twice."""
    return tuple(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


# Reading a Dataset: iterating one (or one of its columns, `dataset["x"]`) formats its rows one at a time, ~25 us each
# (0.4 s for one column of 16k rows); `dataset["x"][:]`, written wherever this script reads a whole column, equals
# `list(dataset["x"])` and formats the column in one batch (4 ms).
def as_rows(dataset) -> list:
    """== list(dataset): every row as a dict, the columns formatted in one batch (`dataset[:]`), not row by row."""
    columns = dataset[:]
    return [dict(zip(columns, values)) for values in zip(*columns.values())]


# A `map` worker process costs ~0.2-0.4 s to start (datasets forks a pool and a manager process, even for num_proc=1),
# the work of ~300 rows here: a small split is mapped faster in this process.
MAP_ROWS_PER_PROCESS = 1000


def map_processes(num_proc: Optional[int], rows: int) -> Optional[int]:
    """`map`'s num_proc for a split of `rows` rows: --num_proc if given, else one per MAP_ROWS_PER_PROCESS rows up to
    usable_cpus(), and None (no worker) where that is fewer than 2."""
    if num_proc is not None:
        return num_proc
    processes = min(usable_cpus() or 1, rows // MAP_ROWS_PER_PROCESS)
    return processes if processes >= 2 else None


def usable_cpus() -> Optional[int]:
    """The CPUs this process may run on: its affinity (a SLURM task's allocation: os.cpu_count() counts the whole
    node, and 116 workers on a node of 224 threads would share a 16-CPU task), else os.cpu_count()."""
    if hasattr(os, "sched_getaffinity"):  # Linux
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def map_splits(dataset_dict, function, num_proc: Optional[int], name: str, kwargs) -> datasets.DatasetDict:
    """== {split: dataset.map(function, fn_kwargs=kwargs(split))}, in worker processes where a split is large enough.

    `function` still sees one row at a time, but map hands over batches of rows (row_by_row): it formats a batch at
    once, 2.2 instead of 2.7 ms a preference row on CI's slower CPU, and the same table, column for column."""
    # map pickles the function and its fn_kwargs (the tokenizer included) into each worker process.
    return datasets.DatasetDict({split: dataset.map(
        row_by_row, batched=True, num_proc=map_processes(num_proc, len(dataset)), desc=f"{name}/{split}",
        fn_kwargs={"function": function, **kwargs(split)},
    ) for split, dataset in dataset_dict.items()})


def row_by_row(batch: dict, function, **kwargs) -> dict:
    """== {column: [function(row, **kwargs)[column] for row in the batch's rows]}: a row function as map's batched=True
    calls it (`batch`: {column: values})."""
    results = [function(dict(zip(batch, values)), **kwargs) for values in zip(*batch.values())]
    return {column: [result[column] for result in results] for column in results[0]} if results else {}
# Outputs: dataset cards, visuals, the files moved into place, the Hub.


def save_outputs(args: Args, scratch: str, tokenizer, sft, preference, checks: list, pair_counts: dict,
                 dropped: list) -> None:
    """Write the datasets with their cards, the visuals, policy_pairs.json, dropped_rows.json and args.json into the
    scratch, then move each into `args.output_dir`, replacing its old version in one step (args.json, the run's
    record, last)."""
    new = os.path.join(scratch, "new")  # every output is written here, then moved into place
    tldr = datasets.concatenate_datasets([preference[split] for split in PREFERENCE_SPLITS])
    pair = ("chosen", "rejected")
    visuals = plot_visuals(
        [("SFT reference response", {s: d["reference_response_token_len"][:] for s, d in sft.items()},
          args.max_sft_response_length),
         ("TL;DR preference response", {c: tldr[f"{c}_token_len"][:] for c in pair}, args.max_rm_response_length),
         ("SFT query + reference response", {s: d["query_reference_response_token_len"][:] for s, d in sft.items()},
          args.max_sft_query_response_length),
         ("TL;DR preference query + response", {c: tldr[f"query_{c}_token_len"][:] for c in pair},
          args.max_rm_query_response_length)],
        # `extra.confidence` is None where the labeler gave none (most of train)
        {split: Counter(str((extra or {}).get("confidence")) for extra in dataset["extra"][:])
         for split, dataset in preference.items()},
        {split: pair_counts[split] for split in PREFERENCE_SPLITS},
        os.path.join(new, "visuals"))

    commit = git_commit(os.path.dirname(os.path.abspath(__file__)))
    outputs = {"sft": (sft, args.sft_dataset, SFT_DESCRIPTIONS),
               "preference": (preference, args.preference_dataset, PREFERENCE_DESCRIPTIONS)}
    for name, (dataset_dict, source, descriptions) in outputs.items():
        # Arrow shards that load_from_disk memory-maps: later stages open 100k+ rows in a second.
        # An empty split (validation_cnndm without CNN/DM rows) needs its one shard asked for: datasets
        # would write none and then fail to load the split.
        dataset_dict.save_to_disk(os.path.join(new, name),
                                  num_shards={split: 1 for split, dataset in dataset_dict.items() if not len(dataset)})
        # The card sits beside the saved splits: load_from_disk ignores it, a Hub repo shows it.
        intro = (f"Built from `{source}` by preprocess_tldr.py (commit {commit}) with the tokenizer of "
                 f"`{args.base_model}` (eos id {tokenizer.eos_token_id}, pad id {tokenizer.pad_token_id}); "
                 + ", ".join(f"{flag} {configured}" for flag, configured, _, _ in checks) + ".")
        with open(os.path.join(new, name, "README.md"), "w") as file:
            file.write(dataset_card(f"TL;DR {name} dataset, pre-tokenized", intro, dataset_dict, descriptions))
    with open(os.path.join(new, "policy_pairs.json"), "w") as file:
        json.dump(pair_counts, file, indent=2)
    with open(os.path.join(new, "dropped_rows.json"), "w") as file:  # [] unless --drop_bad_rows left rows out
        json.dump(dropped, file, indent=2, default=str)
    # The ids let later stages check that their tokenizer matches the one behind the token columns.
    with open(os.path.join(new, "args.json"), "w") as file:
        json.dump({**asdict(args), "base_model_name": model_name(args.base_model),
                   "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
                   "tokenizer_identity": tokenizer_identity(tokenizer),
                   "git_commit": commit}, file, indent=2)
    # A failed run never reaches this point, so it leaves the old outputs as they were. Ctrl-C waits until the
    # moves are done: the outputs are then all old or all new (a kill can still land between two of them).
    CTRL_C["held"] = True
    try:
        for name in ("sft", "preference", "visuals", "policy_pairs.json", "dropped_rows.json", "args.json"):
            install_output(scratch, args.output_dir, name)
    finally:
        CTRL_C["held"] = False
    if CTRL_C["pressed"]:
        raise KeyboardInterrupt
    print(f"saved {args.output_dir}/sft, {args.output_dir}/preference, args.json, policy_pairs.json, "
          "dropped_rows.json, "
          f"{[os.path.join(args.output_dir, 'visuals', os.path.basename(path)) for path in visuals]}")


def publish_datasets(args: Args, sft, preference) -> None:
    """Publish both datasets, their cards and the visuals on the Hub under --hf_entity (or the logged-in user)."""
    import huggingface_hub  # imported here: without --push_to_hub nothing touches the network

    try:
        entity = args.hf_entity or huggingface_hub.whoami()["name"]
    except Exception as error:  # a token the Hub refuses: the outputs are saved, nothing is pushed
        raise SetupError(f"--push_to_hub: the Hub does not say who is logged in ({type(error).__name__}: {error}); "
                         f"the outputs are saved in {args.output_dir}, nothing was pushed: log in again "
                         "(`hf auth login`) and rerun with --push_to_hub, or pass --hf_entity") from error
    timestamp = int(time.time())
    repos = {"sft": f"{entity}/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_{timestamp}",
             "preference": f"{entity}/summarize_from_feedback_oai_preprocessing_{timestamp}"}
    for dataset_dict, (name, repo_id) in zip((sft, preference), repos.items()):
        dataset_dict.push_to_hub(repo_id)
        # Our card replaces the one push_to_hub wrote; the Hub still finds the parquet files.
        huggingface_hub.upload_file(path_or_fileobj=os.path.join(args.output_dir, name, "README.md"),
                                    path_in_repo="README.md", repo_id=repo_id, repo_type="dataset")
        print(f"pushed https://huggingface.co/datasets/{repo_id}")
    huggingface_hub.upload_folder(folder_path=os.path.join(args.output_dir, "visuals"), path_in_repo="visuals",
                                  repo_id=repos["preference"], repo_type="dataset")


def response_descriptions(name: str, what: str, flag: str) -> dict:
    """One-line card descriptions of the seven columns `response_columns` makes for `name`."""
    return {
        name: f"{what}: text (TL;DR: with a leading space) and the EOS text at the end",
        f"{name}_token": f"ids of the text (a special-token string typed in it stays text) + the EOS id, "
                         f"RIGHT-padded with [PAD] to {flag}_response_length",
        f"{name}_token_len": f"number of ids of `{name}` (EOS included, pads excluded)",
        f"query_{name}": f"`query` stripped of surrounding whitespace + `{name}`",
        f"query_{name}_token": f"`query_{name}` re-tokenized as one text + the EOS id, RIGHT-padded to "
                               f"{flag}_query_response_length",
        f"query_{name}_token_len": f"number of non-pad ids in `query_{name}_token`",
        f"query_{name}_token_response_label": f"`query_{name}_token` with the ids of the stripped query set to "
                                              "[PAD] (loss labels)",
    }


# Card descriptions; "(source)" marks a column copied unchanged from the source dataset.
QUERY_DESCRIPTIONS = {
    "query": "the query text: decoded `query_token` without pads (the post may be truncated)",
    "query_token": "query ids, LEFT-padded with [PAD] to the query length (ready for generation)",
    "query_token_len": "number of non-pad ids in `query_token`",
}


SFT_DESCRIPTIONS = {
    "id": "Reddit post id (source)",
    "subreddit": "subreddit name without r/ (source)",
    "title": "post title (source)",
    "post": "post body, untruncated (source)",
    "summary": "human-written TL;DR of the post, no leading space (source)",
    **QUERY_DESCRIPTIONS,
    **response_descriptions("reference_response", "`summary` as a response", "max_sft"),
}


PREFERENCE_DESCRIPTIONS = {
    "info": "the summarized item: id, post, title, subreddit, site (TL;DR) or article (CNN/DM) (source)",
    "summaries": "the two compared summaries: text (TL;DR: leading space; CNN/DM: none), policy, note (source)",
    "choice": "index (0 or 1) of the summary the labeler preferred (source)",
    "worker": "labeler id (source)",
    "batch": "labeling batch name; CNN/DM batches form `validation_cnndm` (source)",
    "split": "OpenAI's split tag of the comparison (source)",
    "extra": "labeler confidence, 1-9, when recorded (source)",
    **QUERY_DESCRIPTIONS,
    "chosen_policy": "policy that sampled the chosen summary",
    "rejected_policy": "policy that sampled the rejected summary",
    "policies": "the two policy names, sorted and joined with `--`",
    **response_descriptions("chosen", "the preferred summary", "(cnndm_)max_rm"),
    **response_descriptions("rejected", "the other summary", "(cnndm_)max_rm"),
}


def dataset_card(title: str, intro: str, dataset_dict, descriptions: dict) -> str:
    """A markdown card: intro, rows per split and a one-line description of every column."""
    lines = [f"# {title}", "", intro, "", "| split | rows |", "|---|---|"]
    lines += [f"| {split} | {len(dataset)} |" for split, dataset in dataset_dict.items()]
    lines += ["", "| column | description |", "|---|---|"]
    lines += [f"| `{column}` | {descriptions.get(column, 'column of the source dataset, unchanged')} |"
              for column in next(iter(dataset_dict.values())).column_names]
    return "\n".join(lines) + "\n"


def git_commit(folder: str) -> Optional[str]:
    """The git commit checked out in `folder`, None outside a git checkout."""
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True)
    except OSError:
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def plot_visuals(length_panels: list, confidences: dict, pair_counts: dict, folder: str) -> list:
    """Save token_len.png (4 panels of (title, {label: lengths}, flag)), confidence.png ({split: Counter})
    and policies.png ({split: {pair: count}}) into `folder`; return their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (title, series, flag) in zip(axes.flat, length_panels):
        for label, lengths in series.items():  # one bin per token count, up to the flag or the longest
            # One filled outline per series: drawn as a bar per bin (up to ~260 here), the four panels took ~4 s.
            ax.hist(lengths, bins=range(0, max([flag, *lengths]) + 2), alpha=0.5, label=label, histtype="stepfilled")
        ax.axvline(flag, color="black", linestyle="--", label=f"flag {flag}")
        ax.set(title=title, xlabel="tokens", ylabel="rows")
        ax.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(folder, "token_len.png"))

    keys = sorted(set().union(*confidences.values()))
    figure, ax = plt.subplots(figsize=(10, 4))
    for offset, (split, counts) in enumerate(confidences.items()):
        ax.bar([k + offset / 4 for k in range(len(keys))], [counts[k] for k in keys], width=0.25, label=split)
    ax.set_xticks(range(len(keys)), keys)
    ax.set(title="comparisons per labeler confidence", xlabel="confidence", ylabel="rows", yscale="log")
    ax.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(folder, "confidence.png"))

    tallest = max(len(counts) for counts in pair_counts.values())  # 241 pairs in validation: a tall figure
    figure, axes = plt.subplots(1, len(pair_counts), figsize=(8 * len(pair_counts), 2 + 0.16 * tallest))
    for ax, (split, counts) in zip(axes, pair_counts.items()):
        ax.barh(list(counts)[::-1], list(counts.values())[::-1])
        ax.set(title=f"{split}: {len(counts)} policy pairs", xlabel="comparisons")
        ax.tick_params(axis="y", labelsize=6)
    figure.tight_layout()
    figure.savefig(os.path.join(folder, "policies.png"))
    plt.close("all")
    return [os.path.join(folder, name) for name in ("token_len.png", "confidence.png", "policies.png")]
# A scratch folder that a watcher process removes however the run ends; outputs swapped in one step.


SCRATCH_PREFIX = ".preprocess_tldr-scratch-"


# The watcher: a bare interpreter (not a fork of this 340 MB process) that waits until this run and
# every process it forked (the `map` workers) have exited, however (SIGKILL and the OOM killer
# included), then puts back an output that a half-done swap had moved aside, deletes the scratch,
# and removes the folders the run made if they stayed empty. It ignores Ctrl-C, SIGTERM and SIGHUP
# (what `scancel` or a closed terminal send to every process): those stop the run, not the clean-up.
SCRATCH_WATCHER = """
import os, shutil, signal, sys
for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(number, signal.SIG_IGN)
sys.stdin.buffer.read()  # returns at end of file: every holder of the pipe's other end has exited
scratch, made = sys.argv[1], sys.argv[2:]
old = os.path.join(scratch, "old")
for name in os.listdir(old) if os.path.isdir(old) else []:
    target = os.path.join(os.path.dirname(scratch), name)
    if not os.path.lexists(target):  # killed between the two renames of a swap: the old output goes back
        os.rename(os.path.join(old, name), target)
shutil.rmtree(scratch, ignore_errors=True)
for folder in made:  # deepest first; a folder that holds anything stays
    try:
        os.rmdir(folder)
    except OSError:
        pass
"""


def start_scratch(output_dir: str) -> str:
    """Make `output_dir` and in it an empty scratch folder (with new/ for the outputs to be); return its path.

    A watcher process deletes the scratch, and the folders made here if left empty, once this run has ended."""
    made, folder = [], os.path.abspath(output_dir)
    while not os.path.isdir(folder):  # the folders this run creates, deepest first
        made.append(folder)
        folder = os.path.dirname(folder)
    scratch = os.path.join(os.path.abspath(output_dir), f"{SCRATCH_PREFIX}{socket.gethostname()}-{os.getpid()}")
    # The watcher starts before anything is written: from here on, however the run ends, it cleans up.
    watcher = subprocess.Popen([sys.executable, "-I", "-S", "-c", SCRATCH_WATCHER, scratch, *made],
                               stdin=subprocess.PIPE)
    atexit.register(stop_watcher, watcher)
    kill_forks_with_their_parent()
    os.makedirs(os.path.join(scratch, "new"))
    remove_stale_scratch(output_dir)
    return scratch


def kill_forks_with_their_parent() -> None:
    """Every process forked from here on dies when the process that forked it does, however that one ends.

    datasets' `map` workers (a pool and a manager process, even for num_proc=1) would outlive a SIGKILLed
    run, blocked forever, holding the watcher's pipe and the scratch: the kernel kills them with it (Linux
    PR_SET_PDEATHSIG = 1; prctl is looked up here, not in the child). A parent that dies between the fork
    and the child's prctl sends no signal; the child sees that it was orphaned and kills itself."""
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is None:
        return
    parent = [os.getpid()]  # set in the parent just before each fork; the child reads its copy

    def in_child():
        prctl(1, signal.SIGKILL)
        if os.getppid() != parent[0]:  # already orphaned: the parent died before the line above
            os.kill(os.getpid(), signal.SIGKILL)

    os.register_at_fork(before=lambda: parent.__setitem__(0, os.getpid()), after_in_child=in_child)


def stop_watcher(watcher: subprocess.Popen) -> None:
    """Let the watcher clean up now and wait for it (at exit: after success, an exception or Ctrl-C)."""
    watcher.stdin.close()
    try:
        watcher.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass  # a leftover worker still holds the pipe: the watcher cleans up once it is gone


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (it may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_scratch(output_dir: str) -> None:
    """Clean up the scratch folders of earlier runs on this host whose watcher was killed with them."""
    mine = f"{SCRATCH_PREFIX}{socket.gethostname()}-"
    for name in sorted(os.listdir(output_dir)):
        pid = name[len(mine):]
        if name.startswith(mine) and pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            subprocess.run([sys.executable, "-I", "-S", "-c", SCRATCH_WATCHER, os.path.join(output_dir, name)],
                           stdin=subprocess.DEVNULL, check=False)
            print(f"removed {os.path.join(output_dir, name)}, the scratch of an interrupted run")


def exchange_paths(first: str, second: str) -> bool:
    """Swap two existing paths in one system call (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2  # from <fcntl.h> and <linux/fs.h>
    if renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a kernel or file system without the flag
        return False
    raise OSError(code, os.strerror(code), first, None, second)


def install_output(scratch: str, output_dir: str, name: str) -> None:
    """Move `scratch`/new/`name` (a file or folder) to `output_dir`/`name`, replacing the old one in one step."""
    staged, target = os.path.join(scratch, "new", name), os.path.join(output_dir, name)
    # A rename is atomic: a reader (or a rerun killed at any moment) finds the old or the new version.
    if not (os.path.isdir(staged) and os.path.isdir(target)):
        os.replace(staged, target)  # a file, or a folder where there was none
    elif not exchange_paths(staged, target):  # a folder cannot be renamed onto a folder: swap the two
        # No atomic swap here (not Linux, or e.g. NFS): two renames. Killed between them, the run
        # leaves the old folder in scratch/old, and the watcher (or the next run) moves it back.
        old = os.path.join(scratch, "old", name)
        os.makedirs(os.path.dirname(old), exist_ok=True)
        os.rename(target, old)
        os.rename(staged, target)


# Ctrl-C (on_ctrl_c): the main process's, held while the outputs move into place.
CTRL_C = {"main_pid": None, "pressed": False, "held": False}


def on_ctrl_c(signum, frame) -> None:
    """SIGINT: a KeyboardInterrupt in the main process (once the outputs have moved, if they are moving); nothing in
    `map`'s workers.

    A terminal's Ctrl-C reaches every process of the run, the workers too; a worker stopped mid-row dies, and its
    pool then waits for it, hanging or ending in a TimeoutError. Forked, they keep this handler and ignore the
    signal; the pool stops them as it unwinds."""
    if os.getpid() != CTRL_C["main_pid"]:
        return
    CTRL_C["pressed"] = True
    if not CTRL_C["held"]:
        raise KeyboardInterrupt


if __name__ == "__main__":
    CTRL_C["main_pid"] = os.getpid()
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not in a job started with it ignored
        signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        main()  # here, at the end, so that every helper below the fence is defined when it runs
    except (SetupError, DataError) as error:  # the message, not a traceback, says what to fix
        sys.exit(f"{type(error).__name__}: {error}")
    except BaseException:
        if not CTRL_C["pressed"]:
            raise
        # Whatever it surfaced as (datasets' pool turns it into a TimeoutError): what to do next, not a traceback.
        print("interrupted: the outputs are all as they were, or all new if it came as they were moved into place "
              "(or during --push_to_hub); the same command starts preprocessing again from the start", file=sys.stderr)
        sys.exit(130)  # the shell's status for Ctrl-C
