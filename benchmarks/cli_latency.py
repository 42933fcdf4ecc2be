"""Benchmark 1: how fast distsetup's commands answer, beside `accelerate config default` and
`deepspeed --help` (both import torch). Ratios of medians measured alternately in one run."""

import argparse
import compileall
import tempfile
from pathlib import Path

from common import BIN, REPO, alternate, record, table, timed_run

GOAL = 10.0


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    # As `pip install` does: an editable checkout under PYTHONDONTWRITEBYTECODE would compile every run.
    compileall.compile_dir(REPO / "distsetup", quiet=1)
    distsetup = str(BIN / "distsetup")
    ours = {
        "deepspeed": [distsetup, "deepspeed", "--zero_stage", "3", "--offload_param", "--bf16", "-o", work / "ds.json"],
        "fsdp": [distsetup, "fsdp", "--mixed_precision", "BFLOAT16", "-o", work / "fsdp.json"],
        "validate": [distsetup, "validate", REPO / "config" / "config.yaml"],
    }
    for name, argv in [
        (
            "launcher",
            [
                distsetup,
                "launcher",
                "--config",
                REPO / "config" / "config.yaml",
                "--num_gpus_per_node",
                "2",
                "-o",
                work / "run.sh",
            ],
        ),
        (
            "slurm",
            [
                distsetup,
                "slurm",
                "--config",
                REPO / "config" / "config.yaml",
                "--num_nodes",
                "2",
                "--num_gpus_per_node",
                "8",
                "--time_limit",
                "1:00:00",
                "-o",
                work / "job.sh",
            ],
        ),
    ]:
        try:
            timed_run(argv, cwd=REPO)
            ours[name] = argv
        except RuntimeError:
            print(f"(skipping distsetup {name}: not available)")
    counter = iter(range(10**6))
    references = {
        "accelerate config default": lambda: [
            str(BIN / "accelerate"),
            "config",
            "default",
            "--config_file",
            str(work / f"acc{next(counter)}.yaml"),
        ],
        "deepspeed --help": lambda: [str(BIN / "deepspeed"), "--help"],
    }
    measures = {f"distsetup {n}": (lambda a=a: timed_run(a, cwd=REPO)) for n, a in ours.items()}
    measures.update({n: (lambda make=make: timed_run(make(), cwd=work)) for n, make in references.items()})
    medians = alternate(measures, args.repeats)
    slowest_ref = min(medians[n] for n in references)
    rows = []
    for name in measures:
        ratio = slowest_ref / medians[name] if name.startswith("distsetup") else ""
        rows.append([name, medians[name] * 1000, ratio])
    ours_worst = max(medians[f"distsetup {n}"] for n in ours)
    verdict = slowest_ref / ours_worst
    text = table(["command", "median ms", "faster than the quicker reference (x)"], rows)
    text += (
        f"\n\nSlowest distsetup command vs quicker reference: {verdict:.1f}x "
        f"(goal >= {GOAL:.0f}x: {'met' if verdict >= GOAL else 'NOT met'}); "
        f"medians of {args.repeats} alternating runs."
    )
    record("CLI latency", text)


if __name__ == "__main__":
    main()
