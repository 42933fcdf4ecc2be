import pytest

from distsetup.batch import resolve_batch, world_size_from
from distsetup.errors import DistsetupError


@pytest.mark.parametrize("micro, accumulation, train, world", [
    (4, 2, None, 8), (4, None, 64, 8), (None, 2, 64, 8), (3, 5, 60, 4)])
def test_any_two_batch_values_give_the_third(micro, accumulation, train, world):
    batch = resolve_batch(micro, accumulation, train, world)
    assert batch.micro * batch.accumulation * world == batch.train_batch
    for given, resolved in ((micro, batch.micro), (accumulation, batch.accumulation), (train, batch.train_batch)):
        assert given is None or given == resolved


def test_inconsistent_trio_shows_the_arithmetic():
    with pytest.raises(DistsetupError, match=r"4 x gradient_accumulation 2 x world_size 4 = 32, not train_batch_size 30"):
        resolve_batch(4, 2, 30, 4)


def test_indivisible_train_batch_is_an_error():
    with pytest.raises(DistsetupError, match="not divisible"):
        resolve_batch(4, None, 30, 4)


@pytest.mark.parametrize("micro, accumulation", [(4, 2), (3, None), (None, None)])
def test_train_batch_without_world_size_is_an_error(micro, accumulation):
    with pytest.raises(DistsetupError, match="--train_batch_size needs the world size"):
        resolve_batch(micro, accumulation, 8, None)


def test_world_size_from_nodes_and_gpus():
    assert world_size_from(None, 4, 8) == 32
    assert world_size_from(32, 4, 8) == 32
    with pytest.raises(DistsetupError, match="disagrees"):
        world_size_from(16, 4, 8)


def test_nodes_without_gpus_per_node_is_an_error():
    with pytest.raises(DistsetupError, match="--num_nodes 4 needs --num_gpus_per_node"):
        world_size_from(None, 4, None)
    assert world_size_from(None, None, 8) == 8          # one node
