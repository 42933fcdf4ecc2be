"""`distsetup job`'s manifests against the engines' rules, offline: what it writes passes its engine's schema and the
rules the API servers, CEL and webhooks apply (distsetup/jobs/rules.py); a spec mutated as users get them wrong fails
with the path to fix. The entry point passes shellcheck. (What the command takes from its user: test_job_inputs.py;
the pods run for real in tests/processes/test_kubernetes_jobs.py.)"""

import copy

import pytest
import yaml
from golden_files import check_golden
from hostile_input import one_line_error
from job_projects import CONFIG, SKYPILOT, TARGETS, engine_object, job_project, objects, pod_spec, write
from shell_checks import shellcheck

from distsetup.jobs.rules import manifest_problems
from distsetup.jobs.spec import BUCKET_MOUNT, RESTART_STATUS


@pytest.fixture
def project(tmp_path, monkeypatch):
    return job_project(tmp_path, monkeypatch)


@pytest.mark.parametrize("target", TARGETS)
def test_each_target_is_valid_restarts_on_the_entry_points_status_and_says_how_to_submit(run_cli, project, target):
    result = write(run_cli, target)
    assert result.exit_code == 0, result.output
    assert f"Next: kubectl apply -f k8s/{target}.yaml" in result.stderr
    check_golden(f"job_{target}.yaml", (project / "k8s" / f"{target}.yaml").read_text())
    documents = objects(project, target)
    assert manifest_problems(documents) == []
    assert run_cli("validate", f"k8s/{target}.yaml").exit_code == 0
    files = documents[0]["data"]
    assert yaml.safe_load(files["config.yaml"]) == CONFIG  # the run config travels as it is
    entry = project / "entry.sh"
    entry.write_text(files["entry.sh"])
    shellcheck([entry])
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=290" in files["entry.sh"]  # the grace period, 300, less the exit's
    assert f"exit {RESTART_STATUS}\n" in files["entry.sh"]  # the status the engine's spec restarts on
    pod = pod_spec(documents)
    assert pod["terminationGracePeriodSeconds"] == 300
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in pod["volumes"]
    assert pod["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    found = engine_object(documents)
    if target == "pytorchjob":
        replicas = found["spec"]["pytorchReplicaSpecs"]
        assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 3)
        assert {r["restartPolicy"] for r in replicas.values()} == {"ExitCode"}  # recreated on 128-255: 143 is
        assert found["spec"]["nprocPerNode"] == "8"
        assert found["spec"]["runPolicy"] == {"cleanPodPolicy": "None"}  # no backoffLimit: it counts nothing here
    else:
        jobset = found["spec"]["template"]["spec"] if target == "trainjob" else found["spec"]
        job = jobset["replicatedJobs"][0]["template"]["spec"]
        assert (job["parallelism"], job["completions"], job["completionMode"]) == (4, 4, "Indexed")
        rules = job["podFailurePolicy"]["rules"]
        assert rules[0]["onExitCodes"]["values"] == [RESTART_STATUS] and rules[0]["action"] == "FailJob"
        restart = jobset["failurePolicy"]["rules"][0]
        assert restart["action"] == "RestartJobSetAndIgnoreMaxRestarts"
        assert restart["onJobFailureReasons"] == ["PodFailurePolicy"]
        assert restart["onJobFailureMessagePatterns"] == [f"exit code {RESTART_STATUS}"]
        assert jobset["failurePolicy"]["maxRestarts"] == 3
    if target == "trainjob":
        trainer = documents[-1]["spec"]["trainer"]
        assert (trainer["numNodes"], trainer["numProcPerNode"]) == (4, 8)


def mutated(documents: list[dict], change) -> list[dict]:
    copied = copy.deepcopy(documents)
    change(copied)
    return copied


def set_in(documents, kind: str, path: str, value):
    target = next(d for d in documents if d["kind"] == kind)
    *parents, last = path.split(".")
    for key in parents:
        target = target[int(key)] if key.isdigit() else target[key]
    target[last] = value


JOB = "spec.replicatedJobs.0.template.spec"
POD = f"{JOB}.template.spec"
RUNTIME_POD = f"spec.template.{POD}"
JOB_SHOWN, POD_SHOWN = (path.replace(".0.", "[0].") for path in (JOB, POD))  # as a problem's path says it
MUTATIONS = {  # name -> (target, kind, path, value, the problems' paths)
    "typo": ("jobset", "JobSet", f"{JOB}.completionMod", "Indexed", [f"JobSet/llm-run.{JOB_SHOWN}.completionMod"]),
    "auto": (
        "trainjob",
        "TrainJob",
        "spec.trainer.numProcPerNode",
        "auto",
        ["TrainJob/llm-run.spec.trainer.numProcPerNode"],
    ),
    "restart": (
        "jobset",
        "JobSet",
        f"{POD}.restartPolicy",
        "OnFailure",
        [f"JobSet/llm-run.{POD_SHOWN}.restartPolicy"],
    ),
    "nproc": ("pytorchjob", "PyTorchJob", "spec.nprocPerNode", "auto", ["PyTorchJob/llm-run.spec.nprocPerNode"]),
    "gpus": (
        "pytorchjob",
        "PyTorchJob",
        "spec.nprocPerNode",
        "4",
        ["PyTorchJob/llm-run.spec.pytorchReplicaSpecs.Master.template.spec.containers[0].resources.limits"],
    ),
    "master": (
        "pytorchjob",
        "PyTorchJob",
        "spec.pytorchReplicaSpecs.Master.replicas",
        2,
        ["PyTorchJob/llm-run.spec.pytorchReplicaSpecs.Master.replicas"],
    ),
    "workers": (
        "pytorchjob",
        "PyTorchJob",
        "spec.pytorchReplicaSpecs.Worker.replicas",
        0,
        ["PyTorchJob/llm-run.spec.pytorchReplicaSpecs.Worker.replicas"],
    ),
    "long name": (
        "jobset",
        "JobSet",
        "metadata.name",
        "n" * 49,
        ["JobSet/" + "n" * 49 + suffix for suffix in (".metadata.name", f".{POD_SHOWN}.containers[0].env")],
    ),
    "renamed": (
        "jobset",
        "JobSet",
        "metadata.name",
        "other-run",
        [f"JobSet/other-run.{POD_SHOWN}.containers[0].env"],  # MASTER_ADDR names the old JobSet's node 0
    ),
    "grace": (
        "jobset",
        "JobSet",
        f"{POD}.terminationGracePeriodSeconds",
        60,
        [f"JobSet/llm-run.{POD_SHOWN}.terminationGracePeriodSeconds"] * 2,  # the checkpoint, torchrun's timeout
    ),
    "trainer env": (
        "trainjob",
        "TrainJob",
        "spec.trainer.env",
        [{"name": "PET_MASTER_ADDR", "value": "elsewhere"}],
        ["TrainJob/llm-run.spec.trainer.env[0].name"],
    ),
    "runtime replicas": (
        "trainjob",
        "TrainingRuntime",
        "spec.template.spec.replicatedJobs.0.replicas",
        4,
        ["TrainingRuntime/llm-run-runtime.spec.template.spec.replicatedJobs[0].replicas"],
    ),
    "reserved": (
        "trainjob",
        "TrainingRuntime",
        f"{RUNTIME_POD}.containers.0.env",
        [{"name": "PET_NNODES", "value": "2"}],
        [f"TrainingRuntime/llm-run-runtime.spec.template.{POD_SHOWN}.containers[0].env[0].name"],
    ),
    "runtime kind": ("trainjob", "TrainJob", "spec.runtimeRef.kind", None, ["TrainJob/llm-run.spec.runtimeRef.kind"]),
    # a generated name (metadata.generateName): every name the JobSet makes, node 0's address among them, follows its
    # own, which the entry point needs (validate raised KeyError)
    "no name": ("jobset", "JobSet", "metadata.name", None, ["[2].metadata.name"]),
    # the forms the API server holds names and sizes to (jobs/forms.py)
    "namespace": ("jobset", "JobSet", "metadata.namespace", "my ns", ["JobSet/llm-run.metadata.namespace"]),
    "size": (
        "jobset",
        "PersistentVolumeClaim",
        "spec.resources.requests.storage",
        "100 GB",
        ["PersistentVolumeClaim/llm-run-work.spec.resources.requests.storage"],
    ),
    "resource": (
        "jobset",
        "JobSet",
        f"{POD}.containers.0.resources.limits",
        {"nvidia gpu": 8},
        [f"JobSet/llm-run.{POD_SHOWN}.containers[0].resources.limits"],
    ),
    "namespace newline": ("jobset", "JobSet", "metadata.namespace", "team-a\n", ["JobSet/llm-run.metadata.namespace"]),
    "completion index": (  # the Job controller keeps a value the spec sets
        "jobset",
        "JobSet",
        f"{POD}.containers.0.env",
        [{"name": "JOB_COMPLETION_INDEX", "value": "0"}],
        [f"JobSet/llm-run.{POD_SHOWN}.containers[0].env[0].name"],
    ),
    "trainjob completion index": (
        "trainjob",
        "TrainJob",
        "spec.trainer.env",
        [{"name": "JOB_COMPLETION_INDEX", "value": "0"}],
        ["TrainJob/llm-run.spec.trainer.env[0].name"],
    ),
    "image": (  # the kubelet: InvalidImageName
        "jobset",
        "JobSet",
        f"{POD}.containers.0.image",
        "ghcr.io/Me/train:1",
        [f"JobSet/llm-run.{POD_SHOWN}.containers[0].image"],
    ),
    # the restart contract (jobs/restart_rules.py): a preemption's 143 restarts the world, uncounted
    "143 not taken": (
        "jobset",
        "JobSet",
        f"{JOB}.podFailurePolicy.rules.0.onExitCodes.values",
        [137],
        [f"JobSet/llm-run.{JOB_SHOWN}.podFailurePolicy"],
    ),
    "143 counted": (
        "jobset",
        "JobSet",
        f"{JOB}.podFailurePolicy.rules.0.action",
        "Count",
        [f"JobSet/llm-run.{JOB_SHOWN}.podFailurePolicy.rules[0].action"],
    ),
    "no failure policy": ("jobset", "JobSet", "spec.failurePolicy", None, ["JobSet/llm-run.spec.failurePolicy"]),
    "restart counted": (
        "jobset",
        "JobSet",
        "spec.failurePolicy.rules.0.action",
        "RestartJobSet",
        ["JobSet/llm-run.spec.failurePolicy.rules[0].action"],
    ),
    "no rule matches": (  # the message of a Job failed on 143 does not match: the default, RestartJobSet, counts
        "trainjob",
        "TrainingRuntime",
        "spec.template.spec.failurePolicy.rules.0.onJobFailureMessagePatterns",
        ["exit code 137"],
        ["TrainingRuntime/llm-run-runtime.spec.template.spec.failurePolicy.rules"],
    ),
    "worker never": (
        "pytorchjob",
        "PyTorchJob",
        "spec.pytorchReplicaSpecs.Worker.restartPolicy",
        "Never",
        ["PyTorchJob/llm-run.spec.pytorchReplicaSpecs.Worker.restartPolicy"],
    ),
    "master default": (  # OnFailure, and no backoffLimit: a program's error restarts without end
        "pytorchjob",
        "PyTorchJob",
        "spec.pytorchReplicaSpecs.Master.restartPolicy",
        None,
        ["PyTorchJob/llm-run.spec.pytorchReplicaSpecs.Master.restartPolicy"],
    ),
    "class": (
        "jobset",
        "PersistentVolumeClaim",
        "spec.storageClassName",
        "Fast SSD",
        ["PersistentVolumeClaim/llm-run-work.spec.storageClassName"],
    ),
}


def set_or_drop(documents, kind: str, path: str, value):
    if value is not None:
        return set_in(documents, kind, path, value)
    *parents, last = path.split(".")
    target = next(d for d in documents if d["kind"] == kind)
    for key in parents:
        target = target[key]
    del target[last]


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_mutated_spec_fails_with_the_path_to_fix(run_cli, project, mutation):
    target, kind, path, value, expected = MUTATIONS[mutation]
    assert write(run_cli, target).exit_code == 0
    documents = objects(project, target)
    assert manifest_problems(documents) == []
    problems = manifest_problems(mutated(documents, lambda d: set_or_drop(d, kind, path, value)))
    assert [p.path for p in problems] == expected, problems


@pytest.mark.parametrize(
    "target, kind, path, value",
    [
        # a preempted pod's 143 ignored: the Job recreates the pod, uncounted (the JobSet is not restarted)
        ("jobset", "JobSet", f"{JOB}.podFailurePolicy.rules.0.action", "Ignore"),
    ],
)
def test_other_ways_of_keeping_the_restart_contract_are_no_problem(run_cli, project, target, kind, path, value):
    assert write(run_cli, target).exit_code == 0
    assert manifest_problems(mutated(objects(project, target), lambda d: set_in(d, kind, path, value))) == []


def test_a_pytorchjob_restarted_in_place_counts_preemptions_against_its_limit(run_cli, project):
    """OnFailure with runPolicy.backoffLimit bounds a failing program, but each preemption's 143 is a restart it
    counts as well: preemptions fail the job."""
    assert write(run_cli, "pytorchjob").exit_code == 0

    def change(documents):
        set_in(documents, "PyTorchJob", "spec.runPolicy.backoffLimit", 5)
        for role in ("Master", "Worker"):
            set_in(documents, "PyTorchJob", f"spec.pytorchReplicaSpecs.{role}.restartPolicy", "OnFailure")

    problems = manifest_problems(mutated(objects(project, "pytorchjob"), change))
    assert [p.path for p in problems] == [
        f"PyTorchJob/llm-run.spec.pytorchReplicaSpecs.{role}.restartPolicy" for role in ("Master", "Worker")
    ]
    assert all("is a restart runPolicy.backoffLimit counts" in p.message for p in problems)


def test_an_empty_storage_class_is_no_provisioning_and_valid(run_cli, project):
    assert write(run_cli, "jobset").exit_code == 0
    no_class = mutated(
        objects(project, "jobset"), lambda d: set_in(d, "PersistentVolumeClaim", "spec.storageClassName", "")
    )
    assert manifest_problems(no_class) == []


def test_validate_reads_a_broken_manifest_and_names_the_field(run_cli, project):
    assert write(run_cli, "trainjob").exit_code == 0
    manifest = project / "k8s" / "trainjob.yaml"
    manifest.write_text(manifest.read_text().replace("numProcPerNode: 8", "numProcPerNode: auto"))
    result = run_cli("validate", str(manifest))
    assert result.exit_code == 1
    assert "TrainJob/llm-run.spec.trainer.numProcPerNode: 'auto' has the wrong type. Fix: write an integer." in (
        result.stdout
    )


def test_the_entry_points_shutdown_timeout_must_fit_the_grace_period(run_cli, project):
    assert write(run_cli, "jobset", "--grace_seconds", 600).exit_code == 0
    documents = objects(project, "jobset")
    problems = manifest_problems(
        mutated(documents, lambda d: set_in(d, "JobSet", f"{POD}.terminationGracePeriodSeconds", 200))
    )
    assert any("lets torchrun wait 590 s" in p.message for p in problems), problems


def test_a_pytorchjob_takes_no_restart_limit_the_operator_would_not_keep(run_cli, project):
    one_line_error(write(run_cli, "pytorchjob", "--max_restarts", 5), "--max_restarts", "1-127")
    assert not (project / "k8s").exists()


def test_the_engine_must_be_named(run_cli, project):
    one_line_error(run_cli("job", "--config", "config.yaml", "--num_gpus_per_node", 8, "--image", "i:1"), "--target")


def test_a_pod_passes_the_shipped_copy_of_the_run_configs_own_deepspeed_file(run_cli, project):
    """A run config naming its DeepSpeed file (as init writes it): the pod's entry point passes the ConfigMap's copy.
    Left to the run config, the pod's trainer looked for config/ds_config.json in the image (or beside the mounted
    config), not the file the job checked and shipped."""
    (project / "config").mkdir()
    (project / "config" / "ds_config.json").write_text('{"train_micro_batch_size_per_gpu": 2}')
    config = {**CONFIG, "distributed": {"backend": "deepspeed", "deepspeed_config": "config/ds_config.json"}}
    (project / "config.yaml").write_text(yaml.safe_dump(config))
    assert write(run_cli, "jobset").exit_code == 0
    text = (project / "k8s" / "jobset.yaml").read_text()
    passed = "TRAIN_ARGS=(--config /etc/distsetup/config.yaml distributed.backend=deepspeed --deepspeed"
    assert f"{passed} /etc/distsetup/ds_config.json)" in text, text


def test_a_world_the_deepspeed_files_batch_does_not_divide_is_refused(run_cli, project):
    (project / "ds.json").write_text('{"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3}')
    result = write(run_cli, "jobset", "--deepspeed_config", "ds.json", nodes=2)  # 2 x 8 GPUs do not divide 24
    one_line_error(result, "24")
    assert not (project / "k8s").exists()


def test_a_skypilot_task_runs_the_entry_point_on_gpus_of_one_type_and_recovers_on_its_status(run_cli, project):
    result = run_cli(
        "job", "--target", "skypilot", "--config", "config.yaml", "--num_nodes", 2, "--num_gpus_per_node", 8, *SKYPILOT
    )
    assert result.exit_code == 0, result.output
    assert "Next: sky jobs launch sky/task.yaml" in result.stderr
    text = (project / "sky" / "task.yaml").read_text()
    check_golden("job_skypilot.yaml", text)
    assert run_cli("validate", "sky/task.yaml").exit_code == 0
    (task,) = yaml.safe_load_all(text)
    assert (task["num_nodes"], task["resources"]["accelerators"], task["workdir"]) == (2, "H100:8", ".")
    assert task["resources"]["job_recovery"]["recover_on_exit_codes"] == [RESTART_STATUS]
    assert task["file_mounts"] == {"/distsetup-work": {"source": "s3://my-bucket/runs", "mode": "MOUNT_CACHED"}}
    assert "TRAIN_ARGS=(--config config.yaml)" in task["run"]  # the workdir's copy
    assert "TRAIN_ARGS+=('training.output_dir=\"/distsetup-work/runs/demo\"')" in task["run"]
    entry = project / "run.sh"
    entry.write_text(task["run"])
    shellcheck([entry])
    # one process a GPU, as many as SkyPilot gives a node (`sky jobs launch --gpus H100:4` too); a fixed count that
    # differs from the GPUs asked for is a problem
    gpus_given = 'NPROC_PER_NODE="${SKYPILOT_NUM_GPUS_PER_NODE:-8}"'
    assert gpus_given in task["run"]
    four = dict(task["resources"], accelerators="H100:4")
    assert manifest_problems([dict(task, resources=four)]) == []
    fixed = task["run"].replace(gpus_given, "NPROC_PER_NODE=8")
    problems = manifest_problems([dict(task, resources=four, run=fixed)])
    assert [p.path for p in problems] == ["Task/distsetup.resources.accelerators"]
    # the count read as SkyPilot reads it: a number however written
    for same in ("H100 : 8", "H100:8.0", "H100:08"):
        assert manifest_problems([dict(task, resources=dict(task["resources"], accelerators=same), run=fixed)]) == []
    spaced = dict(task["resources"], accelerators="H100 : 4")
    assert "asks for 4 GPUs a node, and the run starts 8 process(es)" in str(
        manifest_problems([dict(task, resources=spaced, run=fixed)])[0]
    )
    # only MOUNT_CACHED keeps the checkpoints: validate said "no problems" of a plain MOUNT (the docs' warning, and
    # SkyPilot's default mode), a COPY or a string source (never written back), and of no mount at all
    (store,) = task["file_mounts"].values()
    plain = {k: v for k, v in store.items() if k != "mode"}
    for mounts in ({BUCKET_MOUNT: plain}, {BUCKET_MOUNT: {**store, "mode": "COPY"}}, {BUCKET_MOUNT: "s3://b/r"}, {}):
        problems = manifest_problems([dict(task, file_mounts=mounts)])
        assert [p.path for p in problems] == [f"Task/distsetup.file_mounts.{BUCKET_MOUNT}"], mounts
    # SkyPilot reads the mode in any case (its schema's case_insensitive_enum): the schema refused "Mount_Cached"
    assert manifest_problems([dict(task, file_mounts={BUCKET_MOUNT: {**store, "mode": "Mount_Cached"}})]) == []
    said = manifest_problems([dict(task, file_mounts={BUCKET_MOUNT: {**store, "mode": "MOUNTED"}})])
    # it said "... is not valid under any of the given schemas" of the whole mount, a string or an object
    assert [(p.path, p.message) for p in said] == [
        (
            f"Task/distsetup.file_mounts.{BUCKET_MOUNT}.mode",
            "'MOUNTED' is not MOUNT, COPY or MOUNT_CACHED (in any case).",
        )
    ]
    del task["resources"]["job_recovery"]["recover_on_exit_codes"]
    assert [p.path for p in manifest_problems([task])] == [
        "Task/distsetup.resources.job_recovery.recover_on_exit_codes"
    ]
    assert [p.path for p in manifest_problems([dict(task, num_node=2)])] == ["Task/distsetup.num_node"]


def test_a_clusters_crd_checks_the_manifest_too(run_cli, project):
    """--crd: a field the CRD does not list is an error (its schema made strict), beside what distsetup's own
    schema says; here a CRD of the JobSet that lists no failurePolicy."""
    assert write(run_cli, "jobset").exit_code == 0
    version = {
        "name": "v1alpha2",
        "served": True,
        "schema": {
            "openAPIV3Schema": {
                "type": "object",
                "properties": {
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "metadata": {"type": "object"},
                    "spec": {
                        "type": "object",
                        "properties": {
                            "network": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                            "replicatedJobs": {"type": "array"},
                        },
                    },
                },
            }
        },
    }
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "spec": {"group": "jobset.x-k8s.io", "names": {"kind": "JobSet"}, "versions": [version]},
    }
    (project / "crd.yaml").write_text(yaml.safe_dump(crd))
    result = run_cli("validate", "k8s/jobset.yaml", "--crd", "crd.yaml")
    assert result.exit_code == 1
    said = [line for line in result.stdout.splitlines() if "(by the cluster's CRD)" in line]
    assert said == [
        "k8s/jobset.yaml: JobSet/llm-run.spec.failurePolicy: unknown key 'failurePolicy' (by the cluster's CRD). "
        "Fix: valid keys: network, replicatedJobs."
    ], result.stdout
    one_line_error(run_cli("validate", "config.yaml", "--crd", "crd.yaml"), "--crd")


def test_the_completion_index_read_from_the_pods_own_annotation_is_no_problem(run_cli, project):
    """Kubernetes' own examples read JOB_COMPLETION_INDEX from the annotation the Job controller writes."""
    assert write(run_cli, "jobset", nodes=2).exit_code == 0
    documents = objects(project, "jobset")
    pod = pod_spec(documents)
    from_annotation = {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    pod["containers"][0].setdefault("env", []).append({"name": "JOB_COMPLETION_INDEX", "valueFrom": from_annotation})
    assert manifest_problems(documents) == []
