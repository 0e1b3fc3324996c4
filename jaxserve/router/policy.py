"""Routing policies: which replica gets a request.

A policy sees each candidate replica as a ReplicaView (its load, and how much of this request's
prompt its prefix index matches) and returns the index of the chosen one. Load is work not yet
done, in prompt-token units: the uncached prompt tokens of the router's requests on it that have
not produced a first token yet, plus `request_cost_tokens` for every request it is serving (a
decoding request occupies a seat and a share of every step).

- round_robin: in turn, blind to prompts and load.
- least_load: the least work after adding this request (its uncached tokens counted on each).
- cache_aware: the longest prefix match (the prefix cache then saves that much prefill), unless the
  replicas' loads are imbalanced; then, and for a prompt no replica matches well, least_load.
  Imbalanced means max - min > `balance_abs_tokens` and max > `balance_rel` x min, as in SGLang's
  cache-aware router: pure affinity piles a popular group onto one replica. Among equal matches
  the least-loaded wins, then the replica with the smaller index (more room for new prefixes).
- kv_events: cache_aware's choice, on what the replicas' own KV events say they hold
  (router/event_index.py) instead of the router's record of what it sent them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

POLICIES = ("cache_aware", "round_robin", "least_load", "kv_events")


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One candidate, as a policy sees it."""

    pending_prefill_tokens: int     # uncached prompt tokens of its requests with no first token yet
    in_flight: int                  # the router's requests on it now
    matched_tokens: int             # prefix of this request its index holds
    indexed_tokens: int = 0         # size of its prefix index

    def load(self, request_cost_tokens: int) -> int:
        return self.pending_prefill_tokens + request_cost_tokens * self.in_flight


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    balance_abs_tokens: int = 2048    # loads this far apart (and `balance_rel` x) are imbalanced
    balance_rel: float = 1.5
    min_match_ratio: float = 0.1      # a match shorter than this share of the prompt is no match
    request_cost_tokens: int = 256    # a running request's weight in the load, in prompt tokens

    def __post_init__(self) -> None:
        if self.balance_abs_tokens < 0:
            raise ValueError(f"balance_abs_tokens={self.balance_abs_tokens} must be >= 0")
        if self.balance_rel < 1.0:
            raise ValueError(f"balance_rel={self.balance_rel} must be >= 1")
        if not 0.0 <= self.min_match_ratio <= 1.0:
            raise ValueError(f"min_match_ratio={self.min_match_ratio} must be in [0, 1]")
        if self.request_cost_tokens < 0:
            raise ValueError(f"request_cost_tokens={self.request_cost_tokens} must be >= 0")


class Policy(Protocol):
    name: str

    def choose(self, views: Sequence[ReplicaView], prompt_tokens: int) -> int: ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, views: Sequence[ReplicaView], prompt_tokens: int) -> int:
        i = self._next % len(views)
        self._next += 1
        return i


class LeastLoad:
    name = "least_load"

    def __init__(self, config: CacheAwareConfig = CacheAwareConfig()) -> None:
        self.config = config

    def choose(self, views: Sequence[ReplicaView], prompt_tokens: int) -> int:
        cost = self.config.request_cost_tokens

        def after(i: int) -> tuple:
            v = views[i]
            return (v.load(cost) + cost + max(0, prompt_tokens - v.matched_tokens), v.indexed_tokens, i)

        return min(range(len(views)), key=after)


class CacheAware:
    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig = CacheAwareConfig()) -> None:
        self.config = config
        self._least = LeastLoad(config)

    def imbalanced(self, views: Sequence[ReplicaView]) -> bool:
        loads = [v.load(self.config.request_cost_tokens) for v in views]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.config.balance_abs_tokens and hi > self.config.balance_rel * lo

    def choose(self, views: Sequence[ReplicaView], prompt_tokens: int) -> int:
        best = max(v.matched_tokens for v in views)
        if (len(views) == 1 or self.imbalanced(views) or best == 0
                or best < self.config.min_match_ratio * prompt_tokens):
            return self._least.choose(views, prompt_tokens)
        cost = self.config.request_cost_tokens
        return min((i for i, v in enumerate(views) if v.matched_tokens == best),
                   key=lambda i: (views[i].load(cost), i))


class KVEventsAware(CacheAware):
    """cache_aware on the replicas' EventIndex (the router builds that index for this policy)."""

    name = "kv_events"


def make_policy(name: str, config: CacheAwareConfig = CacheAwareConfig()) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad(config)
    if name == "cache_aware":
        return CacheAware(config)
    if name == "kv_events":
        return KVEventsAware(config)
    raise ValueError(f"policy={name!r} must be one of {', '.join(POLICIES)}")
