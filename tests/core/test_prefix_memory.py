"""PrefixMemory stays within its capacity (oldest entries dropped first) and finds the same
tokens cached under another salt or adapter however far back its chain was forgotten."""

from workbench.core.kv_cache_manager import KVCacheManager
from workbench.core.prefix_memory import PrefixMemory
from workbench.request import Request
from workbench.sampling_params import SamplingParams


def request(rid, tokens, salt=None):
    r = Request(rid, tokens, SamplingParams(max_tokens=1), cache_salt=salt)
    KVCacheManager(64, 4).update_block_hashes(r)
    return r


def test_evictions_are_bounded_oldest_first():
    memory = PrefixMemory(block_size=4, capacity=2)
    for step, h in enumerate((b"a", b"b", b"c")):
        memory.step = step
        memory.evicted(h, f"r{step}")
    assert memory.evictions == {b"b": (1, "r1"), b"c": (2, "r2")}
    memory.step = 7
    memory.evicted(b"b", "r9")  # evicted again: the newest kept, last
    assert list(memory.evictions.items()) == [(b"c", (2, "r2")), (b"b", (7, "r9"))]


def test_same_tokens_under_another_salt_are_found_after_the_chain_is_forgotten():
    tokens = list(range(100, 124))  # 6 full blocks of 4
    memory = PrefixMemory(block_size=4, capacity=3)
    # only the last 3 blocks' keys are kept
    memory.stored(request("plain", tokens), 0, [tuple(tokens[i:i + 4]) for i in range(0, 24, 4)])
    salted = request("salted", tokens, salt="s")
    assert memory.stored_under(salted, 5) == (None, None)  # recomputed from block 0
    assert memory.stored_under(request("other", tokens[:20] + [1, 2, 3, 4]), 5) is None
