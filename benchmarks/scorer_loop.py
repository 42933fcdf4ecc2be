"""The DDP loop a user writes by hand for examples/pairwise_scorer (what src/train.py is measured against): the same
model, data, loss, batch and recipe (AdamW with weight decay on matrices only, clipping at 1.0), a DataLoader with a
DistributedSampler and the same worker processes; nothing else (no checkpoints, no metrics). Run under torchrun;
prints one JSON line with samples/s and the median step time."""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from distsetup.training.optim import param_groups

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "pairwise_scorer"))
from scorer import build_dataset, build_model, pairwise_loss  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--micro_batch_size", type=int, default=32)
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--image_size", type=int, default=16)
    p.add_argument("--num_workers", type=int, default=2)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    model = torch.nn.parallel.DistributedDataParallel(build_model(a.channels, a.depth))
    optimizer = torch.optim.AdamW(param_groups(model.module, 0.01), lr=3e-3)
    dataset = build_dataset("train", pairs=4096, image_size=a.image_size)
    sampler = DistributedSampler(dataset, world, rank, seed=1234)
    loader = DataLoader(dataset, a.micro_batch_size, sampler=sampler, num_workers=a.num_workers, drop_last=True)
    batches = iter(loader)
    step_ends = [time.perf_counter()]
    for _ in range(a.steps):
        loss = pairwise_loss(model, next(batches))["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_ends.append(time.perf_counter())
    if rank == 0:
        steps = [end - begin for begin, end in zip(step_ends, step_ends[1:], strict=False)]
        samples = a.steps * a.micro_batch_size * world
        print(json.dumps({"samples_per_s": samples / sum(steps), "median_step_seconds": statistics.median(steps)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
