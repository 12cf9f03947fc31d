"""The benchmarks' own arithmetic: the sampling roofline (benchmark/sampling.py) against hand-computed values."""

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

import sampling  # noqa: E402


def test_sampling_floor_adds_the_attentions_cache_reads_where_they_outlast_its_flops():
    # hidden 2, 1 layer, MLP 4, 3 vocabulary rows; 1 row, 2 query tokens, 2 response tokens (one one-token step).
    config = SimpleNamespace(hidden_size=2, num_hidden_layers=1, intermediate_size=4, vocab_size=3)
    # FLOPs per token 2 x (4 x 2 x 2 + 2 x 2 x 4) = 64, unembedding 2 x 2 x 3 = 12, attention 2 x 2 x 2 x q x k.
    # Prefill: 2 tokens x 64 + 12 + 8 x 2 x 1.5 = 164. The step: 64 + 12 + 8 x 1 x 3 = 100.
    assert sampling.sampling_flops(config, 1, 2, 2) == pytest.approx(264)
    # The step: projections and unembedding 64 + 12 = 76 FLOPs, then attention over 3 cached columns:
    # 8 x 1 x 3 = 24 FLOPs and 4 bytes x 2 (K and V) x 2 (hidden) x 3 columns = 48 bytes.
    floor = sampling.sampling_floor(config, 1, 2, 2, peak=10.0, bandwidth=100.0)
    assert floor["cache_bytes"] == pytest.approx(48) and floor["cache_seconds"] == pytest.approx(0.48)
    assert floor["seconds"] == pytest.approx((164 + 76) / 10 + 24 / 10)  # the attention's FLOPs outlast its bytes
    slow_memory = sampling.sampling_floor(config, 1, 2, 2, peak=10.0, bandwidth=10.0)
    assert slow_memory["seconds"] == pytest.approx((164 + 76) / 10 + 48 / 10)  # and here its bytes outlast its FLOPs


def test_query128_response_bounds_hold_the_committed_worlds_responses():
    """benchmark/random_world.py preprocesses the tiny world with 128-token queries and upper bounds on the responses;
    preprocess_tldr.py refuses a bound below the data. The committed world's exact maxima are in benchmark/tiny.sh."""
    import random_world

    tiny_sh = (Path(random_world.ROOT) / "benchmark" / "tiny.sh").read_text()
    block = tiny_sh[tiny_sh.index("TINY_LENGTHS=("):]
    exact = dict(re.findall(r"--(\w+) (\d+)", block[:block.index(")")]))
    bounds = dict(zip(random_world.Q128_LENGTHS[0::2], random_world.Q128_LENGTHS[1::2]))
    for flag in ("max_sft_response_length", "max_rm_response_length", "cnndm_max_rm_response_length"):
        assert int(bounds[f"--{flag}"]) >= int(exact[flag]), flag
    for flag, response in (("max_sft_query_response_length", "max_sft_response_length"),
                           ("max_rm_query_response_length", "max_rm_response_length"),
                           ("cnndm_max_rm_query_response_length", "cnndm_max_rm_response_length")):
        assert int(bounds[f"--{flag}"]) >= 128 + int(exact[response]), flag
    assert "--no-check_length_correctness" in random_world.Q128_LENGTHS
