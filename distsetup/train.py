"""Train a GPT (or a local Hugging Face causal LM) on one process, DDP, FSDP2 or DeepSpeed ZeRO 0-3.

    python -m distsetup.train --config config/config.yaml distributed.backend=single   # one process
    torchrun --nproc_per_node 2 -m distsetup.train --config config/config.yaml        # backend from the config
    deepspeed --num_gpus 2 --module distsetup.train --config config/config.yaml --deepspeed config/ds_config.json
    python -m distsetup.train --config config/config.yaml training.max_steps=50        # any key: section.key=value
    python -m distsetup.train --config config/config.yaml --export runs/demo/model.pt --export_dtype bf16
    python -m distsetup.train --config config/config.yaml distributed.backend=single --init_from runs/demo/model.pt

`src/train.py` (the name the guides use) runs the same: `torchrun --nproc_per_node 2 src/train.py ...`.

Without GPUs it runs on the CPU with gloo; with GPUs, one process per GPU (LOCAL_RANK) with NCCL.
Checkpoints go to training.output_dir/checkpoints/step_NNNNNNN/ and the run resumes from the newest
complete one (--no_resume starts afresh). SIGTERM or SIGUSR1 make every rank, within about a second (or a
step, if longer), checkpoint at the same step and exit with status 75 (EX_TEMPFAIL: "try again later").
The sbatch script of `distsetup slurm --requeue` requeues from its trap of SLURM's warning signal (USR1),
after the ranks have checkpointed; a job whose ranks were stopped otherwise (`scancel --signal=TERM`, a
user's signal) ends there, its checkpoint ready for the next `sbatch`, which resumes from it.
"""

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

from distsetup.errors import DistsetupError
from distsetup.formats.lr_scaling import scaled_lr
from distsetup.formats.runconfig import load_run_config, resolve_config_path

PREEMPTED = 75  # EX_TEMPFAIL: "try again later", the status the sbatch script requeues on


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m distsetup.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", help="run config (config.yaml); without one, the defaults and the overrides")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. training.max_steps=50")
    p.add_argument("--deepspeed", help="DeepSpeed file; implies distributed.backend=deepspeed")
    p.add_argument("--local_rank", type=int, help="accepted from the deepspeed launcher; LOCAL_RANK is used")
    p.add_argument("--no_resume", action="store_true", help="ignore existing checkpoints")
    p.add_argument("--export", metavar="OUT.pt", help="write the newest checkpoint's weights to OUT.pt and exit")
    p.add_argument("--export_dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--init_from", metavar="FILE.pt", help="start from weights written by --export")
    return p.parse_intermixed_args(argv)  # overrides may follow options, as launcher scripts pass them


def load_config(args):
    """The run config, with --deepspeed folded in and every file it names resolved as validation resolves it."""
    for flag in ("config", "deepspeed", "export", "init_from"):
        value = getattr(args, flag)
        if value is not None and not value.strip():
            raise DistsetupError(f"--{flag} is empty.", f"name a file after --{flag}, or leave the option out.")
    if args.export and Path(args.export).is_dir():
        raise DistsetupError(
            f"--export {args.export} is a folder.", f"name a file, e.g. {Path(args.export) / 'model.pt'}."
        )
    overrides = list(args.overrides)
    if args.deepspeed:
        overrides += ["distributed.backend=deepspeed", f"distributed.deepspeed_config={json.dumps(args.deepspeed)}"]
    cfg = load_run_config(args.config, overrides)
    base_dir = Path(args.config).parent if args.config else None
    for key in ("deepspeed_config", "fsdp_config"):
        if value := getattr(cfg.distributed, key):
            setattr(cfg.distributed, key, str(resolve_config_path(value, base_dir)))
    cfg.data.paths = [str(resolve_config_path(path, base_dir)) for path in cfg.data.paths]
    cfg.data.val_paths = [str(resolve_config_path(path, base_dir)) for path in cfg.data.val_paths]
    if cfg.model.tokenizer:
        cfg.model.tokenizer = str(resolve_config_path(cfg.model.tokenizer, base_dir))
    return cfg


class Preemption:
    """Remembers SIGTERM/SIGUSR1; the loop turns it into a checkpoint once the ranks have agreed to stop."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args)
        if args.export:
            return export(cfg, args)
        return train(cfg, args)
    except DistsetupError as e:
        print(f"error: {e.format_message()}", file=sys.stderr)
        return e.exit_code


def exit_now(status: int) -> None:
    """Leave without the interpreter's slow teardown: once one rank of a preempted job exits, torchrun sends
    SIGTERM to the others, and a rank still tearing down (handlers already reset) would die of it (-15)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def export(cfg, args) -> int:
    from distsetup.training.export import export_weights

    used, count = export_weights(Path(cfg.training.output_dir) / "checkpoints", Path(args.export), args.export_dtype)
    print(f"exported {count} tensors ({args.export_dtype}) from {used} to {args.export}")
    return 0


def train(cfg, args) -> int:
    import torch
    from tqdm import tqdm

    from distsetup.formats.checkpoint_folder import find_resume, read_meta
    from distsetup.training import checkpoint as ckpt
    from distsetup.training import universal_folder
    from distsetup.training.backends import make_backend
    from distsetup.training.data import ShardedSampler, build_datasets, loss_weights
    from distsetup.training.evaluation import evaluate
    from distsetup.training.export import load_weights
    from distsetup.training.metrics import MetricsLog, StepTimer, reporters
    from distsetup.training.model import build_model, check_model_fits, layer_modules
    from distsetup.training.run_lock import OutputDirLock
    from distsetup.training.throughput import device_peak_tflops, flops_per_token, mfu
    from distsetup.training.world import (
        StepAgreement,
        barrier,
        decided_by_rank0,
        destroy_process_group,
        init_process_group,
        is_lost_contact,
        lost_contact,
        pick_device,
        read_world,
    )

    # config -> backend: every check that can fail does so here, before any process group or training
    t = cfg.training
    world = read_world()
    say = print if world.is_main else (lambda *a, **k: None)
    backend_name = cfg.distributed.backend
    device = pick_device(world)
    backend = make_backend(backend_name, cfg, world, device)
    backend.check_device_support()
    global_batch = backend.micro_batch * backend.accumulation * world.size
    lr_scaled = t.scale_lr != "none" and not backend.lr_from_file  # a file's lr is used as written
    if lr_scaled:
        backend.lr = scaled_lr(t.lr, global_batch, t.base_batch_size, t.scale_lr)
    check_model_fits(cfg, world.local_size)
    report_to = reporters(t.report_to)
    out_dir, ckpt_root = Path(t.output_dir), Path(t.output_dir) / "checkpoints"
    lock = OutputDirLock(out_dir)
    if world.is_main:
        lock.acquire()
        if not lock.unsupported:  # without a lock another run could be loading one
            universal_folder.remove_stale(out_dir)
    preemption = Preemption()

    step, metrics, bar, status = 0, None, None, 1  # status: what the run exits with
    init_process_group(world, backend_name, device, cfg.distributed.timeout_minutes)
    try:
        # Rank 0 alone reads the checkpoint folders and every rank takes its answer: on a shared file system
        # another node may see the newest marker late, and ranks resuming different steps would diverge.
        resume, damaged = decided_by_rank0(lambda: (None, []) if args.no_resume else find_resume(ckpt_root))
        model_section = dataclasses.asdict(cfg.model)  # checked against a checkpoint's, stored in each new one
        if resume:
            resume_meta = read_meta(resume)
            ckpt.check_compatible(resume_meta, resume, model_section)
            if conversion := backend.adopt(resume, resume_meta):
                say(conversion)
        elif damaged:
            raise DistsetupError(
                f"no intact checkpoint to resume from: {damaged[0]}.",
                "move the damaged folder aside, or start afresh with --no_resume.",
            )
        for problem in damaged:
            say(f"passed over damaged checkpoint {problem}")
        if lock.unsupported:
            say(f"note: {lock.unsupported}")
        say(
            f"backend {backend.name}{'' if backend.zero_stage is None else f' (ZeRO-{backend.zero_stage})'} "
            f"on {world.size} x {device.type}; global batch {global_batch} = micro {backend.micro_batch} x "
            f"accumulation {backend.accumulation} x world {world.size}"
        )
        if lr_scaled:
            say(f"lr scaled ({t.scale_lr}) to {backend.lr:.6g} for global batch {global_batch}")

        if args.no_resume and world.is_main and ckpt_root.exists():  # else a later resume picks a stale step
            aside = ckpt_root.with_name(f"checkpoints.before-{time.strftime('%Y%m%d-%H%M%S')}")
            ckpt_root.rename(aside)
            say(f"--no_resume: moved the old checkpoints to {aside}")
        barrier()

        # data: rank 0 tokenizes text into the cache (the others wait), every rank memory-maps it
        data = build_datasets(cfg, eval_batch=backend.micro_batch * world.size)
        for note in data.notes:
            say(note)
        sampler = ShardedSampler(
            len(data.train), backend.micro_batch, backend.accumulation, world.size, world.rank, t.seed
        )
        if t.epochs is not None:  # before wrap(): the learning-rate schedule spans the whole run
            t.max_steps = t.epochs * (len(data.train) // global_batch)
            say(f"{t.epochs} epochs of {len(data.train) // global_batch} steps: {t.max_steps} steps")

        # model (same seed on every rank: identical initial weights), then wrap
        torch.manual_seed(t.seed)
        model, layer_classes = build_model(cfg)
        blocks = layer_modules(model, layer_classes)
        flops = flops_per_token(model, cfg.model.block_size)  # counted before sharding: the whole model
        peak = t.peak_tflops or device_peak_tflops(device, backend.precision)
        if args.init_from:
            load_weights(model, args.init_from)
        backend.wrap(model, blocks)
        for note in backend.notes:  # after wrap(): it adds notes of its own
            say(f"note: {note}")
        torch.manual_seed(t.seed + world.rank)  # dropout differs per rank

        loss = float("nan")
        if resume:
            meta = ckpt.load_checkpoint(backend, resume, world)
            sampler.load_state_dict(meta["sampler"])
            step, loss = meta["step"], meta.get("loss", loss)
            say(f"resumed from {resume} (step {step})")
            if meta["sampler"]["global_batch"] != global_batch:
                say(
                    f"note: the checkpoint's global batch was {meta['sampler']['global_batch']}, this run's is "
                    f"{global_batch}: continuing from sample {sampler.position} of epoch {sampler.epoch}"
                )
        meta = {
            "backend": backend.name,
            "zero_stage": backend.zero_stage,
            "precision": backend.precision,
            "model": model_section,  # what `distsetup checkpoint export` writes beside the weights
        }

        # loop (the timer leaves checkpoint writes out of the throughput)
        out_dir.mkdir(parents=True, exist_ok=True)
        wandb_settings = {
            "project": t.wandb_project,
            "name": t.run_name,
            "tags": t.wandb_tags,
            "config": dataclasses.asdict(cfg),
            "resumed": resume is not None,  # continues the W&B run of the checkpoint's run; else a new one
        }
        metrics = MetricsLog(out_dir, world.is_main, report_to, wandb_settings)
        tokens_per_step = global_batch * cfg.model.block_size
        logged = (step, 0.0)  # the step and training seconds of the last log line: tokens/s since then
        bar = tqdm(total=t.max_steps, initial=step, disable=not world.is_main, dynamic_ncols=True)
        timer, first_step = StepTimer(), step
        agreement = StepAgreement(world.size, device)
        pending = None  # training.async_checkpoint: the checkpoint whose ranks are still writing in the background
        evals: list[dict] = []

        def logs_at(step: int) -> bool:
            return step % t.log_interval == 0 or step == t.max_steps

        while step < t.max_steps:
            lr = backend.current_lr()
            batches = [data.train.batch(idx) for idx in sampler.next_step()]
            weights = [1.0] * len(batches)
            if data.train.masked:  # micro-batches count different numbers of targets
                weights = loss_weights([y for _, y in batches], world.size, device)
            micro_losses = [
                backend.backward(x.to(device), y.to(device), m == backend.accumulation - 1, weight)
                for m, ((x, y), weight) in enumerate(zip(batches, weights, strict=True))
            ]
            # the fp16 loss scale this step's backward used, read only for a step that logs (on a GPU, a sync)
            scale = backend.current_loss_scale() if logs_at(step + 1) else None
            backend.step()
            step += 1
            timer.step_done()
            bar.update(1)
            log_now = logs_at(step)
            checkpoint_now = step % t.checkpoint_interval == 0 or step == t.max_steps
            stop = False
            if log_now or checkpoint_now or agreement.due(step):
                step_seconds = timer.median_step_seconds
                assert step_seconds is not None  # step_done() above recorded a step
                writing = pending is not None and not pending.written_here()
                loss, stop, written = agreement.settle(step, micro_losses, preemption.requested, step_seconds, writing)
                if pending is not None and written:  # every rank's part is on disk: it completes, at the same step
                    pending.finish(world, backend)
                    pending = None
            if log_now or stop:
                steps, seconds = step - logged[0], timer.train_seconds - logged[1]
                tokens_per_s = steps * tokens_per_step / max(seconds, 1e-9)
                logged = (step, timer.train_seconds)
                metrics.write(
                    step,
                    loss=loss,
                    lr=lr,
                    tokens_per_s=tokens_per_s,
                    mfu=mfu(tokens_per_s, flops, world.size, peak),
                    loss_scale=scale,
                )
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
            eval_now = step == t.max_steps or (t.eval_interval is not None and step % t.eval_interval == 0)
            if data.val is not None and eval_now and not stop:
                with timer.evaluating():
                    result = evaluate(backend, data.val, world.rank, world.size, device)
                evals.append({"step": step, **result})
                metrics.write(step, "eval", **result)
                if world.is_main:
                    bar.write(
                        f"step {step}: validation loss {result['val_loss']:.4f}, "
                        f"perplexity {result['val_perplexity']:.2f}"
                    )
            if stop or checkpoint_now:
                with timer.checkpointing():
                    if pending is not None:  # the one before completes first
                        pending.finish(world, backend)
                    background = t.async_checkpoint and not stop  # a preempted run leaves a complete checkpoint
                    sampler_state = sampler.state_dict()
                    pending = ckpt.start_checkpoint(
                        backend,
                        ckpt_root,
                        step,
                        world,
                        {**meta, "loss": loss, "sampler": sampler_state},
                        t.keep_checkpoints,
                        background,
                    )
                    if not background:
                        pending.finish(world, backend)
                        pending = None
            if stop:
                say(f"preempted: checkpoint at step {step}")
                status = PREEMPTED
                return PREEMPTED
        if pending is not None:
            with timer.checkpointing():
                pending.finish(world, backend)
        bar.close()

        # teardown: rank 0's summary; the process group goes in `finally`
        if world.is_main:
            seconds = timer.train_seconds
            steps_per_s = (step - first_step) / max(seconds, 1e-9)
            summary = {
                "steps": step,
                "final_loss": loss,
                "val_loss": evals[-1]["val_loss"] if evals else None,
                "val_perplexity": evals[-1]["val_perplexity"] if evals else None,
                "evals": evals,
                "world_size": world.size,
                "backend": backend.name,
                "tokens_per_s": steps_per_s * tokens_per_step,
                "mfu": mfu(steps_per_s * tokens_per_step, flops, world.size, peak),
                "peak_tflops": peak,
                "flops_per_token": flops,
                "steps_per_s": steps_per_s,
                "train_seconds": seconds,
                "checkpoint_seconds": timer.checkpoint_seconds,
                "checkpoint_stalls": timer.checkpoint_stalls,
                "eval_seconds": timer.eval_seconds,
                "median_step_seconds": timer.median_step_seconds,
                "zero_stage": backend.zero_stage,
                "precision": backend.precision,
                "memory": backend.memory,
                "peak_activation_bytes": backend.activation_bytes,
                "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            }
            (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            metrics.summarize(summary)
            say(
                f"done: {step} steps, final loss {loss:.4f}, {summary['tokens_per_s']:.0f} tokens/s; "
                f"summary in {out_dir / 'summary.json'}"
            )
        status = 0
        return 0
    except BaseException as e:  # DCP's CheckpointException is no Exception
        if is_lost_contact(e):  # a collective failed or timed out: another rank is gone
            raise lost_contact(e, world, step, cfg.distributed.timeout_minutes) from None
        raise
    finally:
        try:
            if bar is not None:
                bar.close()
            if metrics is not None:  # also when training raised: the last metrics line reaches the disk
                metrics.close(status, preempted=status == PREEMPTED)
        finally:
            destroy_process_group()
            lock.release()


def run(argv=None) -> None:
    """The process's whole life: train (or export), then exit with the status."""
    status = main(argv)
    if status == PREEMPTED:
        exit_now(status)
    sys.exit(status)


if __name__ == "__main__":
    run()
