"""Inputs the launcher tests share: a DeepSpeed file, an FSDP file and a name that tests quoting."""

WEIRD = "we ird 'dir\" $x"  # spaces, both quotes and a dollar: every path must survive quoting
# what the launch options give accelerate for an FSDP2 file of HYBRID_SHARD (cli/launch_spec.py)
ACCELERATE_HYBRID_FSDP = {
    "accelerate_fsdp_args": ("--use_fsdp", "--fsdp_version", "2", "--fsdp_transformer_layer_cls_to_wrap", WEIRD),
    "accelerate_hybrid_shard": True,
}
DS_CONFIG = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 1},
    "steps_per_print": 100,
}
FSDP_CONFIG = {
    "fsdp_version": 2,
    "fsdp_sharding_strategy": "FULL_SHARD",
    "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "fsdp_transformer_layer_cls_to_wrap": "Block",
}
