"""JSON Schemas of the objects `distsetup job` writes and `distsetup validate` reads, strict about unknown fields
(a typo is an error, as the API server's strict field validation makes it), after the engines' API types:
kubeflow/trainer v2.3.0 (pkg/apis/trainer/v1alpha1), jobset v0.12.0 (api/jobset/v1alpha2), training-operator v1.9
(pkg/apis/kubeflow.org/v1) and Kubernetes' core and batch v1. Written here as Python data rather than vendored
(each part of the pod is written once and shared by every engine); `distsetup validate --crd FILE` checks a file
against the cluster's own CustomResourceDefinition as well (crd.py). What the API types cannot say (name lengths,
the CEL and webhook rules) is in object_rules.py; a SkyPilot task's schema is in skypilot.py."""

from functools import cache

from distsetup.jobs import forms
from distsetup.jobs.engines import JOBSET_API, PYTORCHJOB_API, TRAINER_API, TRAINER_GROUP


def object_schema(properties: dict, required: tuple[str, ...] = (), open_keys: bool = False) -> dict:
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
QUANTITY = {**forms.QUANTITY.schema(), "type": ["string", "integer", "number"]}  # the pattern holds for strings
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


RESOURCE_QUANTITIES = {
    "type": "object",
    "propertyNames": forms.RESOURCE_NAME.schema(),
    "additionalProperties": QUANTITY,
}


def array_schema(items: dict, min_items: int = 0) -> dict:
    schema: dict = {"type": "array", "items": items}
    if min_items:
        schema["minItems"] = min_items
    return schema


OBJECT_META = object_schema(
    {
        "name": STRING,
        "generateName": STRING,
        "namespace": forms.DNS_LABEL.schema(),
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
        "finalizers": array_schema(STRING),
        "ownerReferences": array_schema(ANY),
        **{key: ANY for key in ("uid", "resourceVersion", "generation", "creationTimestamp", "managedFields")},
        **{key: ANY for key in ("deletionTimestamp", "deletionGracePeriodSeconds", "selfLink")},
    }
)

ENV_VAR = object_schema({"name": STRING, "value": STRING, "valueFrom": ANY}, required=("name",))
RESOURCES = object_schema(
    {
        "limits": RESOURCE_QUANTITIES,
        "requests": RESOURCE_QUANTITIES,
        "claims": array_schema(ANY),
    }
)
VOLUME_MOUNT = object_schema(
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
CONTAINER = object_schema(
    {
        "name": STRING,
        "image": forms.IMAGE.schema(),
        "command": array_schema(STRING),
        "args": array_schema(STRING),
        "env": array_schema(ENV_VAR),
        "envFrom": array_schema(ANY),
        "resources": RESOURCES,
        "volumeMounts": array_schema(VOLUME_MOUNT),
        "workingDir": STRING,
        "imagePullPolicy": {"enum": ["Always", "Never", "IfNotPresent"]},
        "ports": array_schema(ANY),
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
VOLUME = object_schema(
    {
        "name": STRING,
        "configMap": object_schema(
            {"name": STRING, "items": array_schema(ANY), "defaultMode": INTEGER, "optional": BOOLEAN}
        ),
        "emptyDir": object_schema({"medium": STRING, "sizeLimit": QUANTITY}),  # "", Memory, HugePages, HugePages-<size>
        "persistentVolumeClaim": object_schema(
            {"claimName": forms.DNS_SUBDOMAIN.schema(), "readOnly": BOOLEAN}, required=("claimName",)
        ),
        **{key: ANY for key in VOLUME_SOURCES},
    },
    required=("name",),
)
POD_SPEC = object_schema(
    {
        "containers": array_schema(CONTAINER, min_items=1),
        "initContainers": array_schema(CONTAINER),
        "volumes": array_schema(VOLUME),
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
POD_TEMPLATE = object_schema({"metadata": OBJECT_META, "spec": POD_SPEC})

POD_FAILURE_POLICY_RULE = object_schema(
    {
        "action": {"enum": ["Count", "FailIndex", "FailJob", "Ignore"]},
        "onExitCodes": object_schema(
            {
                "containerName": STRING,
                "operator": {"enum": ["In", "NotIn"]},
                "values": {"type": "array", "items": INTEGER, "minItems": 1, "maxItems": 255},
            },
            required=("operator", "values"),
        ),
        "onPodConditions": array_schema(
            object_schema({"type": STRING, "status": {"enum": ["True", "False", "Unknown"]}})
        ),
    },
    required=("action",),
)
JOB_SPEC = object_schema(
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
        "podFailurePolicy": object_schema({"rules": array_schema(POD_FAILURE_POLICY_RULE)}, required=("rules",)),
        "podReplacementPolicy": {"enum": ["TerminatingOrFailed", "Failed"]},
        "template": POD_TEMPLATE,
        **{key: ANY for key in ("managedBy", "manualSelector", "selector", "successPolicy")},
    },
    required=("template",),
)
JOB_TEMPLATE = object_schema({"metadata": OBJECT_META, "spec": JOB_SPEC})

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
JOBSET_SPEC = object_schema(
    {
        "replicatedJobs": array_schema(
            object_schema(
                {
                    "name": STRING,
                    "groupName": STRING,
                    "replicas": COUNT,
                    "template": JOB_TEMPLATE,
                    "dependsOn": array_schema(ANY),
                },
                required=("name", "template"),
            ),
            min_items=1,
        ),
        "network": object_schema(
            {"enableDNSHostnames": BOOLEAN, "subdomain": STRING, "publishNotReadyAddresses": BOOLEAN}
        ),
        "failurePolicy": object_schema(
            {
                "maxRestarts": COUNT,
                "restartStrategy": {"enum": ["Recreate", "BlockingRecreate", "InPlaceRestart"]},
                "rules": array_schema(
                    object_schema(
                        {
                            "name": STRING,
                            "action": {"enum": FAILURE_ACTIONS},
                            "onJobFailureMessagePatterns": array_schema(STRING),
                            "onJobFailureReasons": array_schema({"enum": JOB_FAILURE_REASONS}),
                            "targetReplicatedJobs": array_schema(STRING),
                        },
                        required=("name", "action"),
                    )
                ),
            }
        ),
        "successPolicy": object_schema(
            {"operator": {"enum": ["All", "Any"]}, "targetReplicatedJobs": array_schema(STRING)}, required=("operator",)
        ),
        "startupPolicy": object_schema({"startupPolicyOrder": {"enum": ["AnyOrder", "InOrder"]}}),
        "suspend": BOOLEAN,
        "coordinator": ANY,
        "volumeClaimPolicies": array_schema(ANY),
        "managedBy": STRING,
        "ttlSecondsAfterFinished": COUNT,
    }
)


def _kind(api_version: str, kind: str, spec: dict, required: tuple[str, ...] = ("spec",)) -> dict:
    return object_schema(
        {"apiVersion": {"enum": [api_version]}, "kind": {"enum": [kind]}, "metadata": OBJECT_META, "spec": spec},
        required=("apiVersion", "kind", "metadata", *required),
    )


# trainer.kubeflow.org/v1alpha1 (pkg/apis/trainer/v1alpha1/trainjob_types.go, trainingruntime_types.go)
TRAINER = object_schema(
    {
        "image": forms.IMAGE.schema(),
        "command": array_schema(STRING),
        "args": array_schema(STRING),
        "env": array_schema(ENV_VAR),
        "numNodes": POSITIVE,
        "numProcPerNode": POSITIVE,
        "resourcesPerNode": RESOURCES,
    }
)
TRAINJOB_SPEC = object_schema(
    {
        "runtimeRef": object_schema(
            {
                "name": STRING,
                "apiGroup": {"enum": [TRAINER_GROUP]},
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
TRAINING_RUNTIME_SPEC = object_schema(
    {
        "mlPolicy": object_schema(
            {
                "numNodes": POSITIVE,
                "torch": object_schema({"envInjection": ANY}),  # v2.2 moved numProcPerNode to the TrainJob
                **{key: ANY for key in ("mpi", "jax", "xgboost", "flux")},
            }
        ),
        "podGroupPolicy": ANY,
        "template": object_schema({"metadata": OBJECT_META, "spec": JOBSET_SPEC}, required=("spec",)),
    },
    required=("template",),
)

# kubeflow.org/v1 (training-operator pkg/apis/kubeflow.org/v1/pytorch_types.go, common_types.go)
REPLICA_SPEC = object_schema(
    {
        "replicas": COUNT,
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": POD_TEMPLATE,
    }
)
PYTORCHJOB_SPEC = object_schema(
    {
        "runPolicy": object_schema(
            {
                "backoffLimit": COUNT,
                "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                **{key: ANY for key in ("activeDeadlineSeconds", "ttlSecondsAfterFinished", "schedulingPolicy")},
                **{key: ANY for key in ("suspend", "managedBy")},
            }
        ),
        "nprocPerNode": STRING,
        "elasticPolicy": ANY,
        "pytorchReplicaSpecs": object_schema({"Master": REPLICA_SPEC, "Worker": REPLICA_SPEC}),
    },
    required=("pytorchReplicaSpecs",),
)


@cache
def schemas() -> dict[tuple[str, str], dict]:
    """{(apiVersion, kind): its schema} for every object distsetup writes or reads."""
    return {
        ("v1", "ConfigMap"): object_schema(
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
            object_schema(
                {
                    "accessModes": array_schema(
                        {"enum": ["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]}, 1
                    ),
                    "resources": object_schema(
                        {
                            "requests": RESOURCE_QUANTITIES,
                            "limits": RESOURCE_QUANTITIES,
                        }
                    ),
                    "storageClassName": forms.DNS_SUBDOMAIN.schema(or_empty=True),  # "": no provisioning
                    **{key: ANY for key in ("dataSource", "dataSourceRef", "selector", "volumeMode", "volumeName")},
                    "volumeAttributesClassName": STRING,
                }
            ),
        ),
        (JOBSET_API, "JobSet"): _kind(JOBSET_API, "JobSet", JOBSET_SPEC),
        (TRAINER_API, "TrainJob"): _kind(TRAINER_API, "TrainJob", TRAINJOB_SPEC),
        (TRAINER_API, "TrainingRuntime"): _kind(TRAINER_API, "TrainingRuntime", TRAINING_RUNTIME_SPEC),
        (TRAINER_API, "ClusterTrainingRuntime"): _kind(TRAINER_API, "ClusterTrainingRuntime", TRAINING_RUNTIME_SPEC),
        (PYTORCHJOB_API, "PyTorchJob"): _kind(PYTORCHJOB_API, "PyTorchJob", PYTORCHJOB_SPEC),
    }
