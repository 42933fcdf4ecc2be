"""The HF Trainer itself, on two CPU processes under torchrun, with the DeepSpeed file `distsetup deepspeed
--zero_stage 3 --hf_auto` writes: it trains at ZeRO-3 and saves weights that from_pretrained loads."""

import subprocess

import pytest
from train_runs import environment

transformers = pytest.importorskip("transformers")

HF_TRAINER_SCRIPT = """
import os, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

ds_file, out = sys.argv[1], sys.argv[2]


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.arange(16) * (i + 1) % 97
        return {"input_ids": ids, "labels": ids}


# use_cpu: accelerate then starts gloo on CPU (without it, it counts one process); DeepSpeed still runs ZeRO
args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=2, deepspeed=ds_file,
                         use_cpu=True, save_strategy="no", report_to=[])
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=16))
trainer = Trainer(model=model, args=args, train_dataset=Tokens())
trainer.train()
# one file per rank: two ranks printing to one pipe interleave their lines
with open(f"{out}/zero_stage_rank{args.process_index}", "w") as stage_file:
    stage_file.write(str(trainer.deepspeed.zero_optimization_stage()))
trainer.save_model(out + "/final")
# shut down as a script should: a process group left to the interpreter's teardown once aborted a rank (gloo's threads)
torch.distributed.destroy_process_group()
# and leave without the interpreter's teardown, as distsetup's trainer does (train.exit_now): even so a rank aborted
# there once ("terminate called without an active exception", a C++ thread still joinable), after its work was done
sys.stdout.flush()
os._exit(0)
"""


def test_the_hf_trainer_saves_a_model_from_a_zero3_hf_auto_file(run_cli, tmp_path):
    """With the README's `--zero_stage 3 --hf_auto` file the Trainer saves the weights (not "Saving the full
    checkpoint instead, use zero_to_fp32.py"), and from_pretrained loads them."""
    assert run_cli("deepspeed", "--zero_stage", "3", "--hf_auto", "-o", tmp_path / "ds_hf.json").exit_code == 0
    (tmp_path / "hf_train.py").write_text(HF_TRAINER_SCRIPT)
    run = subprocess.run(
        ["torchrun", "--nproc_per_node", "2", "--standalone", "hf_train.py", "ds_hf.json", str(tmp_path / "out")],
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    stages = sorted(path.read_text() for path in (tmp_path / "out").glob("zero_stage_rank*"))
    assert stages == ["3", "3"]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out" / "final", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert model.config.num_hidden_layers == 2
