"""Files users bring from elsewhere, written as `distsetup validate` reads them: YAML or JSON by suffix, and a
DeepSpeed file for the HF Trainer."""

import json
from pathlib import Path

import yaml


def write(path: Path, data) -> Path:
    path.write_text(yaml.safe_dump(data) if path.suffix == ".yaml" else json.dumps(data))
    return path


BASE_DS = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "train_batch_size": "auto",
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "zero_optimization": {"stage": 2},
}
