"""The routing policies in pure Python: round robin in turn, least load by work after the request,
cache-aware by longest match unless loads are imbalanced; and a simulated two-replica
shared-prefix workload where cache-aware beats round robin on hit rate without piling up."""

import random

import pytest

from jaxserve.router.policy import CacheAware, CacheAwareConfig, LeastLoad, ReplicaView, RoundRobin, make_policy
from jaxserve.router.prefix_index import PrefixIndex


def v(pending=0, in_flight=0, matched=0, indexed=0):
    return ReplicaView(pending, in_flight, matched, indexed)


def test_round_robin_takes_turns_whatever_the_load():
    rr = RoundRobin()
    views = [v(pending=10_000), v(), v()]
    assert [rr.choose(views, 10) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_load_counts_pending_tokens_requests_and_this_requests_uncached_part():
    ll = LeastLoad(CacheAwareConfig(request_cost_tokens=100))
    assert ll.choose([v(pending=500), v(pending=100)], 10) == 1
    assert ll.choose([v(in_flight=3), v(pending=250)], 10) == 1          # 300 vs 250
    # equal load: the replica that already holds 900 of the 1000 tokens has less work after it
    assert ll.choose([v(), v(matched=900)], 1000) == 1
    # ties: the smaller index, then the lower position
    assert ll.choose([v(indexed=64), v(indexed=0)], 10) == 1
    assert ll.choose([v(), v()], 10) == 0


def test_cache_aware_follows_the_longest_match_while_balanced():
    ca = CacheAware(CacheAwareConfig(balance_abs_tokens=1000, balance_rel=1.5))
    assert ca.choose([v(matched=64), v(matched=512), v(matched=128)], 600) == 1
    # some load, still within the thresholds: affinity wins
    assert ca.choose([v(pending=900, matched=512), v(pending=0)], 600) == 0
    # equal matches: the less loaded one
    assert ca.choose([v(pending=300, matched=512), v(pending=100, matched=512)], 600) == 1


def test_cache_aware_balances_when_loads_are_imbalanced():
    ca = CacheAware(CacheAwareConfig(balance_abs_tokens=1000, balance_rel=1.5, request_cost_tokens=0))
    # 2000 apart and more than 1.5x: least load, whatever the match
    assert ca.choose([v(pending=2100, matched=512), v(pending=100)], 600) == 1
    # far apart in ratio but not in tokens: still affinity
    assert ca.choose([v(pending=900, matched=512), v(pending=1)], 600) == 0
    # far apart in tokens but not in ratio: still affinity
    assert ca.choose([v(pending=12_000, matched=512), v(pending=10_000)], 600) == 0


def test_cache_aware_without_a_useful_match_routes_by_load():
    ca = CacheAware(CacheAwareConfig(min_match_ratio=0.25))
    assert ca.choose([v(pending=50, matched=16), v()], 1000) == 1        # 16 of 1000 is no match
    assert ca.choose([v(pending=50), v()], 1000) == 1
    assert ca.choose([v(pending=50, matched=300), v()], 1000) == 0
    assert ca.choose([v(matched=0)], 0) == 0                             # no ids known, one replica


def test_make_policy_names_and_bad_config():
    assert make_policy("round_robin").name == "round_robin"
    assert make_policy("least_load").name == "least_load"
    assert make_policy("cache_aware").name == "cache_aware"
    with pytest.raises(ValueError, match="policy='random'"):
        make_policy("random")
    with pytest.raises(ValueError, match="balance_rel"):
        CacheAwareConfig(balance_rel=0.5)
    with pytest.raises(ValueError, match="min_match_ratio"):
        CacheAwareConfig(min_match_ratio=2)
    with pytest.raises(ValueError, match="balance_abs_tokens"):
        CacheAwareConfig(balance_abs_tokens=-1)


def simulate(policy, *, replicas=2, groups=6, per_group=8, system=256, question=32, concurrency=4, seed=0,
             capacity_tokens=1 << 20):
    """A shared-prefix workload against simulated replicas whose prefix cache is exactly what was
    sent to them (an unbounded PrefixIndex each). Requests are served `concurrency` at a time;
    prefill work left is the uncached part. Returns (hit rate, requests per replica)."""
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        sys_ids = [rng.randrange(1000) for _ in range(system)]
        for _ in range(per_group):
            prompts.append(sys_ids + [rng.randrange(1000) for _ in range(question)])
    rng.shuffle(prompts)
    router_index = [PrefixIndex(chunk_tokens=16, max_tokens=capacity_tokens) for _ in range(replicas)]
    truth = [PrefixIndex(chunk_tokens=16, max_tokens=capacity_tokens) for _ in range(replicas)]
    in_flight: list[list[int]] = [[] for _ in range(replicas)]    # uncached tokens per live request
    live: list[int] = []                                           # replicas of live requests, oldest first
    hits = total = 0
    counts = [0] * replicas
    for p in prompts:
        if len(live) >= concurrency:            # the oldest live request ends
            in_flight[live.pop(0)].pop(0)
        views = [ReplicaView(sum(in_flight[i]), len(in_flight[i]), router_index[i].peek(None, p),
                             router_index[i].num_tokens) for i in range(replicas)]
        i = policy.choose(views, len(p))
        router_index[i].insert(None, p)
        cached = truth[i].match(None, p)
        truth[i].insert(None, p)
        hits += cached
        total += len(p)
        counts[i] += 1
        in_flight[i].append(len(p) - cached)
        live.append(i)
    return hits / total, counts


@pytest.mark.parametrize("seed", range(5))
def test_simulated_shared_prefix_workload_cache_aware_beats_round_robin_within_a_bounded_share(seed):
    ca_rate, ca_counts = simulate(CacheAware(CacheAwareConfig(balance_abs_tokens=512)), seed=seed)
    rr_rate, rr_counts = simulate(RoundRobin(), seed=seed)
    ll_rate, _ = simulate(LeastLoad(), seed=seed)
    assert ca_rate > rr_rate
    assert ca_rate >= ll_rate * 0.95
    # the ceiling: every group's first request misses once, all the rest hit their system prompt
    ceiling = (6 * 8 * 256 - 6 * 256) / (6 * 8 * 288)
    assert ca_rate > 0.8 * ceiling
    share = sum(ca_counts) / len(ca_counts)
    assert max(ca_counts) <= 1.5 * share, ca_counts


def test_one_hot_group_does_not_pile_onto_one_replica():
    """Every request shares one system prompt: pure affinity would send all to one replica; the
    imbalance check spreads them once the loads drift apart."""
    ca = CacheAware(CacheAwareConfig(balance_abs_tokens=256, balance_rel=1.5, request_cost_tokens=64))
    _, counts = simulate(ca, groups=1, per_group=40, system=256, question=64, concurrency=8)
    assert min(counts) >= 0.25 * sum(counts), counts
