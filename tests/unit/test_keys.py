import pytest
from kvmesh.contracts.keys import Namespace, block_keys, block_keys_and_plain, chain_key


def test_keys_are_stable_across_processes():
    # a fixed value: any change to the hashing breaks every cache and index built before it
    seed = Namespace("model-fp", "tok-fp").seed
    assert block_keys(seed, list(range(8)), 4) == [chain_key(seed, [0, 1, 2, 3]),
                                                   chain_key(chain_key(seed, [0, 1, 2, 3]), [4, 5, 6, 7])]
    assert chain_key(0, [1, 2, 3, 4]) == 0x6FC1EBD4F4D6EA31


def test_only_full_blocks_have_keys():
    assert len(block_keys(1, list(range(11)), 4)) == 2


def test_equal_prefixes_share_keys_and_diverging_blocks_do_not():
    a = block_keys(7, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_keys(7, [1, 2, 3, 4, 5, 6, 7, 9], 4)
    assert a[0] == b[0] and a[1] != b[1]


def test_a_block_key_depends_on_its_whole_prefix():
    a = block_keys(7, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_keys(7, [0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]


def test_salt_lora_and_model_each_change_the_namespace():
    base = Namespace("m", "t")
    others = [Namespace("m", "t", cache_salt="tenant"), Namespace("m", "t", lora_id="lora"),
              Namespace("m2", "t"), Namespace("m", "t", mm_hashes=("img",))]
    seeds = {base.seed, *(o.seed for o in others)}
    assert len(seeds) == 5
    assert block_keys(base.seed, [1, 2, 3, 4], 4) != block_keys(others[0].seed, [1, 2, 3, 4], 4)


@pytest.mark.parametrize("n", [0, 15, 16, 17, 64, 1000])
def test_keys_and_plain_keys_in_one_pass_are_each_chain_alone(n):
    tokens = [(i * 7919) % 50000 for i in range(n)]
    keys, plain = block_keys_and_plain(12345, tokens, 16)
    assert keys == block_keys(12345, tokens, 16) and plain == block_keys(0, tokens, 16)
    assert len(keys) == n // 16 and (not keys or keys != plain)
