"""LoRASlots, the scheduler's component for adapter slots: a free slot first, then the least
recently used slot no running request holds; a held slot is never taken; release is idempotent;
a forgotten adapter's slot is reused once idle. And through the Scheduler: a request waits for a
slot (never fails), others go past it, and it runs when a slot frees."""

from jaxserve.sched.lora_slots import LoRASlots
from jaxserve.sched.request import Request
from jaxserve.sched.scheduler import Scheduler
from jaxserve.sched.scheduler_config import SchedulerConfig


def req(rid, key=None, n=4, max_tokens=4):
    return Request(rid, list(range(1, n + 1)), max_tokens, lora_name=key and key.split("#")[0], lora_key=key)


def test_free_slots_first_then_least_recently_used_idle():
    slots = LoRASlots(2)
    a, b, c = req("a", "A#1"), req("b", "B#2"), req("c", "C#3")
    assert slots.acquire(a) == 1 and slots.acquire(b) == 2
    assert slots.take_loads() == ((1, "A#1"), (2, "B#2"))
    assert not slots.can_admit(c)                          # both held
    slots.release(b)
    slots.release(b)                                       # idempotent
    assert slots.can_admit(c) and slots.acquire(c) == 2     # B's slot, the only idle one
    assert slots.take_loads() == ((2, "C#3"),) and slots.num_evictions == 1
    a2 = req("a2", "A#1")
    assert slots.acquire(a2) == 1 and slots.take_loads() == ()    # resident: no load
    slots.release(a), slots.release(a2), slots.release(c)
    # A's slot was released first (least recently used): B comes back there
    assert slots.acquire(req("b2", "B#2")) == 1
    assert slots.slot_of(req("base")) == 0 and slots.can_admit(req("base"))


def test_a_forgotten_adapter_frees_its_slot_once_idle():
    slots = LoRASlots(1)
    a = req("a", "A#1")
    slots.acquire(a)
    slots.forget("A#1")
    assert not slots.can_admit(req("b", "B#2"))            # still held by a
    slots.release(a)
    assert slots.acquire(req("b", "B#2")) == 1 and slots.num_evictions == 0


def test_the_scheduler_holds_a_request_until_a_slot_frees():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                      max_loras=1))
    sched.add_request(req("a", "A#1", max_tokens=2))
    sched.add_request(req("b", "B#2", max_tokens=2))
    sched.add_request(req("base", None, max_tokens=2))
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["a", "base"]        # b waits; base goes past it
    assert {r.request_id: r.lora_slot for r in out.requests} == {"a": 1, "base": 0}
    assert out.lora_loads == ((1, "A#1"),)
    sched.update(out, {"a": [7], "base": [7]})
    out = sched.schedule()
    assert "b" not in [r.request_id for r in out.requests]
    sched.update(out, {r.request_id: [7] for r in out.requests})     # a reaches max_tokens and ends
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["b"] and out.lora_loads == ((1, "B#2"),)
    assert out.requests[0].lora_slot == 1
