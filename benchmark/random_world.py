"""The benchmarks' second configuration: a random-init ~5M GPT-NeoX on the tiny world's queries cut to 128 tokens.

Imported by benchmark/sampling.py and benchmark/ppo_vs_trl.py (a module off the training path). Builds, once,
in git-ignored folders:

- data/tiny_tldr_q128/: the tiny world preprocessed by preprocess_tldr.py as benchmark/tiny.sh does it, but with
  128-token queries (the query budget the benchmarks name "query 128");
- models/random_h256_l4/{sft,reward}: a GPT-NeoX with hidden 256, 4 layers, 4 heads, MLP 1024, rotary 25% and the
  tiny tokenizer's 4096-row embedding (5.3M parameters, 3.2M outside the embeddings), random weights (seed 0),
  saved as an SFT policy; and a ScalarModel on the same backbone with a random head as the reward model and
  critic. Throughput does not depend on the weights, only on the shapes (and on where EOS falls: the benchmarks
  sample every response token on both sides).
"""

import os
import shutil
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
WORLD = os.path.join(ROOT, "assets", "tiny_world")
SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024, vocab_size=4096)
# Upper bounds on the responses (benchmark/tiny.sh's bounds for worlds of any seed): preprocess_tldr.py fails if
# one would cut data, and --no_check_length_correctness lets them exceed the data's exact maxima.
Q128_LENGTHS = ["--query_length", "128", "--max_sft_response_length", "96", "--max_sft_query_response_length", "224",
                "--max_rm_response_length", "96", "--max_rm_query_response_length", "224",
                "--cnndm_query_length", "128", "--cnndm_max_rm_response_length", "96",
                "--cnndm_max_rm_query_response_length", "224", "--no_check_length_correctness"]


def query128_data(python: str = sys.executable) -> str:
    """data/tiny_tldr_q128 (built on first use, ~30 s): its sft/ folder, as ppo.py's --query_dataset reads it."""
    out = os.path.join(ROOT, "data", "tiny_tldr_q128")
    if not os.path.exists(os.path.join(out, "args.json")):
        shutil.rmtree(out, ignore_errors=True)
        command = [python, os.path.join(ROOT, "preprocess_tldr.py"), "--base_model", os.path.join(WORLD, "pythia-tiny"),
                   "--sft_dataset", os.path.join(WORLD, "tldr_3_filtered"),
                   "--preference_dataset", os.path.join(WORLD, "summarize_from_feedback"),
                   "--output_dir", out, *Q128_LENGTHS]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"preprocessing failed:\n{(result.stdout + result.stderr)[-3000:]}")
    return os.path.join(out, "sft")


def tiny_reward_model() -> str:
    """models/tiny/reward_randomhead_1: the tiny SFT policy's backbone (models/tiny/sft_1) with a random scalar head,
    as reward model and critic of the tiny configuration when no trained one is at hand (the speed of PPO does not
    depend on the reward model's weights)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, ROOT)
    from reward import ScalarModel, ScalarModelConfig  # a new RM is reward.py's: ppo.py's copy only loads one

    sft, out = os.path.join(ROOT, "models", "tiny", "sft_1"), os.path.join(ROOT, "models", "tiny", "reward_randomhead_1")
    if not os.path.exists(os.path.join(out, "config.json")):
        backbone = AutoModelForCausalLM.from_pretrained(sft).base_model
        base_config = {k: v for k, v in backbone.config.to_dict().items() if k != "_name_or_path"}
        torch.manual_seed(0)
        scalar = ScalarModel(ScalarModelConfig(base_config=base_config))
        scalar.backbone.load_state_dict(backbone.state_dict())
        scalar.save_pretrained(out)
        AutoTokenizer.from_pretrained(sft).save_pretrained(out)
    return out


def random_models() -> tuple:
    """models/random_h256_l4/{sft,reward} (built on first use, seconds): (SFT policy folder, reward model folder)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXForCausalLM

    sys.path.insert(0, ROOT)
    from reward import ScalarModel, ScalarModelConfig  # a new RM is reward.py's: ppo.py's copy only loads one

    out = os.path.join(ROOT, "models", "random_h256_l4")
    sft, reward = os.path.join(out, "sft"), os.path.join(out, "reward")
    if os.path.exists(os.path.join(reward, "config.json")):
        return sft, reward
    tiny = AutoModelForCausalLM.from_pretrained(os.path.join(WORLD, "pythia-tiny"))
    config = tiny.config.__class__.from_dict({**tiny.config.to_dict(), **SHAPE, "hidden_dropout": 0.0,
                                              "attention_dropout": 0.0})
    torch.manual_seed(0)
    policy = GPTNeoXForCausalLM(config)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(WORLD, "pythia-tiny"))
    policy.save_pretrained(sft)
    tokenizer.save_pretrained(sft)
    base_config = {k: v for k, v in policy.base_model.config.to_dict().items() if k != "_name_or_path"}
    scalar = ScalarModel(ScalarModelConfig(base_config=base_config))
    scalar.backbone.load_state_dict(policy.base_model.state_dict())
    scalar.save_pretrained(reward)
    tokenizer.save_pretrained(reward)
    return sft, reward
