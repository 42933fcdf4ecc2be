"""JSON Schemas of the objects `distsetup job` writes and `distsetup validate` reads, strict about unknown fields
(a typo is an error, as the API server's strict field validation makes it), after the engines' API types:
kubeflow/trainer v2.3.0 (pkg/apis/trainer/v1alpha1), jobset v0.12.0 (api/jobset/v1alpha2), training-operator v1.9
(pkg/apis/kubeflow.org/v1) and Kubernetes' core and batch v1. Written here as Python data rather than vendored
(each part of the pod is written once and shared by every engine); `distsetup validate --crd FILE` checks a file
against the cluster's own CustomResourceDefinition as well (crd.py). What the API types cannot say (name lengths,
the CEL and webhook rules) is in rules.py."""

from functools import cache


def _object(properties: dict, required: tuple[str, ...] = (), open_keys: bool = False) -> dict:
    """An object with these properties; other keys are refused unless `open_keys` (a map of user keys)."""
    schema: dict = {"type": "object", "properties": properties}
    if not open_keys:
        schema["additionalProperties"] = False
    if required:
        schema["required"] = list(required)
    return schema


ANY: dict = {}
STRING = {"type": "string"}
BOOLEAN = {"type": "boolean"}
INTEGER = {"type": "integer"}
COUNT = {"type": "integer", "minimum": 0}
POSITIVE = {"type": "integer", "minimum": 1}
QUANTITY = {"type": ["string", "integer", "number"]}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def _array(items: dict, min_items: int = 0) -> dict:
    schema: dict = {"type": "array", "items": items}
    if min_items:
        schema["minItems"] = min_items
    return schema


OBJECT_META = _object(
    {
        "name": STRING,
        "generateName": STRING,
        "namespace": STRING,
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
        "finalizers": _array(STRING),
        "ownerReferences": _array(ANY),
        **{key: ANY for key in ("uid", "resourceVersion", "generation", "creationTimestamp", "managedFields")},
        **{key: ANY for key in ("deletionTimestamp", "deletionGracePeriodSeconds", "selfLink")},
    }
)

ENV_VAR = _object({"name": STRING, "value": STRING, "valueFrom": ANY}, required=("name",))
RESOURCES = _object(
    {
        "limits": {"type": "object", "additionalProperties": QUANTITY},
        "requests": {"type": "object", "additionalProperties": QUANTITY},
        "claims": _array(ANY),
    }
)
VOLUME_MOUNT = _object(
    {
        "name": STRING,
        "mountPath": STRING,
        "readOnly": BOOLEAN,
        "subPath": STRING,
        "subPathExpr": STRING,
        "mountPropagation": STRING,
        "recursiveReadOnly": STRING,
    },
    required=("name", "mountPath"),
)
CONTAINER = _object(
    {
        "name": STRING,
        "image": STRING,
        "command": _array(STRING),
        "args": _array(STRING),
        "env": _array(ENV_VAR),
        "envFrom": _array(ANY),
        "resources": RESOURCES,
        "volumeMounts": _array(VOLUME_MOUNT),
        "workingDir": STRING,
        "imagePullPolicy": {"enum": ["Always", "Never", "IfNotPresent"]},
        "ports": _array(ANY),
        **{
            key: ANY
            for key in (
                "lifecycle",
                "livenessProbe",
                "readinessProbe",
                "startupProbe",
                "resizePolicy",
                "restartPolicy",
                "restartPolicyRules",
                "securityContext",
                "stdin",
                "stdinOnce",
                "tty",
                "terminationMessagePath",
                "terminationMessagePolicy",
                "volumeDevices",
            )
        },
    },
    required=("name",),
)
VOLUME_SOURCES = (
    "awsElasticBlockStore azureDisk azureFile cephfs cinder csi downwardAPI ephemeral fc flexVolume flocker "
    "gcePersistentDisk gitRepo glusterfs hostPath image iscsi nfs photonPersistentDisk portworxVolume projected "
    "quobyte rbd scaleIO secret storageos vsphereVolume"
).split()
VOLUME = _object(
    {
        "name": STRING,
        "configMap": _object({"name": STRING, "items": _array(ANY), "defaultMode": INTEGER, "optional": BOOLEAN}),
        "emptyDir": _object({"medium": STRING, "sizeLimit": QUANTITY}),  # "", Memory, HugePages, HugePages-<size>
        "persistentVolumeClaim": _object({"claimName": STRING, "readOnly": BOOLEAN}, required=("claimName",)),
        **{key: ANY for key in VOLUME_SOURCES},
    },
    required=("name",),
)
POD_SPEC = _object(
    {
        "containers": _array(CONTAINER, min_items=1),
        "initContainers": _array(CONTAINER),
        "volumes": _array(VOLUME),
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never"]},
        "terminationGracePeriodSeconds": COUNT,
        "nodeSelector": STRING_MAP,
        "serviceAccountName": STRING,
        "priorityClassName": STRING,
        "subdomain": STRING,
        "hostname": STRING,
        **{
            key: ANY
            for key in (
                "activeDeadlineSeconds affinity automountServiceAccountToken dnsConfig dnsPolicy enableServiceLinks "
                "hostnameOverride "
                "ephemeralContainers hostAliases hostIPC hostNetwork hostPID hostUsers imagePullSecrets nodeName os "
                "overhead preemptionPolicy priority readinessGates resourceClaims resources runtimeClassName "
                "schedulerName schedulingGates schedulingGroup securityContext serviceAccount setHostnameAsFQDN "
                "shareProcessNamespace tolerations topologySpreadConstraints"
            ).split()
        },
    },
    required=("containers",),
)
POD_TEMPLATE = _object({"metadata": OBJECT_META, "spec": POD_SPEC})

POD_FAILURE_POLICY_RULE = _object(
    {
        "action": {"enum": ["Count", "FailIndex", "FailJob", "Ignore"]},
        "onExitCodes": _object(
            {
                "containerName": STRING,
                "operator": {"enum": ["In", "NotIn"]},
                "values": {"type": "array", "items": INTEGER, "minItems": 1, "maxItems": 255},
            },
            required=("operator", "values"),
        ),
        "onPodConditions": _array(_object({"type": STRING, "status": {"enum": ["True", "False", "Unknown"]}})),
    },
    required=("action",),
)
JOB_SPEC = _object(
    {
        "parallelism": COUNT,
        "completions": COUNT,
        "completionMode": {"enum": ["NonIndexed", "Indexed"]},
        "backoffLimit": COUNT,
        "backoffLimitPerIndex": COUNT,
        "maxFailedIndexes": COUNT,
        "activeDeadlineSeconds": POSITIVE,
        "ttlSecondsAfterFinished": COUNT,
        "suspend": BOOLEAN,
        "podFailurePolicy": _object({"rules": _array(POD_FAILURE_POLICY_RULE)}, required=("rules",)),
        "podReplacementPolicy": {"enum": ["TerminatingOrFailed", "Failed"]},
        "template": POD_TEMPLATE,
        **{key: ANY for key in ("managedBy", "manualSelector", "selector", "successPolicy")},
    },
    required=("template",),
)
JOB_TEMPLATE = _object({"metadata": OBJECT_META, "spec": JOB_SPEC})

# jobset.x-k8s.io/v1alpha2 (api/jobset/v1alpha2/jobset_types.go)
JOB_FAILURE_REASONS = [
    "BackoffLimitExceeded",
    "DeadlineExceeded",
    "FailedIndexes",
    "MaxFailedIndexesExceeded",
    "PodFailurePolicy",
]
FAILURE_ACTIONS = [
    "FailJobSet",
    "RestartJobSet",
    "RestartJobSetAndIgnoreMaxRestarts",
    "RestartJob",  # behind JobSet's RestartJob feature gate
    "RestartJobAndIgnoreMaxRestarts",
]
JOBSET_SPEC = _object(
    {
        "replicatedJobs": _array(
            _object(
                {
                    "name": STRING,
                    "groupName": STRING,
                    "replicas": COUNT,
                    "template": JOB_TEMPLATE,
                    "dependsOn": _array(ANY),
                },
                required=("name", "template"),
            ),
            min_items=1,
        ),
        "network": _object({"enableDNSHostnames": BOOLEAN, "subdomain": STRING, "publishNotReadyAddresses": BOOLEAN}),
        "failurePolicy": _object(
            {
                "maxRestarts": COUNT,
                "restartStrategy": {"enum": ["Recreate", "BlockingRecreate", "InPlaceRestart"]},
                "rules": _array(
                    _object(
                        {
                            "name": STRING,
                            "action": {"enum": FAILURE_ACTIONS},
                            "onJobFailureMessagePatterns": _array(STRING),
                            "onJobFailureReasons": _array({"enum": JOB_FAILURE_REASONS}),
                            "targetReplicatedJobs": _array(STRING),
                        },
                        required=("name", "action"),
                    )
                ),
            }
        ),
        "successPolicy": _object(
            {"operator": {"enum": ["All", "Any"]}, "targetReplicatedJobs": _array(STRING)}, required=("operator",)
        ),
        "startupPolicy": _object({"startupPolicyOrder": {"enum": ["AnyOrder", "InOrder"]}}),
        "suspend": BOOLEAN,
        "coordinator": ANY,
        "volumeClaimPolicies": _array(ANY),
        "managedBy": STRING,
        "ttlSecondsAfterFinished": COUNT,
    }
)


def _kind(api_version: str, kind: str, spec: dict, required: tuple[str, ...] = ("spec",)) -> dict:
    return _object(
        {"apiVersion": {"enum": [api_version]}, "kind": {"enum": [kind]}, "metadata": OBJECT_META, "spec": spec},
        required=("apiVersion", "kind", "metadata", *required),
    )


# trainer.kubeflow.org/v1alpha1 (pkg/apis/trainer/v1alpha1/trainjob_types.go, trainingruntime_types.go)
TRAINER_API = "trainer.kubeflow.org/v1alpha1"
TRAINER = _object(
    {
        "image": STRING,
        "command": _array(STRING),
        "args": _array(STRING),
        "env": _array(ENV_VAR),
        "numNodes": POSITIVE,
        "numProcPerNode": POSITIVE,
        "resourcesPerNode": RESOURCES,
    }
)
TRAINJOB_SPEC = _object(
    {
        "runtimeRef": _object(
            {
                "name": STRING,
                "apiGroup": {"enum": ["trainer.kubeflow.org"]},
                "kind": {"enum": ["TrainingRuntime", "ClusterTrainingRuntime"]},
            },
            required=("name",),
        ),
        "trainer": TRAINER,
        "suspend": BOOLEAN,
        "activeDeadlineSeconds": POSITIVE,
        "managedBy": {"enum": ["trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue"]},
        **{key: ANY for key in ("initializer", "runtimePatches")},
    },
    required=("runtimeRef",),
)
TRAINING_RUNTIME_SPEC = _object(
    {
        "mlPolicy": _object(
            {
                "numNodes": POSITIVE,
                "torch": _object({"envInjection": ANY}),  # v2.2 moved numProcPerNode to the TrainJob
                **{key: ANY for key in ("mpi", "jax", "xgboost", "flux")},
            }
        ),
        "podGroupPolicy": ANY,
        "template": _object({"metadata": OBJECT_META, "spec": JOBSET_SPEC}, required=("spec",)),
    },
    required=("template",),
)

# kubeflow.org/v1 (training-operator pkg/apis/kubeflow.org/v1/pytorch_types.go, common_types.go)
REPLICA_SPEC = _object(
    {
        "replicas": COUNT,
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": POD_TEMPLATE,
    }
)
PYTORCHJOB_SPEC = _object(
    {
        "runPolicy": _object(
            {
                "backoffLimit": COUNT,
                "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                **{key: ANY for key in ("activeDeadlineSeconds", "ttlSecondsAfterFinished", "schedulingPolicy")},
                **{key: ANY for key in ("suspend", "managedBy")},
            }
        ),
        "nprocPerNode": STRING,
        "elasticPolicy": ANY,
        "pytorchReplicaSpecs": _object({"Master": REPLICA_SPEC, "Worker": REPLICA_SPEC}),
    },
    required=("pytorchReplicaSpecs",),
)


# A SkyPilot task (skypilot 0.14: sky/utils/schemas.py, get_task_schema and the resources and storage schemas)
SKYPILOT_STORE = _object(
    {
        "name": STRING,
        "source": {"type": ["string", "array"]},
        "store": STRING,
        "persistent": BOOLEAN,
        "mode": {"enum": ["MOUNT", "COPY", "MOUNT_CACHED", "mount", "copy", "mount_cached"]},
        "type": STRING,
        "config": ANY,
    }
)
SKYPILOT_RESOURCES = _object(
    {
        "accelerators": {"type": ["string", "object", "array"]},
        "use_spot": BOOLEAN,
        "job_recovery": {
            "anyOf": [
                STRING,
                _object(
                    {
                        "strategy": {"enum": ["EAGER_NEXT_REGION", "FAILOVER", None]},
                        "max_restarts_on_errors": COUNT,
                        "recover_on_exit_codes": {
                            "anyOf": [
                                {"type": "integer", "minimum": 0, "maximum": 255},
                                _array({"type": "integer", "minimum": 0, "maximum": 255}),
                            ]
                        },
                    }
                ),
            ]
        },
        **{
            key: ANY
            for key in (
                "cloud region zone infra cpus memory instance_type volumes disk_size ephemeral_storage disk_tier "
                "network_tier local_disk max_hourly_cost ports labels accelerator_args image_id priority any_of "
                "ordered autostop"
            ).split()
        },
    }
)
SKYPILOT_TASK = _object(
    {
        "name": STRING,
        "workdir": {"type": ["string", "object"]},
        "num_nodes": POSITIVE,
        "resources": SKYPILOT_RESOURCES,
        "file_mounts": {"type": "object", "additionalProperties": {"anyOf": [STRING, SKYPILOT_STORE]}},
        "setup": STRING,
        "run": STRING,
        "envs": {"type": "object", "additionalProperties": {"type": ["string", "null"]}},
        **{key: ANY for key in "event_callback service pool secrets volumes config inputs outputs".split()},
    },
    required=("run",),
)


@cache
def schemas() -> dict[tuple[str, str], dict]:
    """{(apiVersion, kind): its schema} for every object distsetup writes or reads."""
    return {
        ("v1", "ConfigMap"): _object(
            {
                "apiVersion": {"enum": ["v1"]},
                "kind": {"enum": ["ConfigMap"]},
                "metadata": OBJECT_META,
                "data": STRING_MAP,
                "binaryData": STRING_MAP,
                "immutable": BOOLEAN,
            },
            required=("apiVersion", "kind", "metadata"),
        ),
        ("v1", "PersistentVolumeClaim"): _kind(
            "v1",
            "PersistentVolumeClaim",
            _object(
                {
                    "accessModes": _array(
                        {"enum": ["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]}, 1
                    ),
                    "resources": _object(
                        {
                            "requests": {"type": "object", "additionalProperties": QUANTITY},
                            "limits": {"type": "object", "additionalProperties": QUANTITY},
                        }
                    ),
                    "storageClassName": STRING,
                    **{key: ANY for key in ("dataSource", "dataSourceRef", "selector", "volumeMode", "volumeName")},
                    "volumeAttributesClassName": STRING,
                }
            ),
        ),
        ("jobset.x-k8s.io/v1alpha2", "JobSet"): _kind("jobset.x-k8s.io/v1alpha2", "JobSet", JOBSET_SPEC),
        (TRAINER_API, "TrainJob"): _kind(TRAINER_API, "TrainJob", TRAINJOB_SPEC),
        (TRAINER_API, "TrainingRuntime"): _kind(TRAINER_API, "TrainingRuntime", TRAINING_RUNTIME_SPEC),
        (TRAINER_API, "ClusterTrainingRuntime"): _kind(TRAINER_API, "ClusterTrainingRuntime", TRAINING_RUNTIME_SPEC),
        ("kubeflow.org/v1", "PyTorchJob"): _kind("kubeflow.org/v1", "PyTorchJob", PYTORCHJOB_SPEC),
    }
