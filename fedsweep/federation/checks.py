"""What the federation steps refuse, and why: one line naming the field, at validation.

The robust rules state their own refusals (``RobustRule.refusal``); this module asks them, and adds
what holds for every step: a step that acts on exchanged parameters needs a method that exchanges
them (``Capabilities.exchanges_params``), the centralised reference federates nothing, updates of
different shapes (mixed LoRA ranks) cannot be compared by a rule, a rule needs the updates' starts
to be what the server sent (``Capabilities.start_sent``), and a compressed download needs one global
model sent to every client (``Capabilities.one_download``). An attack acts on the update from the
client's own start, so it needs nothing more.
"""

from __future__ import annotations

from fedsweep.federation.attacks import attackers
from fedsweep.federation.participation import answering
from fedsweep.federation.robust import rule_from


def refusal(cfg, method: str, caps) -> str | None:
    """Why ``cfg``'s federation settings cannot run ``method`` (capabilities ``caps``); None if they can."""
    rule, up, down = cfg.server.robust.rule, cfg.clients.upload.compression, cfg.server.download.compression
    attacked = bool(cfg.clients.byzantine.fraction)
    if caps.centralized and (rule != "none" or attacked or up != "none" or down != "none"):
        return (f"server.robust / server.download / clients.byzantine / clients.upload: {method} is the "
                f"centralised reference (one client trains on all data; nothing is federated)")
    if not caps.exchanges_params:
        for field, on in (("server.robust.rule", rule != "none"), ("clients.upload.compression", up != "none"),
                          ("server.download.compression", down != "none"), ("clients.byzantine", attacked)):
            if on:
                return f"{field}: {method} exchanges no parameters (it uploads no parameters to compress, attack or screen)"
    if down != "none" and (caps.personalized or caps.base_merges or not caps.one_download):
        what = ("each client its own parameters" if caps.personalized else "factors merged into the base"
                if caps.base_merges else "each client the global model cut to its own rank")
        return (f"server.download.compression={down}: {method} sends {what}, not one global model the clients "
                f"keep a replica of")
    if rule != "none" and any(len(set(r or ())) > 1 for r in (cfg.lora.rank_choices, cfg.lora.ranks)):
        return (f"server.robust.rule={rule}: clients with different LoRA ranks send updates of different "
                f"shapes, which no robust rule compares")
    why = rule_from(cfg.server.robust).refusal(method, caps, cfg.clients.per_round) or byzantine_refusal(cfg) \
        or participation_refusal(cfg)
    if why is None and rule != "none" and not caps.start_sent:
        why = (f"server.robust.rule={rule}: {method}'s clients start from adapters the server never sent "
               f"(fresh ones, or their own), so the server cannot form their updates θ_k − θ_start and a rule "
               f"would judge whole adapters")
    return why


def byzantine_refusal(cfg) -> str | None:
    """Why ``clients.byzantine`` would attack nothing while the run is tagged attacked: no client drawn
    (⌊fraction · K + ½⌋ = 0), or an attack that sends the honest update (``scale`` at λ = 1,
    ``sign_flip`` at λ = −1)."""
    b = cfg.clients.byzantine
    if not b.fraction:
        return None
    k = cfg.clients.num_clients
    if not attackers(cfg.seed, k, b.fraction):
        return (f"clients.byzantine.fraction={b.fraction:g}: ⌊fraction · K + ½⌋ = 0 of the {k} clients attack, yet the "
                f"run would be tagged attacked; use at least {0.5 / k:.3g}, or 0 for no attack")
    if (b.attack, b.scale) in (("scale", 1.0), ("sign_flip", -1.0)):
        sent = "λΔ" if b.attack == "scale" else "−λΔ"
        return (f"clients.byzantine.scale={b.scale:g}: the {b.attack} attack sends {sent} = Δ, the honest update, yet the "
                f"run would be tagged attacked; choose another scale")
    return None


def participation_refusal(cfg) -> str | None:
    """Why a robust rule that needs a number of answers (Krum's 2f + 3) would stop the run mid-way: the
    first round whose seeded participation (dropout, a deadline, over-selection: ``participation``) leaves
    fewer. Where the clients' steps depend on their data (``train.epochs`` with a deadline) the run
    checks each round as it comes."""
    if cfg.server.robust.rule == "none":
        return None
    need = rule_from(cfg.server.robust).needs()
    cc = cfg.clients
    if not (cc.dropout or cfg.server.deadline_s is not None or cc.over_selection):
        return None
    if cfg.train.steps is None and cfg.server.deadline_s is not None:
        return None
    for rnd in range(1, cfg.rounds + 1):
        who = answering(cfg, rnd)
        if len(who.answering) < need:
            why = ", ".join(part for part in (f"{len(who.dropped)} dropped (clients.dropout={cc.dropout:g})" if who.dropped else "",
                                              f"{len(who.late)} late" if who.late else "") if part)
            rule = cfg.server.robust.rule
            needs = f" (2f + 3 with f={cfg.server.robust.f})" if "krum" in rule else ""
            return (f"server.robust.rule={rule}: it needs {need} answer(s) a round{needs}, but round {rnd} has {len(who.answering)} of its {len(who.sampled)} "
                    f"sampled clients answering ({why}); ask fewer (f), drop fewer, or sample more clients a round")
    return None
