"""An actor is built with Python's cyclic collector paused, then its heap frozen (actors/heap.py)."""

from __future__ import annotations

import gc
import weakref

import pytest

from fedsweep.actors.heap import built_then_frozen, in_actor_process


def _classes():
    """Defined in a function, so that Ray ships them to an actor's process by value."""

    class _Node:
        def __init__(self):
            self.other = None

    class _Built:
        @built_then_frozen
        def __init__(self, fail: bool = False):
            """Makes garbage in a reference cycle and keeps one object; records the collector's state."""
            self.enabled_while_built = gc.isenabled()
            self.frozen_before = gc.get_freeze_count()
            a, b = _Node(), _Node()
            a.other, b.other = b, a  # a cycle only the cyclic collector frees
            self.garbage = weakref.ref(a)
            del a, b
            self.kept = _Node()
            if fail:
                raise ValueError("construction failed")

        def report(self) -> dict:
            return {"enabled_while_built": self.enabled_while_built, "enabled_now": gc.isenabled(),
                    "garbage_freed": self.garbage() is None, "frozen_before": self.frozen_before,
                    "frozen_now": gc.get_freeze_count(), "in_actor": in_actor_process(),
                    "kept_is_frozen": not any(o is self.kept for o in gc.get_objects())}

        def build_failing(self) -> dict:
            try:
                _Built(fail=True)
            except ValueError:
                return {"enabled_after_failure": gc.isenabled()}
            return {}

    return _Built


def test_in_process_the_caller_s_collector_is_left_alone():
    frozen = gc.get_freeze_count()
    got = _classes()().report()
    assert got["enabled_while_built"] and got["enabled_now"] and not got["in_actor"]
    assert gc.get_freeze_count() == frozen == got["frozen_now"]


def test_in_an_actor_construction_runs_without_collections_then_frees_cycles_and_freezes(ray_session):
    import ray

    actor = ray.remote(num_cpus=0)(_classes()).remote()
    got = ray.get(actor.report.remote(), timeout=120)
    assert got["in_actor"] and not got["enabled_while_built"] and got["enabled_now"]
    assert got["garbage_freed"]  # the cycle construction dropped was collected before the freeze
    assert got["frozen_now"] > got["frozen_before"] and got["kept_is_frozen"]  # get_objects() omits frozen ones
    # a construction that raises leaves the collector on
    assert ray.get(actor.build_failing.remote(), timeout=120) == {"enabled_after_failure": True}
    ray.kill(actor)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_left_as_it_was(ray_session, enabled):
    import ray

    built = _classes()

    @ray.remote(num_cpus=0)
    class Holder:
        def __init__(self):
            if not enabled:
                gc.disable()

        def build(self):
            built()
            return gc.isenabled()

    holder = Holder.remote()
    assert ray.get(holder.build.remote(), timeout=120) is enabled
    ray.kill(holder)


def test_a_frozen_heap_for_timed_work_frees_cycles_first_and_thaws_after():
    """``frozen_heap`` (the bench's timed rounds): garbage in cycles is collected, what lives is frozen
    inside the block (the collector does not see it), and thawed after, also when the block raises."""
    from fedsweep.actors.heap import frozen_heap

    class Node:
        other = None

    kept = Node()
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle only the cyclic collector frees
    garbage = weakref.ref(a)
    del a, b
    before = gc.get_freeze_count()
    with frozen_heap():
        assert garbage() is None
        assert gc.get_freeze_count() > before
        assert not any(o is kept for o in gc.get_objects())
    assert gc.get_freeze_count() == 0 and any(o is kept for o in gc.get_objects())
    with pytest.raises(RuntimeError):
        with frozen_heap():
            raise RuntimeError("a failed round")
    assert gc.get_freeze_count() == 0
