"""The options `distsetup launcher`, `distsetup slurm` and `distsetup job` share (launch_options.py), turned into a
LaunchSpec: the backend and its file from the flags or the run config, the GPUs and processes, every file checked for
the world it launches."""

import os
from dataclasses import replace
from pathlib import Path

from distsetup.errors import DistsetupError
from distsetup.formats.accelerate import own_program_notes
from distsetup.formats.default_paths import BACKEND_FILES, RUN_CONFIG
from distsetup.formats.fsdp import FsdpSpec, accelerate_launch_args
from distsetup.formats.runconfig import PYTHON_REFERENCES, RunConfig, resolve_config_path
from distsetup.formats.runconfig_load import (
    backend_chosen_by,
    backend_of,
    check_run_config,
    read_run_config,
    run_config_from,
)
from distsetup.formats.settle import settle
from distsetup.formats.validate import read_valid
from distsetup.scripts.environment import EnvSpec
from distsetup.scripts.launch_flags import FLAG_VARIABLES, parse_gpus
from distsetup.scripts.launch_plan import LaunchSpec, check_launch


def launch_spec_from_options(o: dict, slurm: bool = False, files_here: bool = True) -> tuple[LaunchSpec, list[str]]:
    """Options -> (LaunchSpec, notes for stderr): backend and files from the flags or the run config, GPUs
    resolved, the DeepSpeed file checked for this world. `files_here`: whether the data and code the run config
    names are looked for on this machine (not for a pod, whose image and volume hold them)."""
    _refuse_flags_that_conflict(o)
    found_config = _found_run_config(o)
    o = {**o, "config": o["config"] or found_config}
    backend, files, notes, run_config, from_run_config = distributed_settings(o, files_here)
    if found_config:
        notes.insert(0, f"using {found_config} for the trainer (none given with --config).")
    # accelerate launch takes the backend's file as its own flags, fixed in the script: the trainer is given it too
    from_run_config = from_run_config and o["launch_method"] != "accelerate"
    spec = replace(_spec(o, backend, files, slurm), backend_from_run_config=from_run_config)
    check_launch(spec)  # node and GPU counts first: the file checks below need a sane world size
    spec = _several_processes_with_ddp(spec, notes)
    if spec.env.timeout_minutes is not None and not spec.runs_default_trainer:
        notes.append(
            "--timeout_minutes is distsetup's trainer's collective timeout: your program sets its own "
            "(torch.distributed.init_process_group(timeout=...), Accelerate's InitProcessGroupKwargs(timeout=...))."
        )
    return _with_backend_files_checked(spec, run_config, notes), notes


def _several_processes_with_ddp(spec: LaunchSpec, notes: list[str]) -> LaunchSpec:
    """Backend single trains one process: distsetup's trainer launched on several (or on every GPU found) trains
    them with DDP, as `distsetup init` chooses for several, and says so (the run config still says single, which the
    script overrides). A program of the user's gets no backend from the script."""
    if spec.backend != "single" or spec.world_size == 1 or not spec.runs_default_trainer:
        return spec
    processes = f"{spec.world_size} processes" if spec.world_size else "processes (one a GPU)"
    notes.append(
        f"distributed.backend single trains one process: the script trains its {processes} with ddp "
        "(set distributed.backend: ddp in the run config to say so there)."
    )
    return replace(spec, backend="ddp", backend_from_run_config=False)


def _refuse_flags_that_conflict(o: dict) -> None:
    """Flags that name two backends, or set one variable twice; refused before any file is read."""
    if o["use_deepspeed"] and o["use_fsdp"]:
        raise DistsetupError("--use_deepspeed and --use_fsdp are mutually exclusive.", "choose one backend.")
    # the backend not trained with lost its flag without a word
    for given, others in (
        ("deepspeed_config", ("fsdp_config", "use_fsdp")),
        ("fsdp_config", ("deepspeed_config", "use_deepspeed")),
    ):
        other = next((name for name in others if o[name]), None)
        if o[given] and other:
            raise DistsetupError(
                f"--{given} and --{other} name two backends (DeepSpeed and FSDP); a run trains with one.",
                "give the flags of the backend you train with.",
            )
    if o["script"] and o["python_module"]:  # check_launch says it too, after the files: said before them
        raise DistsetupError("--script and --python_module are mutually exclusive.", "give one of them.")
    for key, _ in o.get("env_pairs") or ():  # both exported, the later silently
        if (flag := FLAG_VARIABLES.get(key)) and o.get(flag) is not None:
            raise DistsetupError(f"--env {key}=... and --{flag} both set {key}.", "give one of them.")


def _spec(o: dict, backend: str, files: dict[str, str], slurm: bool) -> LaunchSpec:
    gpus, nproc = _gpus_and_nproc(o.get("gpus"), o["num_gpus_per_node"])
    return LaunchSpec(
        backend=backend,
        launch_method=o["launch_method"],
        script=o["script"],
        module=o["python_module"],
        workdir=working_folder(),
        config=o["config"],
        deepspeed_config=files.get("deepspeed"),
        fsdp_config=files.get("fsdp"),
        num_nodes=o["num_nodes"],
        nproc_per_node=nproc,
        node_rank=o.get("node_rank"),
        master_addr=o.get("master_addr"),
        master_port=o["master_port"],
        rdzv_backend=o.get("rdzv_backend") or ("c10d" if slurm and o["launch_method"] == "torchrun" else "static"),
        rdzv_id=o.get("rdzv_id") or "distsetup",
        hosts=tuple(h.strip() for h in o["hosts"].split(",")) if o.get("hosts") else (),
        ssh=bool(o.get("ssh")),
        gpus=gpus,
        env=EnvSpec(
            o["omp_num_threads"],
            o["nccl_debug"],
            o["nccl_socket_ifname"],
            o["nccl_ib_disable"],
            o["timeout_minutes"],
            o["cuda_device_max_connections"],
            tuple(o.get("env_pairs") or ()),
        ),
        preflight=o["preflight"],
    )


def _with_backend_files_checked(spec: LaunchSpec, run_config: RunConfig | None, notes: list[str]) -> LaunchSpec:
    """The spec once its backend files pass what `distsetup validate` checks (for the world it launches), the
    DeepSpeed file settled against the run config the trainer will read; an FSDP file's settings passed to
    accelerate launch, and what accelerate refuses in a user's program added to `notes`."""
    # Exactly what `distsetup validate` checks. "auto" only where the script may be the HF Trainer, which fills
    # it in: distsetup's trainer hands the file to DeepSpeed as is, and every rank would fail.
    if ds_path := spec.deepspeed_config:
        ds = read_valid(ds_path, "deepspeed", spec.world_size, hf=not spec.runs_default_trainer)
        if run_config is not None and spec.runs_default_trainer:  # the pair the trainer will settle, settled now
            for problem in settle(run_config, ds, None, spec.world_size, f"DeepSpeed file {ds_path}").problems:
                raise problem.as_error()
        if spec.launch_method == "accelerate" and not spec.runs_default_trainer:
            notes += own_program_notes(ds, ds_path)
    if spec.fsdp_config:
        # a program of the user's may be the HF Trainer, which reads the file itself but under accelerate
        hf_trainer = not spec.runs_default_trainer and spec.launch_method != "accelerate"
        fsdp = read_valid(spec.fsdp_config, "fsdp", hf=hf_trainer)
        settings = FsdpSpec.from_dict(fsdp)
        if run_config is not None and spec.runs_default_trainer:  # the pair the trainer will settle, settled now
            for problem in settle(run_config, None, settings, spec.world_size).problems:
                raise problem.as_error()
        if spec.launch_method == "accelerate":
            args = tuple(accelerate_launch_args(fsdp))
            spec = replace(spec, accelerate_fsdp_args=args, accelerate_hybrid_shard=settings.hybrid_fsdp2)
        elif not spec.runs_default_trainer and settings.fsdp_version == 1:
            spec = replace(spec, fsdp1_strategy=settings.sharding_strategy)
    return spec


def _found_run_config(o: dict) -> str | None:
    """config/config.yaml where distsetup's trainer runs without --config and `distsetup init` wrote one here, as
    config/ds_config.json is found for --use_deepspeed: the trainer would otherwise run on its built-in defaults. A
    user's own program owns its arguments, and gets none it was not given."""
    trainer = LaunchSpec(script=o["script"], module=o["python_module"]).runs_default_trainer
    if o["config"] or not trainer:
        return None
    return RUN_CONFIG if Path(RUN_CONFIG).is_file() else None


def working_folder() -> str:
    """This folder as an absolute path, the scripts' WORKDIR: spelled as the shell shows it ($PWD, which
    keeps the user's symbolic links, such as /home on a cluster) when that is this folder, else resolved."""
    here = os.getcwd()
    logical = os.environ.get("PWD", "")
    try:
        if os.path.isabs(logical) and os.path.samefile(logical, here):
            return logical
    except OSError:
        pass
    return here


# The run config's keys that name data, code or a model folder: a pod's come with its image or volume, and its own
# check (the entry point's `--check`) looks for them there
POD_FILES = (
    *(f"{section}.{key}" for section, key, *_ in PYTHON_REFERENCES),
    "data.paths",
    "data.val_paths",
    "model.hf_path",
    "model.tokenizer",
)


def distributed_settings(
    o: dict, files_here: bool = True
) -> tuple[str, dict[str, str], list[str], RunConfig | None, bool]:
    """(backend, {"deepspeed"|"fsdp": file}, notes, the run config read, whether the backend and its file are the
    run config's own) from the flags over the run config, checked as the run config is. Paths from the flags go
    into the config as the user typed them (never parsed as YAML), and every file is resolved as train.py resolves it
    (cwd, else next to the config), so the script names it from here. Without a file, config/ds_config.json or
    config/fsdp_config.json is used when it exists."""
    config = o["config"]
    base_dir = Path(config).parent if config else None
    raw = read_run_config(Path(config)) if config else {}
    dist = raw.setdefault("distributed", {})
    if not isinstance(dist, dict):
        dist = {}  # a schema problem: config_problems below names it
    # a backend's file names its backend, as its --use_ flag does (conflicts were refused before)
    flag = (
        "deepspeed"
        if o["use_deepspeed"] or o["deepspeed_config"]
        else "fsdp"
        if o["use_fsdp"] or o["fsdp_config"]
        else None
    )
    if flag:
        dist.update(backend_chosen_by(flag, o[f"{flag}_config"]))
    for kind in BACKEND_FILES:  # the other backend's file too: refused with its flag below
        if o[f"{kind}_config"]:
            dist[f"{kind}_config"] = o[f"{kind}_config"]
    backend = backend_of(dist)
    notes = []
    from_run_config = bool(config) and not flag and not any(o[f"{kind}_config"] for kind in BACKEND_FILES)
    if backend in BACKEND_FILES and not dist.get(f"{backend}_config"):
        default = BACKEND_FILES[backend]
        from_run_config = False  # the file found here, which the trainer would not look for
        if Path(default).is_file():
            dist[f"{backend}_config"] = default
            notes.append(f"using {default} for {backend} (none given with --{backend}_config or in the run config).")
        elif backend == "deepspeed":
            raise DistsetupError(
                "DeepSpeed needs a config file: none given with --deepspeed_config, none in the "
                f"run config, and no {default} here.",
                f"write one with `distsetup deepspeed --zero_stage 2 --output {default}` "
                "or pass --deepspeed_config FILE.",
            )
    checked = check_run_config(raw, base_dir)
    problems = checked.problems if files_here else [p for p in checked.problems if not p.path.startswith(POD_FILES)]
    for kind in BACKEND_FILES:  # a file the flags name: the flag's problem, not the run config's
        named = [p for p in problems if p.path == f"distributed.{kind}_config" and o[f"{kind}_config"]]
        if named:
            raise DistsetupError(f"--{kind}_config {o[f'{kind}_config']}: {named[0].message}", named[0].fix)
    if problems:
        where = f" in {config}" if config else ""
        raise DistsetupError(
            f"run config problem{where}: {problems[0]}",
            f"fix it (`distsetup validate {config}` lists every problem)." if config else None,
        )
    files = {
        kind: str(resolve_config_path(dist[f"{kind}_config"], base_dir))
        for kind in BACKEND_FILES
        if kind == backend and dist.get(f"{kind}_config")
    }
    return backend, files, notes, run_config_from(raw, checked) if config else None, from_run_config


def _gpus_and_nproc(gpus_text: str | None, num_gpus_per_node) -> tuple[tuple[int, ...] | None, int | None]:
    """(--gpus as indices, processes per node); auto:N asks distsetup.planning.gpus which GPUs are free now."""
    gpus = None
    if gpus_text:
        parsed = parse_gpus(gpus_text)
        if isinstance(parsed, int):
            from distsetup.planning.gpus import select_gpus  # lazy: NVML only when asked for

            parsed = tuple(select_gpus(parsed))
        gpus = parsed
    if num_gpus_per_node == "auto" or num_gpus_per_node is None:
        return gpus, (len(gpus) if gpus else None)
    return gpus, num_gpus_per_node  # check_launch rejects counts below 1
