"""--resume never unpickles code (issue 16). Checkpoints hold the model and optimizer as safetensors
(+ JSON for the optimizer's settings), the scheduler, counters and python / numpy RNG states as JSON
and torch's RNG states as safetensors; files of any other name are never opened. Under DeepSpeed,
its own files (torch.save) are read with torch.load(weights_only=True), which builds tensors,
containers and 4 data-only DeepSpeed classes (and ZeroStageEnum members pickled by name, as getattr), and
refuses anything else.

A planted payload creates a marker folder when unpickled; no resume may create it. sft.py stands for
the four stages (they share these helpers, test_conventions.py keeps them identical).
"""

import json
import os
import pickle
import shutil
from types import SimpleNamespace

import pytest
import torch

import sft
from test_sft import PROCESS_TOLERANCE, TINY_RUN, max_difference, run_sft, weights


class Payload:
    """Unpickled, it creates the folder `marker`: what a planted pickle could do (any code at all)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def plant(folder, marker):
    """Payloads under the names accelerate.load_state unpickled (weights_only=False) beside ours."""
    for name in ("custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin",
                 "optimizer.bin"):
        torch.save(Payload(marker), folder / name)


@pytest.fixture(scope="module")
def reference(tiny_tldr, tmp_path_factory):
    """The tiny SFT run of test_sft.py, uninterrupted, on one process: its weights."""
    cwd = tmp_path_factory.mktemp("reference")
    run_sft(cwd, *TINY_RUN, "--query_dataset", tiny_tldr / "sft", "--output_dir", cwd / "out")
    return weights(cwd / "out")


def test_the_payload_would_run_if_unpickled(tmp_path):
    """The marker test can fail: torch.load(weights_only=False) of a planted file runs its code."""
    plant(tmp_path, tmp_path / "marker")
    torch.load(tmp_path / "scheduler.bin", weights_only=False)
    assert (tmp_path / "marker").is_dir()


@pytest.mark.parametrize("processes", [1, 2])
def test_planted_pickles_are_never_opened_on_resume(processes, reference, tiny_tldr, tmp_path):
    """One process (bit for bit the uninterrupted run), and 2 DDP processes (every rank reads the files)."""
    flags = [*TINY_RUN, "--query_dataset", tiny_tldr / "sft", "--output_dir", tmp_path / "out", "--save_every", "1"]
    run_sft(tmp_path, *flags, "--stop_after_updates", "2", processes=processes)
    checkpoint = tmp_path / "out" / "checkpoints" / "update_2"
    assert not [name for name in os.listdir(checkpoint) if name.endswith((".pkl", ".bin", ".pt"))]  # none written
    plant(checkpoint, tmp_path / "marker")
    result = run_sft(tmp_path, *flags, "--resume", processes=processes)
    assert "at update 2" in result.stdout and not (tmp_path / "marker").exists()
    if processes == 1:
        assert all(torch.equal(weights(tmp_path / "out")[key], reference[key]) for key in reference)
    else:
        assert max_difference(weights(tmp_path / "out"), reference) < PROCESS_TOLERANCE


def test_an_old_pickled_checkpoint_is_refused(tmp_path):
    """A checkpoint of the earlier format (accelerate's pickles, no safetensors state) is refused unopened."""
    folder = tmp_path / "update_2"
    folder.mkdir()
    (folder / "trainer_state.json").write_text(json.dumps({"update": 2, "run_name": "old"}))
    plant(folder, tmp_path / "marker")
    no_deepspeed = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None))
    with pytest.raises(sft.SetupError, match="lacks .'model.safetensors', 'optimizer.safetensors', 'optimizer.json'.") as error:
        sft.load_checkpoint(no_deepspeed, str(folder), None, None, None)
    assert "never opened" in str(error.value) and "custom_checkpoint_0.pkl" in str(error.value)
    deepspeed = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=object()))  # a DeepSpeed launch wants its files
    with pytest.raises(sft.SetupError, match=r"lacks \['deepspeed'\]"):
        sft.load_checkpoint(deepspeed, str(folder), None, None, None)
    assert not (tmp_path / "marker").exists()


@pytest.mark.parametrize("stage", ["sft", "reward", "dpo", "ppo"])
def test_a_damaged_checkpoint_or_model_is_named_with_what_to_do(tmp_path, stage):
    """A checkpoint file cut short (disk full, a copy that stopped) stops --resume naming the checkpoint and the fix
    (it was a raw SafetensorError); so does a model folder whose weights are cut short."""
    from safetensors.torch import save_model

    module = __import__(stage)
    folder = tmp_path / "checkpoints" / "update_2"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"update": 2, "run_name": "r", "scaler": None}))
    (folder / "optimizer.json").write_text(json.dumps({"param_groups": []}))
    save_model(torch.nn.Linear(4, 4), str(folder / "model.safetensors"))
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
    shutil.copy(folder / "model.safetensors", folder / "optimizer.safetensors")
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None), unwrap_model=lambda model: model)
    optimizer = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())
    extra = [None] if stage != "ppo" else []  # the scheduler (PPO's lr decays inside its loop)
    with pytest.raises(module.SetupError) as error:
        module.resume(accelerator, None, (2, str(folder)), torch.nn.Linear(4, 4), optimizer, *extra)
    assert str(error.value).startswith(f"--resume: {folder} cannot be read (SafetensorError: ")
    assert str(error.value).endswith("delete it to resume from the checkpoint before it, or start again without --resume")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}))
    shutil.copy(folder / "model.safetensors", model / "model.safetensors")
    from transformers import AutoModelForCausalLM
    with pytest.raises(module.SetupError, match=rf"--sft_model_path {model}: its weights cannot be read \("):
        module.load_fp32(AutoModelForCausalLM, str(model), "--sft_model_path")


def test_a_deepspeed_resume_loads_through_the_weights_only_reader_and_stops_when_deepspeed_finds_nothing(tmp_path):
    """Under DeepSpeed, load_checkpoint swaps the engine's loader for load_weights_only before it loads (DeepSpeed's
    own would unpickle anything), and a checkpoint DeepSpeed reports as not found (`loaded` None, after a log line
    of its own) stops the start with what to do, instead of resuming at that update with fresh weights."""
    folder = tmp_path / "update_2"
    (folder / "deepspeed").mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"update": 2, "run_name": "r", "scaler": None}))
    calls = []

    class Engine:  # what load_checkpoint touches of a DeepSpeed engine
        def __init__(self, found):
            self.found, self.checkpoint_engine = found, SimpleNamespace(load=torch.load)

        def load_checkpoint(self, path, tag, load_lr_scheduler_states):
            calls.append((path, tag, load_lr_scheduler_states, self.checkpoint_engine.load))
            return (os.path.join(path, tag) if self.found else None), {}

    deepspeed = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=object()), scaler=None, step=3, process_index=0)
    with pytest.raises(sft.SetupError, match=r"DeepSpeed found no checkpoint in .*update_2/deepspeed") as error:
        sft.load_checkpoint(deepspeed, str(folder), Engine(found=False), None, None)
    assert f"delete {folder} to resume from an earlier one" in str(error.value)
    assert calls == [(str(folder), "deepspeed", False, sft.load_weights_only)]
    assert deepspeed.step == 3  # stopped before anything of the resume was applied
    state = sft.load_checkpoint(deepspeed, str(folder), Engine(found=True), None, None)
    assert state["update"] == 2 and deepspeed.step == 0 and calls[-1][3] is sft.load_weights_only


def test_deepspeed_files_are_read_weights_only(tmp_path):
    """load_weights_only (DeepSpeed's loader on --resume) reads what ZeRO writes and refuses a payload."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    zero_like = {"optimizer_state_dict": {"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.gradients,
                                          "param_slice_mappings": [{"w": fragment_address(numel=4, start=0)}],
                                          "state": {0: {"exp_avg": torch.ones(4)}}}, "ds_version": "0.19.8"}
    torch.save(zero_like, tmp_path / "optim_states.pt")
    loaded = sft.load_weights_only(str(tmp_path / "optim_states.pt"))
    assert loaded["optimizer_state_dict"]["zero_stage"] == ZeroStageEnum.gradients
    assert torch.equal(loaded["optimizer_state_dict"]["state"][0]["exp_avg"], torch.ones(4))
    torch.save({"module": {"w": torch.ones(2)}, "extra": Payload(tmp_path / "marker")}, tmp_path / "model_states.pt")
    with pytest.raises(pickle.UnpicklingError):
        sft.load_weights_only(str(tmp_path / "model_states.pt"))
    assert not (tmp_path / "marker").exists()


class PickledByName:
    """Pickles as getattr(owner, name): how Python 3.11.2 (Debian 12's python3) pickles any Enum member."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


def test_deepspeed_enum_pickled_by_name_loads_and_getattr_reaches_nothing_else(tmp_path):
    """A ZeRO file written by a Python that pickles ZeroStageEnum.gradients as getattr(ZeroStageEnum, "gradients")
    loads; getattr on anything but a ZeroStageEnum member's name is refused, and no payload runs."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    torch.save({"optimizer_state_dict": {"zero_stage": PickledByName(ZeroStageEnum, "gradients")}},
               tmp_path / "optim_states.pt")
    assert b"getattr" in (tmp_path / "optim_states.pt").read_bytes()  # the old form really is in the file
    loaded = sft.load_weights_only(str(tmp_path / "optim_states.pt"))
    assert loaded["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.gradients
    for owner, name in [(ZeroStageEnum, "__class__"), (ZeroStageEnum, "_missing_"), (LossScaler, "__init__"),
                        (torch.Tensor, "__reduce_ex__")]:
        torch.save({"module": {"w": torch.ones(2)}, "extra": PickledByName(owner, name),
                    "after": Payload(tmp_path / "marker")}, tmp_path / "model_states.pt")
        with pytest.raises(pickle.UnpicklingError):
            sft.load_weights_only(str(tmp_path / "model_states.pt"))
        assert not (tmp_path / "marker").exists()


def test_deepspeed_resume_reads_its_files_weights_only(reference, tiny_tldr, tmp_path):
    """2 CPU processes of DeepSpeed ZeRO-2: stopped after update 2; resuming from a checkpoint whose model
    file was replaced by a payload is refused (nothing runs); with the real file it resumes and matches."""
    flags = [*TINY_RUN, "--query_dataset", tiny_tldr / "sft", "--output_dir", tmp_path / "out", "--save_every", "1"]
    run_sft(tmp_path, *flags, "--stop_after_updates", "2", processes=2, deepspeed=True)
    checkpoint = tmp_path / "out" / "checkpoints" / "update_2"
    model_states = checkpoint / "deepspeed" / "mp_rank_00_model_states.pt"
    shutil.copy(model_states, tmp_path / "model_states.pt")
    torch.save({"module": Payload(tmp_path / "marker")}, model_states)
    plant(checkpoint, tmp_path / "marker")
    result = run_sft(tmp_path, *flags, "--resume", processes=2, deepspeed=True, check=False)
    assert result.returncode != 0 and "UnpicklingError" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "marker").exists()
    shutil.copy(tmp_path / "model_states.pt", model_states)
    result = run_sft(tmp_path, *flags, "--resume", processes=2, deepspeed=True)
    assert "at update 2" in result.stdout and not (tmp_path / "marker").exists()
    assert max_difference(weights(tmp_path / "out"), reference) < PROCESS_TOLERANCE
