"""The two chains an update passes through between a client's training and the method's aggregation.

Client side (:class:`ClientChain`, in the client actor, after the method's ``client_upload``):

    Δ = θ_k − θ_start  →  attack (``clients.byzantine``: attackers only)  →  codec (``clients.upload``)

Server side (:class:`ServerChain`, in the server actor):

    decode (as each training call answers)  →  screen (``server.max_*_ratio``, ``screening``)
    →  robust rule (``server.robust``)  →  the method's ``aggregate``

Both build the update once (:class:`~fedsweep.federation.update.Update`). A method that uploads no
parameters (texts only) passes both chains untouched.
"""

from __future__ import annotations

import math
from dataclasses import replace

from fedsweep import salts
from fedsweep.algorithms.types import ClientResult, Upload
from fedsweep.federation.attacks import attack, attackers
from fedsweep.federation.codecs import codec_from
from fedsweep.federation.robust import RobustRule, rule_from
from fedsweep.federation.update import Update
from fedsweep.salts import derive_seed


class NoUsableUpdate(RuntimeError):
    """Every client update of a round was rejected or failed, or too few were left for the robust rule."""


class ClientChain:
    """Attack, then encode, an upload as it leaves the client."""

    def __init__(self, cfg) -> None:
        cc = cfg.clients
        self.seed = cfg.seed
        self.byzantine = cc.byzantine
        self.attackers = set(attackers(cfg.seed, cc.num_clients, cc.byzantine.fraction)) if cc.byzantine.fraction else set()
        self.encodes = cc.upload.compression != "none"
        self.codec = codec_from(cc.upload)

    def send(self, cid: int, rnd: int, sent, upload: Upload, residual) -> tuple[Upload, object]:
        """The upload as sent (``sent``: the payload's parameters) and the codec's new residual for
        client ``cid`` (``residual``: its old one; returned unchanged when the codec keeps none)."""
        attacker = cid in self.attackers
        if upload.params is None or not (attacker or self.encodes):
            return upload, residual
        update = Update.of(cid, sent, upload.params)
        if attacker:
            b = self.byzantine
            update = update.with_delta(attack(update.delta, b.attack, b.scale, b.sigma,
                                              derive_seed(self.seed, rnd, cid, salts.ATTACK_NOISE)))
            upload.metrics["byzantine"] = 1.0
        if not self.encodes:
            upload.params = update.params()
            return upload, residual
        message, kept = self.codec.encode(update.delta, residual)
        dense = sum(d.numel() * 4 for d in update.delta.values())
        nbytes = message.nbytes
        if upload.nbytes is not None and not self.codec.has_residual:
            # a method that sends only some entries (FedICU's importance mask) sends those encoded:
            # its own share of the dense bytes, applied to the encoded size
            nbytes = math.ceil(nbytes * min(1.0, upload.nbytes / max(dense, 1)))
        extra = sum(t.numel() * t.element_size() for t in upload.tensors.values())
        upload.encoded, upload.params = message, None
        upload.nbytes = nbytes + extra
        upload.metrics["upload_bytes_dense"] = float(dense)
        return upload, (kept if kept is not None else residual)


class ServerChain:
    """Decode each upload, then (after screening) the robust rule over the round's accepted updates."""

    def __init__(self, cfg, infos, algorithm) -> None:
        self.codec = codec_from(cfg.clients.upload)
        self.rule: RobustRule = rule_from(cfg.server.robust)
        self.counts = {i.cid: i.num_examples for i in infos}
        self.rule.wrap(algorithm)

    def decode(self, result: ClientResult, sent) -> ClientResult:
        """θ̂_k = what the server sent + the decoded Δ, for an encoded upload (``sent``: the payload's
        parameters); any other result as it came."""
        message = result.upload.encoded
        if message is not None:
            delta = self.codec.decode(message)
            result.upload.params = Update.received(result.cid, sent, delta).params()
            result.upload.encoded = None
        return result

    def robust(self, rnd: int, accepted: list[ClientResult], sent: dict) -> tuple[list[ClientResult], list[int], dict]:
        """The rule over the ``accepted`` results (``sent``: each client's payload parameters): (the results
        the method aggregates, weighed by the example counts the server assigned; the clients the rule
        left out; the rule's scalars)."""
        if type(self.rule) is RobustRule or not accepted:
            return accepted, [], {}
        rule = self.rule
        if len(accepted) < rule.needs():
            raise NoUsableUpdate(f"round {rnd}: server.robust.rule={rule.name} needs {rule.needs()} accepted "
                                 f"updates, {len(accepted)} arrived (dropped, late or rejected)")
        metrics = {"robust_clients_in": float(len(accepted))}
        if rule.coordinatewise:  # the rule is the method's mean: the uploads go on as they came, reweighed
            return [replace(r, num_examples=self.counts[r.cid]) for r in accepted], [], metrics
        updates = [Update.of(r.cid, sent[r.cid], r.upload.params) for r in accepted]
        outcome = rule.apply(updates)
        by_cid = {r.cid: (r, u) for r, u in zip(accepted, updates)}
        kept = []
        for u in outcome.kept:
            r, before = by_cid[u.cid]
            upload = r.upload if u is before else replace(r.upload, params=u.params())
            kept.append(replace(r, upload=upload, num_examples=self.counts[r.cid]))
        return kept, outcome.left_out, {**metrics, **outcome.metrics}
