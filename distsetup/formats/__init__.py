"""The files distsetup reads and writes: the DeepSpeed file, the FSDP file and the run config. Each format's
rules (batch identity, precision, ZeRO stage and offload coupling, defaults) are written here once; the
commands, `validate`, `doctor`, `plan --write` and the trainer all call them. No Click, no torch."""
