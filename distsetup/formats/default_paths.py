"""Where distsetup puts a run's files unless a flag says otherwise: what `distsetup init` writes, what the launch
commands and doctor look for, and what plan --write and the run config's hints name."""

CONFIG_FOLDER = "config"
RUN_CONFIG = f"{CONFIG_FOLDER}/config.yaml"
BACKEND_FILE_NAMES = {"deepspeed": "ds_config.json", "fsdp": "fsdp_config.json"}  # in CONFIG_FOLDER
BACKEND_FILES = {backend: f"{CONFIG_FOLDER}/{name}" for backend, name in BACKEND_FILE_NAMES.items()}
SCRIPTS = {"local": "scripts/run_training.sh", "slurm": "scripts/slurm_job.sh"}  # by scheduler
