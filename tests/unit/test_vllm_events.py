"""vLLM's KV events as kvmesh's (kvmesh/vllm/events.py), without vLLM: events shaped like vLLM 0.32's. Keys are
kvmesh's own, computed from the token ids inside each vLLM block; a removal maps back through the blocks stored."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.contracts import events as kv
from kvmesh.contracts.keys import Namespace, block_keys
from kvmesh.vllm.events import Translator

BS, VBS = 4, 8  # kvmesh's block size, vLLM's (two kvmesh blocks in each)


@dataclass
class BlockStored:  # vllm.distributed.kv_events.BlockStored: the fields the translator reads
    block_hashes: list
    parent_block_hash: object
    token_ids: list
    block_size: int = VBS
    lora_name: str | None = None
    medium: str | None = "GPU"
    extra_keys: list | None = None


@dataclass
class BlockRemoved:
    block_hashes: list
    medium: str | None = "GPU"


class AllBlocksCleared:
    pass


def seed(salt: str = "", lora: str = "") -> int:
    return Namespace("m", "t", lora, salt).seed


def translator() -> Translator:
    return Translator(BS, lambda salt, lora: seed(salt, lora))


def test_a_chain_of_vllm_blocks_becomes_the_kvmesh_keys_of_its_tokens():
    t = translator()
    tokens = list(range(100, 124))  # 3 vLLM blocks = 6 kvmesh blocks
    out = t.translate([BlockStored([11, 12], None, tokens[:16]), BlockStored([13], 12, tokens[16:24])])
    want = block_keys(seed(), tokens, BS)
    assert out == [kv.BlockStored(tuple(want[:4]), None, BS, "device"),
                   kv.BlockStored(tuple(want[4:]), want[3], BS, "device")]
    assert t.holds(seed(), tokens + [1, 2], 26) == 6
    assert t.holds(seed(), tokens, 12) == 3  # within max_tokens
    assert sorted(k for k, _ in t.snapshot()) == sorted(want)


def test_the_salt_and_the_adapter_pick_the_namespace_from_the_first_blocks_extra_keys():
    t = translator()
    tokens = list(range(8))
    salted = t.translate([BlockStored([1], None, tokens, extra_keys=[("tenant-a",)])])
    lora = t.translate([BlockStored([2], None, tokens, lora_name="sql@ab12", extra_keys=[("sql@ab12",)])])
    both = t.translate([BlockStored([3], None, tokens, lora_name="sql@ab12", extra_keys=[("sql@ab12", "tenant-a")])])
    assert salted[0].block_keys == tuple(block_keys(seed("tenant-a"), tokens, BS))
    assert lora[0].block_keys == tuple(block_keys(seed("", "sql@ab12"), tokens, BS))
    assert both[0].block_keys == tuple(block_keys(seed("tenant-a", "sql@ab12"), tokens, BS))
    assert len({salted[0].block_keys, lora[0].block_keys, both[0].block_keys}) == 3


def test_a_removal_names_the_kvmesh_keys_of_the_vllm_block_and_forgets_them():
    t = translator()
    tokens = list(range(16))
    t.translate([BlockStored([1, 2], None, tokens)])
    want = block_keys(seed(), tokens, BS)
    assert t.translate([BlockRemoved([2])]) == [kv.BlockRemoved(tuple(want[2:]), "device", "vllm lru")]
    assert t.holds(seed(), tokens, 16) == 2
    assert t.translate([BlockRemoved([2])]) == []  # unknown now: nothing to say


def test_a_block_whose_parent_is_unknown_is_skipped_not_guessed():
    t = translator()
    assert t.translate([BlockStored([5], 4, list(range(8)))]) == []
    assert t.skipped == 1 and not t.held


def test_all_blocks_cleared_forgets_everything():
    t = translator()
    t.translate([BlockStored([1], None, list(range(8)))])
    out = t.translate([AllBlocksCleared()])
    assert type(out[0]).__name__ == "AllBlocksCleared" and not t.held and t.snapshot() == []


def test_a_prefix_hit_announced_again_adds_nothing_twice():
    t = translator()
    ev = BlockStored([1], None, list(range(8)))
    t.translate([ev])
    t.translate([ev])
    assert sum(t.held.values()) == 2
    t.translate([BlockRemoved([1])])
    assert not t.held
