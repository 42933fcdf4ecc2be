"""The files distsetup reads and writes: the DeepSpeed file, the FSDP file and the run config. Each format's
rules (batch identity, precision, ZeRO stage and offload coupling, defaults) and which of a run config and its
backend file decides a setting both hold (settle.py) are written here once; the commands, `validate`, `doctor`,
`plan --write` and the trainer all call them. `doctor` adds only what it alone is given: a file named beside a run
config whose backend would ignore it. No Click, no torch."""
