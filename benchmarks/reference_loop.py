"""The plain training loops src/train.py is measured against: same model, data, batch, steps and recipe
(AdamW with weight decay on matrices only, nanoGPT's two groups), nothing else (no checkpoints, no
metrics). Run under torchrun; prints one JSON line with tokens/s, the median step time and, on a GPU, the
peak memory. One process per GPU where there are GPUs, else the CPU."""

import argparse
import contextlib
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from common import add_run_arguments

from distsetup.training.data.datasets import synthetic_dataset
from distsetup.training.model.gpt import GPT
from distsetup.training.optim import param_groups


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["single", "ddp", "fsdp", "zero1", "zero2", "zero3"], required=True)
    p.add_argument(
        "--deepspeed_config",
        help="a zero backend's file, read as DeepSpeed reads it (torch's AdamW where it names no optimizer): the plain "
        "DeepSpeed loop on the file src/train.py is given",
    )
    add_run_arguments(p)
    a = p.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if a.backend != "single":
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(1234)
    model = GPT(256, a.block_size, a.n_layer, a.n_head, a.n_embd, 0.0)
    data = synthetic_dataset(4096, a.block_size, 256, 1234)
    autocast = contextlib.nullcontext()

    if a.backend.startswith("zero"):
        import deepspeed

        from distsetup.training.backends.deepspeed_comm import leave_out_shared_memory_all_reduce

        if device.type == "cpu":  # an op no step uses, which DeepSpeed would compile on a machine's first run
            leave_out_shared_memory_all_reduce()

        config = {
            "train_micro_batch_size_per_gpu": a.micro_batch_size,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": int(a.backend[-1])},
            "gradient_clipping": 1.0,
            "bf16": {"enabled": a.precision == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        }
        if a.deepspeed_config:
            with open(a.deepspeed_config) as f:
                config = json.load(f)
        groups = param_groups(model, 0.01)
        optimizer = None if "optimizer" in config else torch.optim.AdamW(groups, lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, optimizer=optimizer, config=config)
        forward, backward, step = engine, engine.backward, engine.step
    else:
        model = model.to(device)
        if a.backend == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        elif a.backend == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = (
                MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                if a.precision == "bf16"
                else MixedPrecisionPolicy()
            )
            for block in model.blocks:
                fully_shard(block, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
        elif a.precision == "bf16":
            autocast = torch.autocast(device.type, dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-3)

        def backward(loss):
            loss.backward()

        def step():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        forward = model

    step_ends = [time.perf_counter()]
    for i in range(a.steps):
        idx = (torch.arange(a.micro_batch_size) + (i * world + rank) * a.micro_batch_size) % len(data)
        with autocast:
            loss = forward(data[idx, :-1].to(device), data[idx, 1:].to(device))
        backward(loss)
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()  # a step's time is its GPU work, not the time to queue it
        step_ends.append(time.perf_counter())
    if rank == 0:
        tokens = a.steps * a.micro_batch_size * world * a.block_size
        steps = [end - begin for begin, end in zip(step_ends, step_ends[1:], strict=False)]
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        print(
            json.dumps(
                {
                    "backend": a.backend,
                    "tokens_per_s": tokens / sum(steps),
                    "median_step_seconds": statistics.median(steps),
                    "peak_device_bytes": peak,
                    "loss": loss.item(),
                }
            )
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
