"""Run configs from the guides: the Free Transformer guide's block (written with other tools' names) and the LLM
guide's flow (a ZeRO-2 offload bf16 DeepSpeed file beside an accumulation of 16), for the guide and other-names
tests."""

import yaml

# The Free Transformer guide's blocks as the guide writes them, around a tiny model.
FREE_TRANSFORMER = """\
model: {n_layer: 2, n_head: 2, n_embd: 32, block_size: 32}
training:
  batch_size: 4                    # per GPU
  learning_rate: 2e-4
  gradient_checkpointing: true
  bf16: true
  gradient_clip_norm: 1.0
distributed:
  use_fsdp: true
  fsdp_sharding_strategy: "full_shard"
  fsdp_backward_prefetch: "backward_pre"
  fsdp_forward_prefetch: false
  fsdp_auto_wrap_policy: "transformer_auto_wrap"
  fsdp_min_num_params: 1000000
  fsdp_state_dict_type: "full_state_dict"   # one file on save
  fsdp_mixed_precision: true
  fsdp_param_dtype: "bfloat16"
  fsdp_reduce_dtype: "float32"
  fsdp_buffer_dtype: "float32"
"""


TINY = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}, "data": {"num_samples": 512}}


def llm_guide(run_cli, folder, accumulation_in_file: int | None = None):
    """The LLM framework guide: `distsetup deepspeed --zero_stage 2 --offload_optimizer cpu --bf16`, then its
    distributed block (accumulation 16 beside use_deepspeed) in a run config of a tiny model."""
    folder.mkdir(parents=True, exist_ok=True)
    batch = ["--micro_batch_size", "1", "--gradient_accumulation_steps", str(accumulation_in_file)]
    written = run_cli(
        "deepspeed",
        *("--zero_stage", "2", "--offload_optimizer", "cpu", "--bf16"),
        *(batch if accumulation_in_file else []),
        *("--output", folder / "config" / "ds_config.json"),
    )
    assert written.exit_code == 0, written.output
    config = {
        **TINY,
        "training": {"micro_batch_size": 1, "max_steps": 3, "log_interval": 1, "output_dir": str(folder / "out")},
        "distributed": {
            "use_deepspeed": True,
            "deepspeed_config": "config/ds_config.json",
            "gradient_accumulation_steps": 16,
        },
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder / "config.yaml"
