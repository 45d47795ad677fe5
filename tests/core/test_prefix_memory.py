"""PrefixMemory stays within its capacity (oldest entries dropped first) and finds the same
tokens cached under another salt or adapter however far back its chain was forgotten."""

from workbench.core.kv_cache_manager import KVCacheManager
from workbench.core.prefix_memory import PrefixMemory
from workbench.lora.request import LoRARequest
from workbench.request import Request
from workbench.sampling_params import SamplingParams


def request(rid, tokens, salt=None, lora=None):
    r = Request(rid, tokens, SamplingParams(max_tokens=1), cache_salt=salt, lora_request=lora)
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


def test_content_keys_leave_salt_and_adapter_out_and_survive_a_forgotten_memo():
    """A plain request's content keys are its block hashes (the same tokens without a salt
    or an adapter hash to them whatever is mixed into the request's own hashes); blocks
    cached under a salt or an adapter are named under it, found from a plain request and
    from another salt, however far back the salted request's memo was forgotten."""
    tokens = list(range(200, 224))  # 6 full blocks of 4
    memory = PrefixMemory(block_size=4, capacity=3)
    plain = request("plain", tokens)
    assert [memory.content_key(plain, i) for i in range(6)] == plain.block_hashes
    salted = request("salted", tokens, salt="s")
    adapted = request("adapted", tokens, lora=LoRARequest("ad", 1, "/nowhere"))
    for other in (salted, adapted):
        assert other.block_hashes != plain.block_hashes
        assert [memory.content_key(other, i) for i in range(6)] == plain.block_hashes
    blocks = [tuple(tokens[i:i + 4]) for i in range(0, 24, 4)]
    memory.stored(salted, 0, blocks[:2])
    memory.stored(salted, 2, blocks[2:])  # chained on block 1's key, which the memo forgot
    assert memory.stored_under(plain, 5) == ("s", None)
    assert memory.stored_under(plain, 2) is None  # only the last 3 kept
    assert memory.stored_under(request("salted2", tokens, salt="t"), 4) == ("s", None)
    memory.stored(adapted, 3, blocks[3:5])  # blocks 3 and 4 again, now under the adapter
    assert memory.stored_under(plain, 4) == (None, "ad")
    assert memory.stored_under(plain, 5) == ("s", None)
