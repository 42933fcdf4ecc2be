"""`distsetup validate`: every problem reported with its path and fix; exit 1 with problems, 0 without."""

import json

import pytest

from distsetup.formats.validate import validate_file

GOOD_DS = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": True},
}


def write(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def problems_of(tmp_path, content, name="ds.json", **kwargs):
    return {p.path: p for p in validate_file(write(tmp_path, name, content), **kwargs)[1]}


def test_clean_deepspeed_file_exits_0(run_cli, tmp_path):
    result = run_cli("validate", write(tmp_path, "ds.json", GOOD_DS), "--world_size", "16")
    assert result.exit_code == 0
    assert "DeepSpeed config, no problems for world size 16" in result.stderr + result.stdout


def test_typo_that_deepspeed_accepts_silently_is_caught_with_suggestion(tmp_path):
    found = problems_of(tmp_path, {**GOOD_DS, "zero_optimizaton": {"stage": 3}})
    assert "did you mean 'zero_optimization'" in found["zero_optimizaton"].fix


def test_unknown_key_deep_inside_a_section(tmp_path):
    config = {**GOOD_DS, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}}
    found = problems_of(tmp_path, config)
    assert "did you mean 'pin_memory'" in found["zero_optimization.offload_param.pin_memroy"].fix


def test_batch_identity_against_world_size(run_cli, tmp_path):
    path = write(tmp_path, "ds.json", {**GOOD_DS, "train_batch_size": 64})
    assert run_cli("validate", path, "--world_size", "8").exit_code == 0
    result = run_cli("validate", path, "--num_nodes", "2", "--num_gpus_per_node", "8")
    assert result.exit_code == 1
    assert (
        "64 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x world size 16 = 128" in result.stdout
    )


@pytest.mark.parametrize(
    "config, path, words",
    [
        ({**GOOD_DS, "fp16": {"enabled": True}}, "bf16.enabled", "both enabled"),
        (
            {**GOOD_DS, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
            "zero_optimization.offload_param",
            "ignores it silently",
        ),
        (
            {**GOOD_DS, "zero_optimization": {"stage": 1, "stage3_max_live_parameters": 10}},
            "zero_optimization.stage3_max_live_parameters",
            "means nothing at zero_optimization.stage 1",
        ),
        (
            {**GOOD_DS, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
            "zero_optimization.offload_optimizer.nvme_path",
            "nvme_path",
        ),
        ({**GOOD_DS, "gradient_clipping": "auto"}, "gradient_clipping", "Hugging Face Trainer"),
        ({**GOOD_DS, "zero_optimization": {"stage": 4}}, "zero_optimization.stage", "not allowed"),
        ({**GOOD_DS, "gradient_accumulation_steps": "two"}, "gradient_accumulation_steps", "wrong type"),
        ({**GOOD_DS, "gradient_clipping": -1}, "gradient_clipping", "out of range"),
        (
            {**GOOD_DS, "zero_optimization": {"stage": 0}, "bf16": {"enabled": False}, "fp16": {"enabled": True}},
            "fp16.enabled",
            "does not loss-scale",
        ),
    ],
)
def test_cross_field_and_schema_rules(tmp_path, config, path, words):
    found = problems_of(tmp_path, config)
    assert path in found and words in found[path].message, found


def test_a_file_without_batch_leaves_it_to_the_run_config_but_not_for_the_hf_trainer(run_cli, tmp_path):
    path = write(tmp_path, "ds.json", {"zero_optimization": {"stage": 2}})
    alone = run_cli("validate", path)
    assert alone.exit_code == 0 and "note: neither train_batch_size nor" in alone.stdout
    assert "takes the batch from the run config" in alone.stdout
    found = problems_of(tmp_path, {"zero_optimization": {"stage": 2}}, hf=True)  # the HF Trainer fills only "auto"
    assert "refuses to start" in found["train_micro_batch_size_per_gpu"].message


def test_auto_is_allowed_with_hf(tmp_path):
    config = {**GOOD_DS, "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto"}
    assert problems_of(tmp_path, config, hf=True) == {}


def test_duplicate_json_keys(tmp_path):
    found = problems_of(
        tmp_path, '{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1, "stage": 2}}'
    )
    assert "appears more than once: DeepSpeed refuses" in found["zero_optimization.stage"].message
    fsdp = problems_of(tmp_path, '{"fsdp_version": 2, "fsdp_version": 2}', name="fsdp.json", kind="fsdp")
    assert "appears more than once: only the last one counts" in fsdp["fsdp_version"].message


def test_offload_to_nvme_is_missing_a_path_only_where_its_block_has_none(tmp_path):
    """Each block's own nvme_path (both blocks were blamed where one had its path)."""
    zero = {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
        "offload_param": {"device": "nvme"},
    }
    found = problems_of(tmp_path, {**GOOD_DS, "zero_optimization": zero})
    assert list(found) == ["zero_optimization.offload_param.nvme_path"], found


@pytest.mark.parametrize(
    "stage, hf, expected",
    [
        ("2", False, {"zero_optimization.stage", "zero_optimization.stage3_max_live_parameters"}),
        (4, False, {"zero_optimization.stage"}),
        ("auto", True, set()),
    ],
)
def test_the_rules_of_a_stage_read_it_as_the_readers_do(tmp_path, stage, hf, expected):
    """ "2" is stage 2 to DeepSpeed: CPU offload is no problem there (it was called meaningless "at
    zero_optimization.stage 0"); "auto" is Accelerate's (accelerate launch --zero_stage 3 fills it, said in a note), so
    no rule of a stage applies to the HF Trainer's ZeRO-3 keys beside it; a stage no reader takes is the one problem."""
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}, "stage3_max_live_parameters": 10**9}
    batch = {"train_micro_batch_size_per_gpu": "auto"} if hf else {}
    found = problems_of(tmp_path, {**GOOD_DS, **batch, "zero_optimization": zero}, hf=hf)
    assert set(found) == expected, found


def test_every_problem_is_reported_not_just_the_first(run_cli, tmp_path):
    config = {**GOOD_DS, "zero_optimizaton": {}, "fp16": {"enabled": True}, "steps_per_prnt": 1}
    result = run_cli("validate", write(tmp_path, "ds.json", config), "--json")
    assert result.exit_code == 1
    paths = {p["path"] for p in json.loads(result.stdout)}
    assert {"zero_optimizaton", "steps_per_prnt", "bf16.enabled"} <= paths
    assert all(p["fix"] for p in json.loads(result.stdout))


def test_fsdp_file_is_detected_and_checked_for_its_version(run_cli, tmp_path):
    config = {
        "fsdp_version": 2,
        "fsdp_sharding_strategy": "FULL_SHARD",
        "fsdp_use_orig_params": True,
        "fsdp_auto_wrap_policy": "NO_WRAP",
        "fsdp_state_dict_type": "LOCAL_STATE_DICT",
    }
    result = run_cli("validate", write(tmp_path, "fsdp.json", config), "--json")
    paths = {p["path"] for p in json.loads(result.stdout)}
    assert result.exit_code == 1 and paths == {"fsdp_use_orig_params", "fsdp_state_dict_type"}


def test_run_config_and_the_files_it_points_at(run_cli, tmp_path):
    write(tmp_path, "ds.json", {**GOOD_DS, "train_batch_size": 24})
    yaml_path = write(
        tmp_path,
        "config.yaml",
        "training:\n  lr: 3e-4\n  mirco_batch_size: 2\n"
        "distributed:\n  backend: deepspeed\n  deepspeed_config: ds.json\n",
    )
    result = run_cli("validate", yaml_path, "--world_size", "2", "--json")
    found = {p["path"]: p for p in json.loads(result.stdout)}
    assert result.exit_code == 1
    assert "did you mean 'micro_batch_size'" in found["training.mirco_batch_size"]["fix"]
    assert "distributed.deepspeed_config -> train_batch_size" in found


def test_shipped_example_config_is_clean(run_cli):
    assert run_cli("validate", "config/config.yaml").exit_code == 0


@pytest.mark.parametrize("content, message", [("{not json", "not valid JSON"), ("[1, 2]", "JSON object")])
def test_unreadable_file_is_one_clear_error(run_cli, tmp_path, content, message):
    result = run_cli("validate", write(tmp_path, "x.json", content))
    assert result.exit_code == 1 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "content, hf, path, words",
    [
        ({"amp": {"enabled": True}}, False, "amp", "removed from DeepSpeed"),
        ({"zero_optimization": {"stage": 3, "mics_shard_size": 2}}, False, "zero_optimization.mics_shard_size", "MiCS"),
        ({"train_micro_batch_size_per_gpu": 2.0}, False, "train_micro_batch_size_per_gpu", "whole number"),
        ({"train_micro_batch_size_per_gpu": "auto"}, True, "zero_optimization", "Accelerate"),
    ],
    ids=["removed block", "removed zero key", "float batch", "no zero block for accelerate"],
)
def test_what_deepspeed_0_19_or_accelerate_refuse_is_a_problem(tmp_path, content, hf, path, words):
    """What DeepSpeed 0.19 refuses to start with (its removed blocks), a batch written 2.0 (JSON Schema's integer, the
    DataLoader's error), and for Accelerate and the HF Trainer a file without zero_optimization."""
    found = problems_of(tmp_path, {**GOOD_DS, **content} if not hf else content, hf=hf)
    assert path in found and words in found[path].message + found[path].fix, found
    assert "zero_optimization" not in problems_of(tmp_path, {**GOOD_DS, "train_micro_batch_size_per_gpu": 2})


def test_a_number_written_as_a_string_is_told_to_drop_the_quotes(tmp_path):
    found = problems_of(tmp_path, {**GOOD_DS, "zero_optimization": {"stage": "3"}})
    assert found["zero_optimization.stage"].fix == "write 3 without quotes."


@pytest.mark.parametrize(
    "change, path",
    [
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, "ratio"),
        ({"zero_optimization": {"stage": 3, "compute_grad_norm": False}}, "compute_grad_norm"),
        ({"zero_optimization": {"stage": 3}, "gradient_allreduce_op": "sum"}, "gradient_allreduce_op"),
        (
            {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
            "bf16_m",
        ),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16_optimizer_states"),
        ({"data_types": {"keep_in_fp32_modules": "norm"}}, "keep_in_fp32_modules"),
        ({"optimizer": {"type": "SGD", "params": {"lr": 0.01}}}, "optimizer.type"),  # untested with ZeRO
    ],
)
def test_what_deepspeed_refuses_when_it_reads_its_config_is_a_problem(tmp_path, change, path):
    """DeepSpeed 0.19's own checks at start (runtime/config.py, zero/config.py), each at the stage it allows it."""
    found = problems_of(tmp_path, {**GOOD_DS, **change})
    assert [p for p in found if path in p] and all("DeepSpeed 0.19 refuses" in found[p].message for p in found)


def test_an_optimizer_zero_has_not_been_tested_with_passes_where_deepspeed_takes_it(tmp_path):
    sgd = {"type": "SGD", "params": {"lr": 0.01}}
    assert problems_of(tmp_path, {**GOOD_DS, "optimizer": sgd, "zero_allow_untested_optimizer": True}) == {}
    assert problems_of(tmp_path, {**GOOD_DS, "optimizer": sgd, "zero_optimization": {"stage": 0}}) == {}
    assert problems_of(tmp_path, {**GOOD_DS, "optimizer": {**sgd, "type": "adamw"}}) == {}  # any case, as DeepSpeed


def test_deepspeeds_own_auto_is_no_hf_auto(tmp_path):
    """data_types.keep_in_fp32_modules "auto" is DeepSpeed's own default value, not one the HF Trainer fills."""
    assert problems_of(tmp_path, {**GOOD_DS, "data_types": {"keep_in_fp32_modules": "auto"}}) == {}
    assert problems_of(tmp_path, {**GOOD_DS, "data_types": {"keep_in_fp32_modules": ["norm"]}}) == {}
