"""The plain training loops src/train.py is measured against: same model, data, batch and steps, nothing
else (no checkpoints, no metrics). Run under torchrun; prints one JSON line with tokens/s."""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from distsetup.training.data import synthetic_dataset
from distsetup.training.model import GPT


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["single", "ddp", "fsdp", "zero1", "zero2", "zero3"], required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--micro_batch_size", type=int, default=8)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--block_size", type=int, default=64)
    a = p.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if a.backend != "single":
        dist.init_process_group("gloo")
    torch.manual_seed(1234)
    model = GPT(256, a.block_size, a.n_layer, 4, a.n_embd, 0.0)
    data = synthetic_dataset(4096, a.block_size, 256, 1234)

    if a.backend.startswith("zero"):
        import deepspeed
        config = {"train_micro_batch_size_per_gpu": a.micro_batch_size, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": int(a.backend[-1])}, "gradient_clipping": 1.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        forward, backward, step = engine, engine.backward, engine.step
    else:
        if a.backend == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        elif a.backend == "fsdp":
            from torch.distributed.fsdp import fully_shard
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

        def backward(loss):
            loss.backward()

        def step():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        forward = model

    start = time.perf_counter()
    for i in range(a.steps):
        idx = (torch.arange(a.micro_batch_size) + (i * world + rank) * a.micro_batch_size) % len(data)
        loss = forward(data[idx, :-1], data[idx, 1:])
        backward(loss)
        step()
    elapsed = time.perf_counter() - start
    if rank == 0:
        tokens = a.steps * a.micro_batch_size * world * a.block_size
        print(json.dumps({"backend": a.backend, "tokens_per_s": tokens / elapsed, "loss": loss.item()}))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
