import pytest

from distsetup.errors import DistsetupError
from distsetup.formats.batch import global_batch_of, per_rank_batch, resolve_batch, world_size_from


@pytest.mark.parametrize(
    "micro, accumulation, train, world", [(4, 2, None, 8), (4, None, 64, 8), (None, 2, 64, 8), (3, 5, 60, 4)]
)
def test_any_two_batch_values_give_the_third(micro, accumulation, train, world):
    batch = resolve_batch(micro, accumulation, train, world)
    assert batch.micro * batch.accumulation * world == batch.train_batch
    for given, resolved in ((micro, batch.micro), (accumulation, batch.accumulation), (train, batch.train_batch)):
        assert given is None or given == resolved


def test_the_global_batch_and_the_per_rank_batch_are_the_identity_both_ways():
    assert global_batch_of(4, 2, 8) == 64
    assert per_rank_batch(64, 2, 4) == 8  # 2 nodes x 4 processes
    with pytest.raises(DistsetupError, match=r"--global_batch_size 30 is not divisible by the 8 processes \(2 node"):
        per_rank_batch(30, 2, 4)


def test_a_train_batch_alone_that_the_world_does_not_divide_names_only_what_was_given():
    with pytest.raises(DistsetupError, match=r"--train_batch_size 10 is not divisible by world size 4\.") as e:
        resolve_batch(None, None, 10, 4)
    assert "--micro_batch_size" not in e.value.message and "--gradient_accumulation" not in e.value.message


def test_inconsistent_trio_shows_the_arithmetic():
    with pytest.raises(
        DistsetupError,
        match=r"--train_batch_size 30 != --micro_batch_size 4 x --gradient_accumulation_steps 2 x world size 4 = 32",
    ):
        resolve_batch(4, 2, 30, 4)


def test_indivisible_train_batch_is_an_error():
    with pytest.raises(DistsetupError, match="not divisible"):
        resolve_batch(4, None, 30, 4)


@pytest.mark.parametrize("micro, accumulation", [(4, 2), (2, None), (None, None)])
def test_train_batch_without_world_size_is_an_error(micro, accumulation):
    with pytest.raises(DistsetupError, match="--train_batch_size needs the world size"):
        resolve_batch(micro, accumulation, 8, None)


@pytest.mark.parametrize(
    "micro, accumulation, message",
    [
        (4, 4, "15 is not a multiple of --micro_batch_size 4 x --gradient_accumulation_steps 4 = 16"),
        (None, 2, "15 is not a multiple of --gradient_accumulation_steps 2,"),
    ],
)
def test_train_batch_no_world_size_can_give_says_so_without_asking_for_it(micro, accumulation, message):
    """15 with micro 4 x accumulation 4 fits no world size: said so, not "needs the world size"."""
    with pytest.raises(DistsetupError, match=message) as info:
        resolve_batch(micro, accumulation, 15, None)
    assert "no world size gives it" in info.value.message


@pytest.mark.parametrize(
    "nodes, per_node, message",
    [
        (100_001, 8, "--num_nodes 100001 is more than 100,000"),
        (2, 1025, "--num_gpus_per_node 1025 is more than 1,024"),
        (0, 8, "--num_nodes 0 must be at least 1"),
    ],
)
def test_node_and_gpu_counts_have_sane_maxima(nodes, per_node, message):
    with pytest.raises(DistsetupError, match=message):
        world_size_from(None, nodes, per_node)


def test_world_size_from_nodes_and_gpus():
    assert world_size_from(None, 4, 8) == 32
    assert world_size_from(32, 4, 8) == 32
    with pytest.raises(DistsetupError, match="disagrees"):
        world_size_from(16, 4, 8)


def test_nodes_without_gpus_per_node_is_an_error():
    with pytest.raises(DistsetupError, match="--num_nodes 4 needs --num_gpus_per_node"):
        world_size_from(None, 4, None)
    assert world_size_from(None, None, 8) == 8  # one node
