"""The server's prompt cache in RAM: which states it keeps, which it finds, which it lets go."""

from edgerun.serve.prompt_cache import PromptCache


def state(n: int) -> bytearray:
    return bytearray(n)


def test_the_longest_shared_prefix_wins_and_short_prompts_are_not_kept():
    cache = PromptCache(10_000, min_gain=4)
    cache.put([1, 2, 3], state(10))  # under min_gain
    assert len(cache) == 0
    cache.put([1, 2, 3, 4, 5, 6], state(10))
    cache.put([1, 2, 9, 9, 9, 9], state(10))
    shared, entry = cache.best([1, 2, 3, 4, 7])
    assert shared == 4 and entry.tokens == [1, 2, 3, 4, 5, 6]
    assert cache.best([5, 5]) == (0, None)


def test_a_longer_state_replaces_the_ones_it_continues():
    cache = PromptCache(10_000, min_gain=2)
    cache.put([1, 2, 3], state(30))
    cache.put([1, 2, 3, 4, 5], state(50))
    assert len(cache) == 1 and cache.bytes == 50
    assert not cache.wants([1, 2, 3, 4])  # the kept state already serves it
    cache.put([1, 2, 3, 4], state(40))
    assert len(cache) == 1 and cache.best([1, 2, 3, 4])[1].tokens == [1, 2, 3, 4, 5]


def test_the_least_recently_used_goes_first_when_over_the_bytes():
    cache = PromptCache(100, min_gain=2)
    cache.put([1, 1], state(40))
    cache.put([2, 2], state(40))
    cache.used(cache.best([1, 1])[1])  # [1, 1] is now the newest
    cache.put([3, 3], state(40))
    assert cache.bytes == 80
    assert cache.best([2, 2]) == (0, None)
    assert cache.best([1, 1])[0] == 2 and cache.best([3, 3])[0] == 2
    cache.put([4, 4], state(101))  # larger than the whole cache: not kept, nothing evicted for it
    assert cache.bytes == 80 and cache.best([4, 4]) == (0, None)


def test_a_cache_of_no_bytes_keeps_nothing():
    cache = PromptCache(0, min_gain=1)
    assert not cache.wants([1, 2, 3])
    cache.put([1, 2, 3], state(0))
    assert len(cache) == 0
