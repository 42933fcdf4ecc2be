"""Train a model (the built-in GPT, a local Hugging Face causal LM, or your own: model.type python) on one process,
DDP, FSDP2 or DeepSpeed ZeRO 0-3.

    python -m distsetup.train --config config/config.yaml distributed.backend=single   # one process
    torchrun --nproc_per_node 2 -m distsetup.train --config config/config.yaml        # backend from the config
    deepspeed --num_gpus 2 --module distsetup.train --config config/config.yaml --deepspeed config/ds_config.json
    python -m distsetup.train --config config/config.yaml training.max_steps=50        # any key: section.key=value
    python -m distsetup.train --config config/config.yaml --export runs/demo/model.pt --export_dtype bf16
    python -m distsetup.train --config config/config.yaml distributed.backend=single --init_from runs/demo/model.pt
    python -m distsetup.train --config config/config.yaml --check   # read the config as a run would; nothing runs

`src/train.py` (the name the guides use) runs the same: `torchrun --nproc_per_node 2 src/train.py ...`.

Without GPUs it runs on the CPU with gloo; with GPUs, one process per GPU (LOCAL_RANK) with NCCL.
Checkpoints go to training.output_dir/checkpoints/step_NNNNNNN/ and the run resumes from the newest
complete one (--no_resume starts afresh). SIGTERM or SIGUSR1 make every rank, within about a second (or a
step, if longer), checkpoint at the same step and exit with status 75 (EX_TEMPFAIL: "try again later"); a
first Ctrl-C while training does too, with status 130 (a second stops at once).
The sbatch script of `distsetup slurm --requeue` requeues from its trap of SLURM's warning signal (USR1),
after the ranks have checkpointed; a job whose ranks were stopped otherwise (`scancel --signal=TERM`, a
user's signal) ends there, its checkpoint ready for the next `sbatch`, which resumes from it.
"""

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from distsetup.errors import DistsetupError, refuse_arguments_not_in_utf8
from distsetup.formats.runconfig import RunConfig, names_user_code, resolve_config_path
from distsetup.formats.runconfig_load import load_run_config
from distsetup.formats.runconfig_rules import missing_file_fix
from distsetup.training.host_allocator import ask_for_huge_pages, map_large_tensors_apart
from distsetup.training.launch_env import World, read_world, sigterm_when_the_launcher_dies

if TYPE_CHECKING:
    from distsetup.training.trainer import Trainer


# Seconds after which a run prints every thread's stack to stderr, and again each time as many pass (the tests set it
# below their timeout, so that a run that hangs shows where)
STACKS_AFTER = "DISTSETUP_STACKS_AFTER_S"


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
    p.add_argument(
        "--init_from",
        metavar="FILE.pt",
        help="start from weights written by --export (or by `distsetup checkpoint export`: its folder)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="read the run config with these arguments as a run would, then exit: 0, or 1 with one line saying the "
        "problem (the launch scripts run it once before they start any process, with WORLD_SIZE the world they "
        "launch where they know it)",
    )
    return p.parse_intermixed_args(argv)  # overrides may follow options, as launcher scripts pass them


def config_folder(args) -> Path | None:
    """The run config's folder: its relative paths, and the user's modules, are found there."""
    return Path(args.config).parent if args.config else None


def init_from_weights(init_from: str) -> str:
    """--init_from's file: the one given, or model.safetensors in a folder `distsetup checkpoint export` wrote; one
    line, before the run sets up, where there is none."""
    path = Path(init_from)
    if path.is_dir() and (path / "model.safetensors").is_file():
        return str(path / "model.safetensors")
    if not path.is_file():
        there = "is a folder without model.safetensors" if path.is_dir() else "does not exist"
        raise DistsetupError(
            f"--init_from {init_from} {there}.",
            "name a file written by --export, or the folder `distsetup checkpoint export` writes by default (a "
            "--format hf folder is read as model.hf_path).",
        )
    return init_from


def load_config(args):
    """The run config, with --deepspeed folded in and every file it names resolved as validation resolves it; and
    --init_from's file found (init_from_weights: from the working folder)."""
    for flag in ("config", "deepspeed", "export", "init_from"):
        value = getattr(args, flag)
        if value is not None and not value.strip():
            raise DistsetupError(f"--{flag} is empty.", f"name a file after --{flag}, or leave the option out.")
    if args.export and Path(args.export).is_dir():
        raise DistsetupError(
            f"--export {args.export} is a folder.", f"name a file, e.g. {Path(args.export) / 'model.pt'}."
        )
    if args.init_from:
        args.init_from = init_from_weights(args.init_from)
    base_dir = config_folder(args)
    if args.deepspeed and not resolve_config_path(args.deepspeed, base_dir).is_file():
        raise DistsetupError(
            f"--deepspeed {args.deepspeed}: file {args.deepspeed} does not exist.",
            missing_file_fix("deepspeed_config"),  # as the launcher says it of --deepspeed_config
        )
    overrides = list(args.overrides)
    if args.deepspeed:  # the launch scripts' flag: a key=value of the user's after it still wins, as they say
        overrides = ["distributed.backend=deepspeed", f"distributed.deepspeed_config={json.dumps(args.deepspeed)}"]
        overrides += args.overrides
    return load_run_config(args.config, overrides).resolved(base_dir)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, stopped_during_set_up)  # until the trainer takes SIGTERM over (preemption.py)
    if (seconds := os.environ.get(STACKS_AFTER, "")).isdigit():  # the tests': where a run that hangs waits
        faulthandler.dump_traceback_later(int(seconds), repeat=True)
    try:
        refuse_arguments_not_in_utf8(sys.argv[1:] if argv is None else argv)
        cfg = load_config(args)
        if args.check:
            check_the_world(cfg, config_folder(args))
            if names_user_code(cfg):  # its imports take a while (torch): only where there is some
                from distsetup.training import user_code

                user_code.check_references(cfg, config_folder(args))
                if cfg.model.type == "python" and user_code.imports_here(cfg.model.builder):
                    check_the_model(cfg)
            elif cfg.model.type == "hf" and names_model_classes(cfg):  # transformers' import takes seconds: only then
                check_the_model(cfg)
            return 0
        if args.export:
            return export(cfg, args)
        sigterm_when_the_launcher_dies()  # a rank that trains
        trainer = prepare(cfg, args)
    except DistsetupError as e:  # found before any process group: in the input, which every rank reads alike
        return say(e) if args.check else say_once_per_node(e)
    try:
        return trainer.run()
    except DistsetupError as e:  # this rank's own (a lost peer, a checkpoint): every rank says its own
        return say_once_per_node(e) if e.alike_on_every_rank else say(e)


def names_model_classes(cfg: RunConfig) -> bool:
    """Whether the run config names classes of its model, or settings that depend on them, which only the model
    built tells: its blocks, ZeRO-3 leaves, the FSDP settings' units, DDP told not to look for unused parameters."""
    m, d = cfg.model, cfg.distributed
    return bool(m.layer_classes or m.zero3_leaf_classes) or d.backend == "fsdp" or d.find_unused_parameters is False


def check_the_model(cfg: RunConfig) -> None:
    """--check: the model built on the meta device and described as every rank describes it, and what the backend's
    settings ask of it (the FSDP settings' classes, DDP's unused parameters), as the ranks check it."""
    from distsetup.training.model.build import check_on_meta

    description = check_on_meta(cfg.model)
    if description is None:
        return
    if cfg.distributed.backend == "fsdp":
        from distsetup.formats.validate import read_fsdp_settings
        from distsetup.training.backends.fsdp import check_wrapped_classes

        check_wrapped_classes(cfg, read_fsdp_settings(cfg), description)
    if cfg.distributed.backend == "ddp":
        from distsetup.training.backends.ddp import check_unused_parameters_setting

        check_unused_parameters_setting(cfg, description)


def check_the_world(cfg: RunConfig, base_dir: Path | None) -> None:
    """--check: the backend's file, read as the ranks read it, and what the launch's world needs of the run config
    (backend single trains one process, a DeepSpeed file's batch is that of one world) where WORLD_SIZE says the
    world (the launch scripts set it for the check where they know it)."""
    from distsetup.formats.validate import settle_run_config  # the check's alone: not on every rank's way

    size = os.environ.get("WORLD_SIZE", "")
    world_size = int(size) if size.isdigit() and int(size) > 0 else None
    if problems := settle_run_config(cfg, base_dir, world_size).problems:
        raise problems[0].as_error()


def say(error: DistsetupError) -> int:
    """The error in one line; the status to exit with."""
    print(f"error: {error.format_message()}", file=sys.stderr, flush=True)
    return error.exit_code


# How long a silent rank gives the rank that says an error to say it and exit (the launcher then stops this one).
SPEAKER_HEAD_START_S = 10.0


def say_once_per_node(error: DistsetupError) -> int:
    """An error every rank finds alike (before the process group: the run config, a builder that cannot be
    imported; after it: the data), said by one rank per node rather than by every rank (speaks_for_its_node). The
    others exit with the same status, silently, once the launcher (torchrun, the deepspeed launcher), seeing that rank
    gone, stops them with SIGTERM; exiting first, they would have it stop that rank before it said anything. A rank
    still running after SPEAKER_HEAD_START_S says its error itself: then it was its own (the first rank went on)."""
    for sig in (signal.SIGTERM, signal.SIGINT):  # from now on
        signal.signal(sig, lambda *_: exit_now(error.exit_code))
    if not speaks_for_its_node(read_world()):
        time.sleep(SPEAKER_HEAD_START_S)
    return say(error)


def stopped_during_set_up(*_) -> None:
    """SIGTERM before the trainer takes it over: a preemption with nothing to checkpoint yet, said by the node's
    first rank, or the launcher stopping the ranks because another rank said an error every rank finds
    (say_once_per_node): that rank has exited, and these exit silently, with its status (1; torchrun's summary
    lists every rank's). The entry points that requeue or restart a job know a preemption by the signal they got
    themselves."""
    if speaks_for_its_node(read_world()):  # os.write: a print here could interrupt a print (reentrant)
        os.write(
            2,
            b"stopped by SIGTERM during set-up (a preemption, or the launcher ending the ranks after another failed)\n",
        )
    exit_now(DistsetupError.exit_code)


def speaks_for_its_node(world: World) -> bool:
    """Whether this rank says the errors every rank finds alike: the first of its node (LOCAL_RANK 0). Where no
    launcher set LOCAL_RANK, read_world takes every rank to share one node (local size = world size) and gives each
    local rank 0: there rank 0 alone."""
    return world.local_rank == 0 and (world.rank == 0 or world.local_size < world.size)


def exit_now(status: int) -> None:
    """Leave without the interpreter's teardown, once the run has closed its files: once one rank of a preempted
    job exits, torchrun sends SIGTERM to the others, and a rank still tearing down (handlers already reset) would die
    of it (-15); and destroying a process group whose peer died can deadlock (gloo's worker thread waits for the GIL
    that the destructor holds)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def export(cfg: RunConfig, args: argparse.Namespace) -> int:
    if read_world().rank != 0:  # started under a launcher: one writer, one line (the others' would race it)
        return 0
    from distsetup.training.world import name_the_cpu_to_deepspeed

    name_the_cpu_to_deepspeed()
    from distsetup.training.checkpoint.export import export_weights

    used, count = export_weights(Path(cfg.training.output_dir) / "checkpoints", Path(args.export), args.export_dtype)
    print(f"exported {count} tensors ({args.export_dtype}) from {used} to {args.export}")
    return 0


# The runs of this process, kept until it leaves (exit_now): their torch objects are never destroyed (see exit_now).
_RUNS: list = []


def prepare(cfg: RunConfig, args: argparse.Namespace) -> "Trainer":
    """The run, with every check that can fail before the process group done (distsetup.training.trainer.Trainer)."""
    ask_for_huge_pages()
    from distsetup.training.trainer import Trainer

    trainer = Trainer(cfg, config_folder=config_folder(args), no_resume=args.no_resume, init_from=args.init_from)
    if trainer.backend.gathers_weights:
        map_large_tensors_apart()
    _RUNS.append(trainer)
    return trainer


def run(argv=None) -> None:
    """The process's whole life: train (or export), then exit with the status."""
    exit_now(main(argv))


if __name__ == "__main__":
    run()
