"""Which runs' clients hold the same data: the condition for pairing their per-client values.

A paired test compares client c of one run with client c of another. That is a comparison of two
methods only where both clients hold the same records — the same partition of the same data at the
same seed. Two runs of a study on another partition scheme, other tasks or another number of
clients hold different data at every client; pairing them would compare unrelated test sets.
"""

from __future__ import annotations

DATA_KEYS = ("data.", "partition.", "clients.num_clients", "seed")
"""Run parameters that decide which records each client holds: paired values need them equal (and a
method's own ``public_prompts``, drawn out of the data unless ``data.public_prompts`` set them aside
for every method)."""


def data_signature(params: dict[str, str]) -> tuple:
    own_public = params.get("data.public_prompts", "0") in ("0", "") and any(
        k.endswith(".public_prompts") and not k.startswith("data.") for k in params)
    keys = {k: v for k, v in params.items() if k.startswith(DATA_KEYS) and k != "data.val_fraction"}
    if own_public:
        keys.update({k: v for k, v in params.items() if k.endswith(".public_prompts")})
    return tuple(sorted(keys.items()))


def different_data(a: dict[str, str], b: dict[str, str]) -> str | None:
    """Why runs with parameters ``a`` and ``b`` hold different client data (the first parameters that
    differ), or None where they hold the same."""
    sa, sb = dict(data_signature(a)), dict(data_signature(b))
    diff = sorted(k for k in set(sa) | set(sb) if sa.get(k) != sb.get(k) and k != "seed")
    if not diff:
        return None
    return ", ".join(f"{k}: {sa.get(k, '—')} vs {sb.get(k, '—')}" for k in diff[:3])
