"""The run's random streams, named: each salt below seeds one purpose and no other.

A stream is a pure function of the config's seed and its salt (and, where a purpose draws anew each
round or for each client, of the round and client too: :func:`derive_seed`). Naming them here keeps
two purposes from sharing a stream by accident: a shared stream couples them (changing how one draws
moves the other), and the run would depend on the order they draw in.

The numbers are the values the streams have always had, except where one number served two purposes:
the client ranks (was 5, shared with the validation split), the Gaussian attack's noise (was 29,
shared with the choice of attackers) and the method's per-round seed (was 11, shared with the
preference pairs' wrong answers) were given numbers of their own, and the batch order and LoReFT's
intervention dropout (both drew from the unsalted (seed, round, client) stream) got one each.

Streams that predate the salts keep their values and are named by a function here:
:func:`model_init_seed`, :func:`adapter_init_seed` and :func:`dropout_mask_seed`; no module draws from
a seed it computes itself (``tests/test_contract.py``).
"""

from __future__ import annotations

import numpy as np

HOLDOUT = 0
"""The held-out records (``data.holdout_fraction``)."""
PARTITION = 1
"""The clients' shares of the data (``partition``)."""
TRAIN_TEST_SPLIT = 2
"""A client's share split into train and test; with the client."""
SAMPLE_CLIENTS = 3
"""The clients a round samples; with the round."""
PUBLIC_PROMPTS = 4
"""The records withheld as public prompts (methods with ``capabilities.public_prompts``)."""
VALIDATION_SPLIT = 5
"""The held-out records shared out as validation splits."""
FRESH_ADAPTER = 7
"""A client's freshly drawn adapter (``ctx.fresh_params``); with round and client."""
GENERATION = 9
"""Sampling in the method's text generation; with round and client."""
PREFERENCE_PAIRS = 11
"""The wrong answers of the bundled preference pairs."""
EXTRA_ORDER = 13
"""The order of a payload's extra training texts; with round and client."""
DP_NOISE = 17
"""DP-SGD's Gaussian noise; with round and client."""
TOKEN_DROPOUT = 19
"""Dropout inside a step; with round, client and step."""
PREFERENCE_DROPOUT = 23
"""Dropout of a preference pair's forward; with round, client, step and pair."""
ATTACKERS = 29
"""Which clients attack (``clients.byzantine``), drawn once per run."""
CLIENT_SPEED = 31
"""A client's simulated speed (``clients.speed``); with the client."""
DROPOUT = 37
"""Whether a sampled client drops (``clients.dropout``); with round and client."""
CLIENT_RANKS = 41
"""Each client's LoRA rank drawn from ``lora.rank_choices``."""
ATTACK_NOISE = 43
"""The Gaussian attack's noise; with round and client."""
METHOD_SEED = 47
"""The seed a method's client hooks receive (``ctx.seed``); with round and client."""
BATCH_ORDER = 53
"""The order of a client's training examples in a round's batches; with round and client."""
INTERVENTION_DROPOUT = 59
"""LoReFT's intervention dropout (the global generator, one client training alone); with round and client."""
CONSENSUS = 61
"""FedCoFiT's draws in choosing each public prompt's consensus response; with the round. Until
2026-11-28 these drew from ``[0, round]`` whatever the run's seed (every seed the same draws, colliding
with PARTITION in round 1, PUBLIC_PROMPTS in round 4 and VALIDATION_SPLIT in round 5 of seed 0)."""
VERIFICATION = 67
"""The bundled classification data (``data.kind: classification``): which questions get a wrong proposed
answer, and which wrong answer."""
CLASSIFICATION_HEAD = 71
"""The initial classification head (``train.objective: classify``), from the adapters' seed."""


def model_init_seed(seed: int) -> int:
    """The random weights of a model made in code (the tiny model, ``random:<architecture>``): the
    config's seed itself (the value this stream has always had)."""
    return int(seed)


def adapter_init_seed(seed: int, rank: int) -> int:
    """The initial LoRA factors of one rank (``models.lora``): seed · 1009 + rank (the value it has always
    had)."""
    return int(seed) * 1009 + int(rank)


def dropout_mask_seed(draw: int, module: int) -> int:
    """LoRA dropout's mask at one wrapped module for one draw (``models.stacked_lora``; ``draw`` is the
    row's TOKEN_DROPOUT or PREFERENCE_DROPOUT seed): (draw · 1,000,003 + module · 7,919) mod 2⁶³ (the
    value it has always had)."""
    return (int(draw) * 1_000_003 + int(module) * 7_919) % (2 ** 63)


def derive_seed(*parts: int) -> int:
    """A 32-bit seed that is a pure function of ``parts`` (config seed, round, client, salt…)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])
