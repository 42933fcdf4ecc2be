"""`distsetup job`: one run config as the job spec of a Kubernetes engine (Kubeflow Trainer's TrainJob, JobSet,
the training-operator's PyTorchJob), with the entry point every node runs (entry.py), the schemas and rules they
are checked by (schema.py; rules.py, by object_rules.py and file_rules.py), and the engines' own names and
variables (engines.py). Nothing here imports torch."""
