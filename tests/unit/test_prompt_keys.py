"""The router's prompt key memo: every answer equal to hashing the prompt whole."""

import dataclasses
import random

import pytest
from kvmesh.contracts.keys import block_keys_and_plain, int32s

from services.router.prompt_keys import PromptKeys


def _check(memo: PromptKeys, seed: int, tokens: list[int]) -> tuple[list[int], list[int]]:
    got = memo(seed, int32s(tokens))
    assert got == block_keys_and_plain(seed, tokens, memo.block_size)
    return got


def test_a_prompt_sharing_a_namespaces_last_prompts_blocks_hashes_only_the_rest():
    memo = PromptKeys(16)
    system = list(range(1000, 1000 + 16 * 10))
    _check(memo, 7, system + [1, 2, 3] * 20)
    assert (memo.reused_blocks, memo.hashed_blocks) == (0, 13)
    _check(memo, 7, system + [4, 5, 6] * 20)  # the 10 system blocks shared, the rest differs from its first token
    assert (memo.reused_blocks, memo.hashed_blocks) == (10, 13 + 3)
    _check(memo, 7, system + [4, 5, 6] * 20 + [9] * 40)  # a later turn: all of the last prompt's blocks shared
    assert (memo.reused_blocks, memo.hashed_blocks) == (10 + 13, 16 + 3)


def test_namespaces_never_share_keys_and_a_difference_inside_a_block_rehashes_it():
    memo = PromptKeys(4)
    tokens = list(range(40))
    a = _check(memo, 1, tokens)
    b = _check(memo, 2, tokens)  # same tokens, another namespace: its own keys, its plain keys the same
    assert a[0] != b[0] and a[1] == b[1] and memo.reused_blocks == 0
    changed = tokens[:]
    changed[9] = 999  # block 2's second token
    _check(memo, 1, changed)
    assert memo.reused_blocks == 2
    _check(memo, 1, changed[:6])  # shorter than the last: one full block, from it
    _check(memo, 1, [])
    _check(memo, 1, changed[:3])


def test_random_prompts_against_hashing_them_whole():
    rng = random.Random(5)
    memo = PromptKeys(16, capacity_bytes=64 << 10)
    stems = [[rng.randrange(50_000) for _ in range(rng.randrange(0, 600))] for _ in range(6)]
    for _ in range(400):
        seed = rng.randrange(4)  # a namespace's prompts mostly share its stem, at any length
        stem = stems[seed] if rng.random() < 0.8 else rng.choice(stems)
        cut = rng.randrange(len(stem) // 2, len(stem) + 1) if rng.random() < 0.8 else rng.randrange(len(stem) + 1)
        tail = [rng.randrange(50_000) for _ in range(rng.randrange(0, 80))]
        _check(memo, seed, stem[:cut] + tail)
        assert memo.bytes <= memo.capacity_bytes
    assert memo.reused_blocks > memo.hashed_blocks / 2  # the point of it, on prompts that share stems


def test_the_caller_may_change_its_lists_and_the_memo_keeps_to_its_budget():
    memo = PromptKeys(4, capacity_bytes=3_000)
    keys, plain = memo(1, int32s(range(64)))
    keys.clear()
    plain.append(0)
    _check(memo, 1, list(range(64)))
    for seed in range(2, 20):
        _check(memo, seed, list(range(64)))
    assert 0 < len(memo) < 19 and memo.bytes <= 3_000
    assert PromptKeys(4, capacity_bytes=0)(1, int32s(range(8))) == block_keys_and_plain(1, range(8), 4)


@pytest.mark.parametrize("n", [0, 15, 16, 17, 64])
def test_block_keys_and_plain_of_any_length(n):
    memo = PromptKeys(16)
    _check(memo, 3, list(range(n)))
    _check(memo, 3, list(range(n)))


def test_prompts_of_several_system_prompts_in_one_namespace_interleaved_each_reuse_their_own():
    memo = PromptKeys(16)
    systems = [[s * 1000 + i for i in range(16 * 8)] for s in range(1, 4)]
    for turn in range(6):
        for system in systems:
            _check(memo, 9, system + [turn] * 20)
    assert memo.hashed_blocks == 3 * 9 + 15 * 1 and memo.reused_blocks == 15 * 8 and len(memo) == 3


def test_an_entry_under_another_seed_is_never_reused_even_at_the_same_first_key():
    memo = PromptKeys(4)
    tokens = list(range(40))
    memo(1, int32s(tokens))
    first = next(iter(memo._last))
    memo._last[first] = dataclasses.replace(memo._last[first], seed=2)  # as if seed 2's first key were seed 1's
    _check(memo, 1, tokens)  # keyed alike, but its keys are another namespace's: hashed again
    assert memo.reused_blocks == 0
