"""The instance fetches from the pool only what its engine can load: an engine that takes pool blocks in whole runs
(vLLM: its own block of several kvmesh blocks) gets whole runs, and no fetch when the pool's extra blocks make
none."""

import asyncio
from types import SimpleNamespace

from kvmesh.contracts.layout import KVLayout
from kvmesh.instance.host import EngineHost, RolePlugin
from kvmesh.settings import EngineSettings, InstanceSettings

BS = 16


class Engine:
    def __init__(self, unit: int, local: int) -> None:
        self.adopt_unit, self.local = unit, local
        self.adopted: list[tuple[int, int]] = []

    def namespace(self, cache_salt: str = "", lora: str = "") -> int:
        return 7

    async def match_prefix(self, namespace, tokens, max_tokens: int) -> int:
        return self.local

    async def adopt(self, namespace, tokens, first_block: int, data, num_blocks: int) -> bool:
        self.adopted.append((first_block, num_blocks))
        return True


class Pool:
    def __init__(self) -> None:
        self.asked: list[int] = []

    async def fetch(self, keys, metadata=()):
        self.asked.append(len(keys))
        return SimpleNamespace(num_blocks=len(keys), data=memoryview(b""))


def fetch(unit: int, local: int, pool_blocks: int, prompt_len: int) -> tuple[int, Engine, Pool]:
    host = EngineHost(InstanceSettings(), EngineSettings(), [RolePlugin("test", attach=None)])
    host.engine, host.pool = Engine(unit, local), Pool()
    host.layout = KVLayout("m", 2, 1, 4, BS)
    n = asyncio.run(host.warm_from_pool(list(range(prompt_len)), "", pool_blocks)).blocks
    return n, host.engine, host.pool


def test_an_engine_that_loads_whole_runs_is_not_sent_the_pools_partial_run():
    # 1,532 tokens: vLLM holds 11 blocks of 128 (88 kvmesh blocks), the pool 93: the 5 past them fill no vLLM block
    n, engine, pool = fetch(unit=8, local=88, pool_blocks=93, prompt_len=1532)
    assert n == 0 and pool.asked == [] and engine.adopted == []


def test_it_fetches_the_whole_runs_the_pool_holds_past_the_local_hit():
    n, engine, pool = fetch(unit=8, local=88, pool_blocks=99, prompt_len=1600)
    assert n == 8 and pool.asked == [8] and engine.adopted == [(88, 8)]


def test_an_engine_that_takes_single_blocks_gets_every_one():
    n, engine, pool = fetch(unit=1, local=88, pool_blocks=93, prompt_len=1532)
    assert n == 5 and pool.asked == [5] and engine.adopted == [(88, 5)]
