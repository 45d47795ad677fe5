"""Unit tests of the paged KV cache: free queue, block pool, prefix hashes, KVCacheManager.

Expected block ids and orders are worked out by hand in the comments.
"""

import hashlib
import struct

import pytest

from workbench.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from workbench.core.kv_cache_manager import KVCacheManager
from workbench.core.kv_events import BlockAllocated, BlockRemoved, describe
from workbench.core.kv_cache_utils import (ROOT_HASH, block_extra_keys, hash_block_run, hash_block_tokens,
                                          hash_request_blocks)
from workbench.request import Request


def req(rid, tokens):
    return Request(rid, list(tokens))


def run_prefill(kv, request):
    """Admit ``request`` as the scheduler would and mark its whole prompt computed."""
    hits, num_hit = kv.get_computed_blocks(request)
    new = kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request, request.num_computed_tokens)
    return hits, num_hit


def snapshot(kv):
    return (
        kv.pool.free_queue.block_ids(),
        [(b.block_id, b.ref_count, b.block_hash, b.token_ids, b.owners) for b in kv.blocks],
        {rid: kv.block_table(rid) for rid in ("a", "b", "c")},
        dict(kv.pool.cached),
        (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits),
    )


# ------------------------------------------------------------------ free queue
def test_free_queue_order_and_o1_unlinking():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])  # unlink from the middle: neighbours are relinked, no scan
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert blocks[2] not in q and blocks[3] in q
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append(blocks[0])
    assert q.block_ids() == [1, 3, 4, 2, 0] and len(q) == 5
    q.remove(blocks[0])  # the back
    q.remove(blocks[1])  # the front
    assert q.block_ids() == [3, 4, 2] and len(q) == 3
    with pytest.raises(RuntimeError, match="not in the free queue"):
        q.remove(blocks[1])
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[3])
    for _ in range(3):
        q.popleft()
    with pytest.raises(ValueError, match="^No free blocks available$"):  # vLLM's type and message
        q.popleft()


def test_free_queue_popleft_n_takes_the_front_in_order_and_relinks_the_rest():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue([blocks[3], blocks[0], blocks[4], blocks[1], blocks[2]])
    with pytest.raises(ValueError, match="only 5 free"):
        q.popleft_n(6)
    assert q.block_ids() == [3, 0, 4, 1, 2] and len(q) == 5  # nothing unlinked
    assert q.popleft_n(0) == [] and len(q) == 5
    assert q.popleft_n(3) == [blocks[3], blocks[0], blocks[4]]  # the same as three popleft()
    assert all(b.prev_free is None and b.next_free is None and b not in q for b in blocks[3:] + blocks[:1])
    assert q.block_ids() == [1, 2] and len(q) == 2 and q._head.next_free is blocks[1]
    assert blocks[1].prev_free is q._head
    assert q.popleft_n(2) == [blocks[1], blocks[2]] and len(q) == 0
    assert q._head.next_free is q._tail and q._tail.prev_free is q._head

def test_free_queue_extend_links_in_order_and_refuses_a_queued_block_untouched():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks[:2])
    q.extend([blocks[4], blocks[2]])
    q.extend([])
    assert q.block_ids() == [0, 1, 4, 2] and len(q) == 4
    assert blocks[2].next_free is q._tail and q._tail.prev_free is blocks[2]
    backwards, node = [], q._tail.prev_free  # the back links too
    while node is not q._head:
        backwards.append(node.block_id)
        node = node.prev_free
    assert backwards == [2, 4, 1, 0]
    with pytest.raises(ValueError, match="block 1 is already in the free queue"):
        q.extend([blocks[5], blocks[1]])
    assert q.block_ids() == [0, 1, 4, 2] and len(q) == 4 and blocks[5] not in q


def test_free_tail_first_gives_lru_eviction_order():
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=False)
    a, b = req("a", range(5)), req("b", range(10, 13))
    assert [x.block_id for x in kv.allocate_slots(a, 5)] == [0, 1, 2]  # ceil(5/2) = 3
    assert [x.block_id for x in kv.allocate_slots(b, 3)] == [3, 4]  # ceil(3/2) = 2
    assert kv.pool.free_queue.block_ids() == [5]
    kv.free(b)  # b's tail (4) before its head (3)
    kv.free(a)  # then a's blocks, tail first: 2, 1, 0
    assert kv.pool.free_queue.block_ids() == [5, 4, 3, 2, 1, 0]
    c = req("c", range(20, 28))
    assert [x.block_id for x in kv.allocate_slots(c, 8)] == [5, 4, 3, 2]


# ------------------------------------------------------------------ hashes
def test_hash_is_sha256_of_parent_and_int64_tokens():
    expected = hashlib.sha256(ROOT_HASH + struct.pack("<3q", 7, 8, 2**40)).digest()
    assert hash_block_tokens(None, [7, 8, 2**40]) == expected
    assert len(expected) == 32


def test_hash_chain_same_prefix_same_hash_different_parent_different_hash():
    h1 = hash_request_blocks([1, 2, 3, 4, 5, 6, 7], block_size=2)
    h2 = hash_request_blocks([1, 2, 3, 4, 9, 9], block_size=2)
    assert len(h1) == 3 and len(h2) == 3  # only full blocks: 7 // 2 and 6 // 2
    assert h1[:2] == h2[:2] and h1[2] != h2[2]
    # The same tokens under another parent hash to something else: [5, 6] after [1,2,3,4]
    # versus [5, 6] after [0,2,3,4].
    other = hash_request_blocks([0, 2, 3, 4, 5, 6], block_size=2)
    assert other[2] != h1[2] and other[1] != h1[1]
    assert hash_block_tokens(h1[1], [5, 6]) == h1[2]
    assert hash_block_tokens(None, [5, 6]) != h1[2]


@pytest.mark.parametrize("salt, lora", [(None, None), ("s", None), (None, "ad"), ("s", "ad")])
@pytest.mark.parametrize("first_index", [0, 2])
def test_hash_block_run_is_the_chain_of_single_block_hashes(salt, lora, first_index):
    """A run hashed at once equals the blocks hashed one by one, each with its own extra keys
    (the salt on the request's block 0 only, the adapter on all), including the key bytes
    written out by hand; the partial tail is left out."""
    tokens, bs = list(range(11)), 4
    parent = None if first_index == 0 else hashlib.sha256(b"a parent").digest()
    expected, prev = [], parent
    for i in range(2):  # 11 // 4 full blocks
        keys = block_extra_keys(first_index + i, salt, lora)
        prev = hash_block_tokens(prev, tokens[i * bs:(i + 1) * bs], keys)
        expected.append(prev)
    assert hash_block_run(parent, tokens, bs, first_index, salt, lora) == expected
    keys = block_extra_keys(first_index, salt, lora)
    data = (parent or ROOT_HASH) + struct.pack("<4q", 0, 1, 2, 3)
    data += b"".join(struct.pack("<I", len(k)) + k.encode() for k in keys)
    assert expected[0] == hashlib.sha256(data).digest()


def test_cache_salt_enters_the_first_block_hash_only():
    """By hand: the salt, uint32-le length-prefixed, follows the first block's tokens; the
    second block chains on that hash with no salt of its own."""
    first = hashlib.sha256(ROOT_HASH + struct.pack("<2q", 1, 2) + struct.pack("<I", 3)
                           + b"abc").digest()
    second = hashlib.sha256(first + struct.pack("<2q", 3, 4)).digest()
    assert hash_request_blocks([1, 2, 3, 4], block_size=2, cache_salt="abc") == [first, second]
    plain = hash_request_blocks([1, 2, 3, 4], block_size=2)
    other = hash_request_blocks([1, 2, 3, 4], block_size=2, cache_salt="abd")
    assert not {first, second} & set(plain) and not {first, second} & set(other)


# ------------------------------------------------------------------ prefix cache
def test_hit_shares_blocks_without_copy_and_counts_stats():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", range(10))  # blocks [0, 1, 2]; full ones 0 and 1 get cached
    run_prefill(kv, a)
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.blocks[0].token_ids == (0, 1, 2, 3) and kv.blocks[1].token_ids == (4, 5, 6, 7)
    assert kv.blocks[2].token_ids == (8, 9) and kv.blocks[2].block_hash is None
    assert kv.num_cached_blocks == 2
    b = req("b", [0, 1, 2, 3, 4, 5, 6, 7, 50, 51])
    hits, num_hit = kv.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [0, 1] and num_hit == 8
    new = kv.allocate_slots(b, 2, hits)
    assert [x.block_id for x in new] == [3]
    assert kv.block_table("b") == [0, 1, 3]
    assert kv.blocks[0].ref_count == 2 and kv.blocks[0].owners == ("a", "b")
    assert kv.blocks[3].ref_count == 1
    # a: 10 tokens looked up, 0 hit; b: 10 looked up, 8 hit.
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (20, 8)
    b.num_computed_tokens = 8
    kv.check_invariants([a, b], {"b": 2})
    kv.free(a)
    assert kv.blocks[0].ref_count == 1 and kv.blocks[0].owners == ("b",)
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 2]  # only a's private block 2 came back


def test_hit_is_capped_so_last_prompt_token_is_computed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", range(13))  # 3 full blocks, all cached
    run_prefill(kv, a)
    kv.free(a)
    assert kv.num_cached_blocks == 3 and kv.num_free_blocks == 8
    exact = req("b", range(8))  # exactly 2 cached blocks: only 1 may be reused
    hits, num_hit = kv.get_computed_blocks(exact)
    assert [x.block_id for x in hits] == [0] and num_hit == 4
    longer = req("c", range(9))  # 2 full blocks + 1 token: both blocks reused
    assert kv.get_computed_blocks(longer)[1] == 8
    full = req("d", range(12))  # exactly 3 cached blocks: 2 reused, token 11 is computed
    assert kv.get_computed_blocks(full)[1] == 8


def test_hit_confirms_tokens_not_just_hash():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    run_prefill(kv, req("a", [1, 2, 3]))
    assert kv.blocks[0].block_hash is not None
    # Simulate a hash collision: the cached block's stored tokens differ from the query's.
    kv.blocks[0].token_ids = (1, 99)
    hits, num_hit = kv.get_computed_blocks(req("b", [1, 2, 3]))
    assert hits == [] and num_hit == 0


def test_cached_free_blocks_are_evicted_lazily_front_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])  # blocks 0,1,2; full blocks 0 ([1,2]) and 1 ([3,4]) cached
    run_prefill(kv, a)
    kv.free(a)  # queue: 3, then a's tail first: 2, 1, 0
    assert kv.pool.free_queue.block_ids() == [3, 2, 1, 0]
    assert kv.num_cached_blocks == 2 and kv.num_free_blocks == 4  # cached yet free
    b = req("b", [7, 8, 9])  # needs 2 blocks: 3 (empty) and 2 (uncached) -> no eviction
    kv.allocate_slots(b, 3)
    assert kv.block_table("b") == [3, 2] and kv.pool.num_evicted == 0
    c = req("c", [5, 5, 5])  # needs 2 more: 1 then 0, both cached -> both evicted
    kv.allocate_slots(c, 3)
    assert kv.block_table("c") == [1, 0]
    assert kv.pool.num_evicted == 2 and kv.num_cached_blocks == 0
    assert kv.blocks[0].block_hash is None and kv.blocks[0].token_ids == ()
    assert kv.get_computed_blocks(req("d", [1, 2, 3]))[1] == 0


def test_each_evicted_block_is_one_block_removed_event():
    # vLLM's KV-events consumers expect one BlockRemoved per block, in eviction order.
    kv = KVCacheManager(num_blocks=4, block_size=2, record_events=True)
    a = req("a", [1, 2, 3, 4, 5])  # blocks 0 ([1,2]) and 1 ([3,4]) cached, 2 holds [5]
    run_prefill(kv, a)
    kv.free(a)  # queue: 3, 2, 1, 0
    kv.take_events()
    h0 = hash_block_tokens(None, [1, 2])
    h1 = hash_block_tokens(h0, [3, 4])
    kv.allocate_slots(req("b", range(10, 18)), 8)  # all 4 blocks: 3, 2 (uncached), 1, 0 (cached)
    assert kv.take_events() == (
        BlockRemoved((h1,), (1,)), BlockRemoved((h0,), (0,)),
        BlockAllocated(3, "b"), BlockAllocated(2, "b"), BlockAllocated(1, "b"), BlockAllocated(0, "b"),
    )
    assert describe(BlockRemoved((h1,), (1,))) == f"evicted from the prefix cache: 1:{h1.hex()[:8]}"


def test_repeated_lookup_of_a_waiting_request_follows_the_cache():
    # A request that waits is looked up every step; the answer must track caching and eviction.
    kv = KVCacheManager(num_blocks=4, block_size=2)
    w = req("w", [1, 2, 3, 4, 5, 6])
    assert kv.get_computed_blocks(w) == ([], 0)
    a = req("a", [1, 2, 3])  # caches block 0 = [1, 2]
    run_prefill(kv, a)
    assert kv.get_computed_blocks(w) == ([kv.blocks[0]], 2)
    hits, _ = kv.get_computed_blocks(w)
    hits.append(None)  # the caller's list is its own
    assert kv.get_computed_blocks(w) == ([kv.blocks[0]], 2)
    kv.free(a)  # queue: 2, 3, then a's blocks tail first: 1, 0 (block 0 stays cached)
    b = req("b", [7, 8, 9, 9, 9, 9, 9, 9])  # takes all 4 blocks: evicts block 0
    kv.allocate_slots(b, 8)
    assert kv.pool.num_evicted == 1
    assert kv.get_computed_blocks(w) == ([], 0)


def test_hit_on_free_cached_block_takes_it_out_of_the_queue():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    run_prefill(kv, a := req("a", [1, 2, 3]))
    kv.free(a)  # queue: 2 3 1 0 -> a's blocks [0, 1] tail first after the untouched 2, 3
    assert kv.pool.free_queue.block_ids() == [2, 3, 1, 0]
    b = req("b", [1, 2, 8])
    hits, n = kv.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [0] and n == 2
    kv.allocate_slots(b, 1, hits)  # block 0 leaves the queue; 1 new block from the front: 2
    assert kv.block_table("b") == [0, 2]
    assert kv.pool.free_queue.block_ids() == [3, 1]
    assert kv.blocks[0].ref_count == 1


def test_allocate_slots_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4])
    run_prefill(kv, a)  # blocks 0, 1 (both cached)
    kv.free(a)
    b = req("b", [9, 9, 9])
    kv.allocate_slots(b, 3)  # blocks 2, 3; free queue: 1, 0 (both cached)
    b.num_computed_tokens = 3
    before = snapshot(kv)
    c = req("c", [1, 2, 3, 4, 5, 6, 7])
    hits, n = kv.get_computed_blocks(c)  # 2 hits, both free: taking them leaves 0 free blocks
    assert n == 4
    assert kv.allocate_slots(c, 3, hits) is None  # needs ceil(7/2) - 2 = 2 more: none left
    assert kv.allocate_slots(b, 7) is None  # ceil((3 + 7)/2) - 2 = 3 new blocks > 2 free
    assert snapshot(kv) == before


def test_allocate_slots_exact_fit_then_none():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    a = req("a", range(9))
    before = snapshot(kv)
    assert kv.allocate_slots(a, 13) is None  # ceil(13/4) = 4 > 3 blocks
    assert snapshot(kv) == before
    assert len(kv.allocate_slots(a, 12)) == 3  # exactly the pool
    assert kv.num_free_blocks == 0 and kv.usage == 1.0


def test_a_scheduled_request_grows_its_table_without_prefix_hits():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    a = req("a", range(5))
    assert [b.block_id for b in kv.allocate_slots(a, 5)] == [0, 1]  # ceil(5/4) = 2
    a.num_computed_tokens = 5
    assert kv.allocate_slots(a, 3) == []  # 8 tokens fit the 2 blocks
    assert [b.block_id for b in kv.allocate_slots(a, 8)] == [2, 3]  # ceil(13/4) = 4: 2 more
    assert kv.block_ids("a") == (0, 1, 2, 3)
    stats = kv.make_stats()
    assert (stats.num_blocks_allocated, stats.num_blocks_evicted) == (4, 0)
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.allocate_slots(a, 1, [kv.blocks[5]])  # prefix hits apply only at admission
    assert kv.block_ids("a") == (0, 1, 2, 3) and kv.num_free_blocks == 2


def test_reset_prefix_cache_only_when_idle():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    run_prefill(kv, a := req("a", [1, 2, 3]))
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.num_cached_blocks == 0 and kv.prefix_cache_stats.queries == 0
    assert kv.get_computed_blocks(req("b", [1, 2, 3]))[1] == 0


def test_prefix_caching_off_shares_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    run_prefill(kv, a := req("a", [1, 2, 3, 4, 5]))
    assert a.block_hashes == [] and kv.num_cached_blocks == 0
    assert kv.blocks[0].token_ids == (1, 2)  # tokens are still recorded for inspection
    assert kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5])) == ([], 0)


def test_check_invariants_names_the_broken_one():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    kv.check_invariants([a])
    with pytest.raises(AssertionError, match="not an unfinished request"):
        kv.check_invariants([])
    a.num_computed_tokens = 5
    with pytest.raises(AssertionError, match="block table"):
        kv.check_invariants([a])
    a.num_computed_tokens = 3
    kv.blocks[0].ref_count = 0
    with pytest.raises(AssertionError, match="block 0: ref_count=0 but not in the free queue"):
        kv.check_invariants([a])


def test_block_pool_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)


def test_repr_is_deterministic_and_html_is_a_grid():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    run_prefill(kv, req("a", [1, 2, 3]))
    assert repr(kv) == (
        "KVCacheManager(num_blocks=4, block_size=2, free=2, cached=1, usage=50.0%, "
        "requests=1, prefix_caching=True)"
    )
    assert "0x" not in repr(kv.blocks[0])
    html = kv._repr_html_()
    assert html.count("title=") == 4 and "owners a" in html


def test_cache_full_block_is_cache_full_blocks_of_one_block():
    """The one-block entry (a decode's block that filled up) changes the pool and records the
    events that cache_full_blocks does for that block: BlockStored when the hash is new, a
    BlockWritten when another block holds it."""
    results = []
    for one in (True, False):
        pool = BlockPool(4, record_events=True)
        blocks = pool.get_new_blocks(3, "r")
        pool.take_events()
        parent, h, tokens = b"p" * 32, b"h" * 32, (1, 2, 3, 4)
        for block in blocks[:2]:  # the second finds the hash held by the first
            if one:
                pool.cache_full_block(block, h, parent, tokens, 4)
            else:
                pool.cache_full_blocks([block], [h], parent, [tokens], 4)
        results.append((pool.take_events(), [(b.block_hash, b.token_ids) for b in pool.blocks],
                        pool.cached == {h: blocks[0]}, pool.cache_version, pool.num_evictable))
    assert results[0] == results[1]
    assert [describe(e) for e in results[0][0]] == [
        f"stored in the prefix cache: 0:{(b'h' * 32).hex()[:8]}", "block 1 holds 4 tokens"]


def test_block_hashes_grown_a_token_at_a_time_are_the_whole_prompts_hashes():
    """update_block_hashes as a decode calls it (one more token each time, so one new block
    now and then) gives every block the hash of the whole token list hashed at once, for a
    plain, a salted and an adapted request (the salt only in block 0, the adapter in all)."""
    from workbench.lora.request import LoRARequest

    kv = KVCacheManager(64, 4)
    adapter = LoRARequest("ad", 1, "/nowhere")
    for salt, lora in ((None, None), ("s", None), (None, adapter), ("s", adapter)):
        r = Request("r", [3, 1, 4, 1, 5, 9], cache_salt=salt, lora_request=lora)
        kv.update_block_hashes(r)
        for token in range(20, 35):
            r.output_token_ids.append(token)
            kv.update_block_hashes(r)
            assert r.block_hashes == hash_request_blocks(r.all_token_ids, 4, None, salt, r.lora_name)
        assert len(r.block_hashes) == 5
