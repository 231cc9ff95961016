"""Decode puts a push back together from its parts (whole blocks or layer groups of them): loadable only when
every (block, layer) is covered once by parts whose keys are the prompt's; what it imports is the KV sent."""

from __future__ import annotations

import pytest
import torch
from kvmesh.contracts.keys import block_keys
from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.kv_cache import DeviceKVPool, block_bytes, blocks_from_bytes
from kvmesh.transfer.assembly import Assembly
from kvmesh.transfer.server import ReceivedBlocks

LAYOUT = KVLayout("t", 4, 1, 2, 4)
PROMPT = list(range(10, 24))  # 14 tokens: blocks 0-2 full, block 3 holds 2
KEYS = block_keys(7, PROMPT, 4)


def part(source: DeviceKVPool, first: int, n: int, layers: tuple[int, int] | None, i: int = 0) -> ReceivedBlocks:
    """Blocks ``first .. first+n-1`` of the prompt, as a verified transfer of that slice of ``source``."""
    data = bytearray(block_bytes(source.read_blocks(list(range(first, first + n)), layers)))
    tokens = min(len(PROMPT), (first + n) * 4) - first * 4
    return ReceivedBlocks(f"r@p#{i}", LAYOUT, tuple(KEYS[first:first + tokens // 4]), tokens, memoryview(data),
                          len(data), 0.0, (), layers, first)


@pytest.fixture
def source() -> DeviceKVPool:
    pool = DeviceKVPool(LAYOUT, 8)
    pool.write_blocks(list(range(4)), torch.randn(4, *LAYOUT.block_shape))
    return pool


def test_chunk_parts_in_layer_groups_cover_the_push_and_import_to_the_blocks_sent(source):
    asm = Assembly(LAYOUT, 1, len(PROMPT), KEYS)
    for i, (first, n, layers) in enumerate([(1, 2, (0, 1)), (1, 2, (1, 4)), (3, 1, (0, 2)), (3, 1, (2, 4))]):
        assert asm.missing()
        asm.add(part(source, first, n, layers, i))
    assert asm.missing() == ""
    dst = DeviceKVPool(LAYOUT, 8)
    for p in asm.parts:  # what the engine's import does with them, blocks placed at the same ids here
        dst.write_blocks(list(range(p.first_block, p.first_block + p.num_blocks)),
                         blocks_from_bytes(LAYOUT, p.data, p.layers), p.layers)
    assert dst.read_blocks([1, 2, 3]).equal(source.read_blocks([1, 2, 3]))


def test_a_layer_group_that_never_arrived_is_not_loadable(source):
    asm = Assembly(LAYOUT, 0, len(PROMPT), KEYS)
    asm.add(part(source, 0, 4, (0, 3)))
    assert "4 (block, layer) slices never arrived (first: block 0, layer 3)" in asm.missing()


def test_whole_block_parts_still_assemble(source):
    asm = Assembly(LAYOUT, 0, len(PROMPT), KEYS)
    asm.add(part(source, 0, 3, None))
    assert asm.missing()
    asm.add(part(source, 3, 1, None, 1))
    assert asm.missing() == "" and [p.layers for p in asm.parts] == [None, None]


def test_a_part_with_another_prompts_keys_is_refused(source):
    asm = Assembly(LAYOUT, 0, len(PROMPT), block_keys(8, PROMPT, 4))  # another namespace
    with pytest.raises(ValueError, match="block keys differ"):
        asm.add(part(source, 0, 2, (0, 4)))


def test_the_same_layers_of_a_block_twice_are_refused(source):
    asm = Assembly(LAYOUT, 0, len(PROMPT), KEYS)
    asm.add(part(source, 0, 2, (0, 2)))
    with pytest.raises(ValueError, match="another part holds"):
        asm.add(part(source, 1, 1, (1, 3), 1))


def test_a_part_past_the_prompt_is_refused(source):
    asm = Assembly(LAYOUT, 2, 8, KEYS[:2])  # an 8-token prompt: blocks 0-1, the push starts at block 2
    with pytest.raises(ValueError, match="outside"):
        asm.add(part(source, 2, 1, None))


def test_a_part_landed_in_place_covers_its_cells_without_bytes_to_copy(source):
    from dataclasses import replace

    asm = Assembly(LAYOUT, 0, len(PROMPT), KEYS)
    landed = replace(part(source, 0, 4, (0, 2)), data=memoryview(b""), landed=True)
    asm.add(landed)
    asm.add(part(source, 0, 4, (2, 4), 1))  # buffered (arrived before the reservation, say)
    assert asm.missing() == "" and [(p.layers, p.data is None) for p in asm.parts] == [((0, 2), True),
                                                                                       ((2, 4), False)]
    assert asm.landed_bytes == landed.nbytes
