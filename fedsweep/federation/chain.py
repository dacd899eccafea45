"""The two chains an update passes through between a client's training and the method's aggregation.

Client side (:class:`ClientChain`, in the client actor, after the method's ``client_upload``):

    Δ = θ_k − θ_start  →  attack (``clients.byzantine``: attackers only)  →  codec (``clients.upload``)

Server side (:class:`ServerChain`, in the server actor), three calls a round:

    open     who answers (``participation``), the method's payloads, the download compressed
             (``download``)
    receive  as each training call answers: decode, measure the update (``screening.UpdateNorms``)
    close    screen (``server.max_*_ratio``), the robust rule (``server.robust``), and what the method
             aggregates with: the kept results and the :class:`~fedsweep.algorithms.types.AggregationContext`
             (the mean it uses, the encoder)

Both build the update once (:class:`~fedsweep.federation.update.Update`). A method that uploads no
parameters (texts only) passes both chains untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from fedsweep import salts
from fedsweep.algorithms.tensors import weighted_mean
from fedsweep.algorithms.types import AggregationContext, ClientResult, Payload, Upload
from fedsweep.federation import participation
from fedsweep.federation.attacks import attack, attackers
from fedsweep.federation.codecs import codec_from
from fedsweep.federation.download import Download
from fedsweep.federation.robust import RobustRule, rule_from
from fedsweep.federation.screening import UpdateNorms, screen
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

    def send(self, cid: int, rnd: int, sent, upload: Upload, residual, start=None) -> tuple[Upload, object]:
        """The upload as sent (``sent``: the payload's parameters) and the codec's new residual for
        client ``cid`` (``residual``: its old one; returned unchanged when the codec keeps none).
        ``start``: the parameters the client trained from (``client_prepare``; ``sent`` where not
        given): an attack replaces the update from there, θ_start + attack(θ_k − θ_start), so a method
        whose clients start from parameters the server never sent (FLoRA's fresh adapters) is
        attacked in its update, not in its whole adapter; the codec then encodes against ``sent``."""
        attacker = cid in self.attackers
        if upload.params is None or not (attacker or self.encodes):
            return upload, residual
        own = attacker and start is not None and start is not sent  # attacked from a start not sent
        update = Update.of(cid, start if own else sent, upload.params)
        if attacker:
            b = self.byzantine
            update = update.with_delta(attack(update.delta, b.attack, b.scale, b.sigma,
                                              derive_seed(self.seed, rnd, cid, salts.ATTACK_NOISE)))
            upload.metrics["byzantine"] = 1.0
        if not self.encodes:
            upload.params = update.params()
            return upload, residual
        if own:  # the update as the server reads it: against what it sent
            update = Update.of(cid, sent, update.params())
        message, kept = self.codec.encode(update.delta, residual)
        dense = sum(d.numel() * 4 for d in update.delta.values())
        nbytes = message.nbytes
        if upload.sent_share is not None and not self.codec.has_residual:
            # a method that sends only some entries (a sparse upload) sends those encoded: its share
            # of the entries, applied to the encoded size
            nbytes = math.ceil(nbytes * min(1.0, upload.sent_share))
        extra = sum(t.numel() * t.element_size() for t in upload.tensors.values())
        upload.encoded, upload.params = message, None
        upload.nbytes = nbytes + extra
        upload.metrics["upload_bytes_dense"] = float(dense)
        return upload, (kept if kept is not None else residual)


@dataclass
class Sent:
    """A round's downloads as they went out (:meth:`ServerChain.open`): who answers, each answering
    client's payload and the bytes it received, and the norms of the updates as they come back."""

    rnd: int
    participation: participation.Participation
    payloads: dict[int, Payload]
    bytes_down: dict[int, int]
    partial_sums: bool = False
    """Whether the client actors send a weighted partial sum of their clients' uploads instead of each
    (``server.partial_sums`` for a method that takes them, :meth:`ServerChain.takes_partial_sums`)."""
    starts: dict[int, Any] = field(default_factory=dict)
    """Each client's start θ_start: the parameters its payload carried."""
    norms: UpdateNorms | None = None
    partials: list[dict] = field(default_factory=list)
    """The partial sums received (``{"cids", "weight", "sum", "dtypes"}``, one per training call)."""

    def __post_init__(self) -> None:
        self.starts = {cid: p.params for cid, p in self.payloads.items()}
        self.norms = UpdateNorms(self.starts)


@dataclass
class Closed:
    """What the round's updates came to (:meth:`ServerChain.close`): the results the method aggregates
    (weighed by the example counts the server assigned), the context it aggregates with, the
    clients screening rejected (with why) and those the robust rule left out, and the rule's scalars."""

    kept: list[ClientResult]
    context: AggregationContext
    rejected: dict[int, str] = field(default_factory=dict)
    left_out: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


class ServerChain:
    """The server's side of federation, in three calls a round: :meth:`open`, :meth:`receive` for each
    answer, :meth:`close`. ``encoder``: the method's sentence encoder (``server_encoder``), which
    travels in every round's aggregation context."""

    def __init__(self, cfg, infos, encoder=None, caps=None) -> None:
        self.cfg = cfg
        self.codec = codec_from(cfg.clients.upload)
        self.rule: RobustRule = rule_from(cfg.server.robust)
        self.counts = {i.cid: i.num_examples for i in infos}
        self.download = Download(cfg.server.download)
        self.encoder = encoder
        self.partial_sums = caps is not None and self.takes_partial_sums(cfg, caps)

    @staticmethod
    def takes_partial_sums(cfg, caps) -> bool:
        """Whether the client actors send one weighted partial sum of their clients' uploads: the method
        reads the uploads only through their mean (``Capabilities.partial_sums``), and nothing between
        the clients and it needs each upload (no robust rule, upload codec or attacker); with
        ``server.partial_sums`` on (the default)."""
        return bool(cfg.server.partial_sums and caps.partial_sums and cfg.server.robust.rule == "none"
                    and cfg.clients.upload.compression == "none" and not cfg.clients.byzantine.fraction)

    def open(self, rnd: int, dispatch: Callable[[list[int]], dict[int, Payload]], state) -> Sent:
        """Round ``rnd``'s downloads: the clients sampled and who of them answers (``participation``: a
        pure function of the seed and the round), the method's payloads for them (``dispatch(answering)``),
        sent through the download's codec."""
        who = participation.answering(self.cfg, rnd, self.counts)
        payloads, nbytes = self.download.send(rnd, dispatch(who.answering), state)
        return Sent(rnd, who, payloads, nbytes, self.partial_sums)

    def receive(self, result: ClientResult | dict, sent: Sent) -> ClientResult | dict:
        """One answer as it arrives: an encoded upload decoded (θ̂_k = what the server sent + the decoded
        Δ), and its update measured while the other calls still train; or a client actor's partial sum
        (a dict), kept for the round's mean."""
        if isinstance(result, dict):
            sent.partials.append(result)
            return result
        message = result.upload.encoded
        if message is not None:
            delta = self.codec.decode(message)
            result.upload.params = Update.received(result.cid, sent.starts[result.cid], delta).params()
            result.upload.encoded = None
        sent.norms.add({result.cid: result})
        return result

    def close(self, rnd: int, results: dict[int, ClientResult], failures: dict[int, str], sent: Sent,
              fetch: Callable[[list[int]], dict[int, Any]] | None = None) -> Closed:
        """The round's answers screened (``screening``), the robust rule applied, and what the method
        aggregates with. Raises :class:`NoUsableUpdate` when no update is left (``failures``: the
        clients whose calls failed, named in that error). Where the actors sent partial sums and
        screening rejected a client of one, each upload is asked for (``fetch(cids)``: the clients'
        upload parameters) and the round is aggregated upload by upload."""
        sc = self.cfg.server
        rejected = screen(results, sent.starts, sc.max_update_ratio, sc.max_loss_ratio, sent.norms)
        accepted = [results[cid] for cid in sorted(results) if cid not in rejected]
        if not accepted:
            why = sorted({**failures, **rejected}.items())
            raise NoUsableUpdate(f"round {rnd}: no client update was usable ({len(why)} rejected or failed; "
                                 f"client {why[0][0]}: {why[0][1]})" if why else f"round {rnd}: no client trained")
        summed = {cid for p in sent.partials for cid in p["cids"]}
        if summed and (rejected.keys() & summed or {r.cid for r in accepted} != summed):
            if fetch is None:
                raise RuntimeError(f"round {rnd}: a partial sum holds clients the round does not aggregate, and no "
                                   f"way to ask for their uploads was given")
            got = fetch(sorted(summed))  # (screening left one out: upload by upload, as without partial sums)
            for cid, params in got.items():
                results[cid].upload.params = params
            sent.partials.clear()
            summed = set()
        kept, left_out, metrics = self._robust(rnd, accepted, sent.starts)
        mean = self.rule.mean if self.rule.coordinatewise else weighted_mean
        if summed:
            mean = partial_mean(sent.partials, kept)
        return Closed(kept, AggregationContext(mean=mean, embed=self.encoder), rejected, left_out, metrics)

    def _robust(self, rnd: int, accepted: list[ClientResult], sent: dict) -> tuple[list[ClientResult], list[int], dict]:
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


def partial_sum(uploads: list[tuple[int, float, Any]]) -> dict[str, Any]:
    """One client actor's weighted partial sum of its clients' uploads, ``[(cid, n_k, θ_k)]``: Σ_k n_k θ_k in
    float64 (clients in the order given), Σ_k n_k, the clients, and each tensor's dtype."""
    from fedsweep.lazy import torch

    first = uploads[0][2]
    total = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in first.items()}
    weight = 0.0
    for _, n, params in uploads:
        for k, v in params.items():
            total[k].add_(v.detach().to("cpu", torch.float64), alpha=float(n))
        weight += float(n)
    return {"cids": [cid for cid, _, _ in uploads], "weight": weight, "sum": total,
            "dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in first.items()}}


def partial_mean(partials: list[dict], kept: list[ClientResult]):
    """The mean a method is given where the actors sent partial sums: Σ n_k θ_k over every partial sum,
    over Σ n_k, in float64, cast to the uploads' dtypes. It stands for the method's mean of the kept
    results' uploads weighed by their example counts, which it checks it is asked for."""
    from fedsweep.lazy import torch

    weight = sum(p["weight"] for p in partials)
    total = {k: sum(p["sum"][k] for p in partials) for k in partials[0]["sum"]}
    dtypes = partials[0]["dtypes"]

    def mean(sets, weights):
        if len(weights) != len(kept) or abs(float(sum(weights)) - weight) > 1e-9 * max(weight, 1.0):
            raise ValueError("a method given partial sums asked for another mean than its clients' weighted by "
                             "their example counts (Capabilities.partial_sums must not be declared for it)")
        return {k: (v / weight).to(getattr(torch, dtypes[k])) for k, v in total.items()}

    return mean
