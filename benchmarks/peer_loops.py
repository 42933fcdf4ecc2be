"""What a user would run instead of distsetup's trainer, for benchmarks/peers.py: the HF Trainer, or a plain
Accelerate loop, training the Hugging Face model in --model on the same synthetic tokens, batch, AdamW, clipping,
warmup + cosine schedule and steps. Run under torchrun (one process per GPU, else CPU processes with gloo); rank 0
prints one JSON line: the Unix time each optimizer step ended, and how the tool ran the model."""

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

from distsetup.training.data.datasets import synthetic_dataset

SEED, LR, WEIGHT_DECAY, CLIP, WARMUP = 1234, 1e-3, 0.01, 1.0, 5
ON_CPU = not torch.cuda.is_available()


class Tokens(torch.utils.data.Dataset):
    """Synthetic sequences as a causal LM takes them (the model shifts its labels itself)."""

    def __init__(self, samples: int, seq: int, vocab: int):
        self.data = synthetic_dataset(samples, seq, vocab, SEED)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        ids = self.data[i, :-1]
        return {"input_ids": ids, "labels": ids}


def hf_trainer(a, dataset) -> tuple[list[float], str]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    ends: list[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.time())

    arguments = TrainingArguments(
        output_dir=a.output_dir,
        per_device_train_batch_size=a.micro_batch_size,
        max_steps=a.steps,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=CLIP,
        lr_scheduler_type="cosine",
        warmup_steps=WARMUP,
        logging_steps=10,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        seed=SEED,
        dataloader_num_workers=0,
        ddp_backend=None if torch.cuda.is_available() else "gloo",
        use_cpu=ON_CPU,  # else each CPU process trains alone (Accelerate's DistributedType.NO)
        deepspeed=a.deepspeed,
        bf16=a.precision == "bf16",
    )
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    trainer = Trainer(model=model, args=arguments, train_dataset=dataset, callbacks=[StepEnds()])
    trainer.train()
    ran = "deepspeed" if a.deepspeed else str(trainer.accelerator.distributed_type.value).lower()
    return ends, ran


def accelerate_loop(a, dataset) -> tuple[list[float], str]:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    fsdp = None
    if a.backend == "fsdp":
        fsdp = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=[a.layer_class]
        )
    accelerator = Accelerator(
        cpu=ON_CPU, fsdp_plugin=fsdp, mixed_precision="bf16" if a.precision == "bf16" else "no"
    )  # cpu=True: else each CPU process trains alone (DistributedType.NO)
    if fsdp is not None and ON_CPU:
        fsdp_on_cpu(fsdp)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": WEIGHT_DECAY}, {"params": other, "weight_decay": 0.0}], lr=LR
    )
    scheduler = get_cosine_schedule_with_warmup(optimizer, WARMUP, a.steps)
    loader = torch.utils.data.DataLoader(dataset, batch_size=a.micro_batch_size, shuffle=True, drop_last=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()
    ends: list[float] = []
    batches = iter(loader)
    for _ in range(a.steps):
        batch = next(batches)
        loss = model(**batch, use_cache=False).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # the step's work done (on a GPU: waited for)
        ends.append(time.time())
    from torch.distributed.fsdp import FSDPModule

    sharded = isinstance(model, FSDPModule)
    return ends, "fsdp2" if sharded else str(accelerator.distributed_type.value).lower()


def fsdp_on_cpu(plugin) -> None:
    """Accelerate 1.x takes an FSDP plugin only on accelerators (on a CPU it runs DDP): its state set to FSDP, its
    own FSDP2 path (fsdp2_prepare_model: fully_shard per layer, then the root) runs on CPU processes with gloo."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    state = AcceleratorState()
    state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, plugin


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tool", choices=["hf_trainer", "accelerate"], required=True)
    p.add_argument("--backend", choices=["ddp", "fsdp", "zero3"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--layer_class", default="LlamaDecoderLayer")
    p.add_argument("--deepspeed", default=None)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--micro_batch_size", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    a = p.parse_args()
    dataset = Tokens(4096, a.seq, a.vocab)
    ends, ran = (hf_trainer if a.tool == "hf_trainer" else accelerate_loop)(a, dataset)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    print(json.dumps({"step_ends": ends, "ran": ran}))


if __name__ == "__main__":
    main()
