"""Actors built in the test's own process, their configs resolved as the driver resolves them: the one
resolver of the batch plan (``plan.resolve.for_actor``; an actor refuses a config
whose plan is not resolved); and :class:`Local`, a handle on such an actor that answers through
object refs, as a Ray actor's does."""

from __future__ import annotations


def device_of(cfg) -> str:
    import torch

    return "cuda" if cfg.clients.resources.num_gpus > 0 and torch.cuda.is_available() else "cpu"


def resolved(cfg, hosted: int):
    """``cfg`` with its batch plan resolved for an actor hosting ``hosted`` clients."""
    from fedsweep.plan.resolve import for_actor

    return for_actor(cfg, hosted, device_of(cfg))


def client_actor(cfg, clients, *args, **kwargs):
    """A ClientActor hosting ``clients``, built here from ``cfg`` resolved for it."""
    from fedsweep.actors.client import ClientActor

    return ClientActor(resolved(cfg, len(clients)), clients, *args, **kwargs)


class Local:
    """A ClientActor in this process behind the face of a Ray actor handle: ``handle.method.remote(*args)``
    runs the method (object-ref arguments resolved, as Ray resolves top-level ones) and answers with an
    object ref (needs a Ray runtime for the refs)."""

    def __init__(self, actor):
        self.actor = actor

    def __getattr__(self, name):
        import ray

        method = getattr(self.actor, name)

        class Call:
            @staticmethod
            def remote(*args, **kwargs):
                return ray.put(method(*(ray.get(a, timeout=60) if isinstance(a, ray.ObjectRef) else a for a in args),
                                      **kwargs))

        return Call()
