"""What `distsetup validate` says of a DeepSpeed file beside its problems: what a file for distsetup's trainer leaves
to the run config, what each "auto" Accelerate fills from its own settings becomes, and what DeepSpeed bends."""

from distsetup.formats.deepspeed import offload_device, stage_as_read
from distsetup.formats.deepspeed_rules import BATCH_KEYS, NO_BATCH, auto_paths, nvme_bent_at_stage
from distsetup.formats.problems import join_path


def deepspeed_notes(config: dict) -> list[str]:
    """What a file for distsetup's trainer leaves to the run config, that another reader would need."""
    if set(BATCH_KEYS) & set(config):
        return []
    return [
        f"{NO_BATCH}: distsetup's trainer takes the batch from the run config (training.micro_batch_size, "
        "gradient_accumulation_steps); deepspeed.initialize of this file alone refuses to start (add "
        "train_micro_batch_size_per_gpu, or --micro_batch_size to `distsetup deepspeed`)."
    ]


# The "auto" values Accelerate fills from its own settings (DeepSpeedPlugin: `accelerate launch`'s flags, else its
# defaults), not from what the HF Trainer knows: key -> (the flag, what it is without one, what that does)
FILLED_BY_ACCELERATE = {
    "zero_optimization.stage": ("--zero_stage", "2", ""),
    "zero_optimization.offload_optimizer.device": ("--offload_optimizer_device", "none", ": nothing is offloaded"),
    "zero_optimization.offload_param.device": ("--offload_param_device", "none", ": nothing is offloaded"),
    "zero_optimization.offload_optimizer.nvme_path": ("--offload_optimizer_nvme_path", '"none"', ""),
    "zero_optimization.offload_param.nvme_path": ("--offload_param_nvme_path", '"none"', ""),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        "--zero3_save_16bit_model",
        "false",
        ": at ZeRO-3 the HF Trainer's save_model writes no model weights, only DeepSpeed's checkpoint",
    ),
}


def accelerate_auto_notes(config: dict) -> list[str]:
    """What each "auto" that Accelerate fills from its own settings becomes where nothing sets it (the HF Trainer
    under torchrun; accelerate launch without the flag)."""
    notes = []
    for path in auto_paths(config):
        where = join_path(path)
        if where in FILLED_BY_ACCELERATE:
            flag, default, meaning = FILLED_BY_ACCELERATE[where]
            notes.append(
                f'{where}: "auto" is Accelerate\'s setting (accelerate launch {flag}), {default} without one{meaning}; '
                "write the value you mean."
            )
    return notes


def bent_settings_notes(config: dict) -> list[str]:
    """What DeepSpeed bends of a file's settings (check_spec's warnings, which `distsetup deepspeed` gives)."""
    stage = stage_as_read(config)
    bent = nvme_bent_at_stage(stage, offload_device(config, "offload_optimizer"))
    return [f"zero_optimization.offload_optimizer: {bent}"] if bent else []
