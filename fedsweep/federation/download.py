"""The download compressed (``server.download.compression``): the same codecs as the upload.

Every client holds a replica θ̂ of the global model, which it rebuilds from the messages it receives;
the server keeps the same replica. Round t's message is the codec applied to what the replica lacks,

    m_t = C(θ_t − θ̂_{t−1}),    θ̂_t = θ̂_{t−1} + decode(m_t),    θ̂_0 = θ_0,

so what a message leaves out (quantisation error, the entries top-k did not send) stays in
θ_t − θ̂_t and is sent in a later message: the server's error feedback (as in bidirectional
compression, e.g. Tang et al. 2019, "DoubleSqueeze"). Clients train from θ̂_t, so the update each
uploads is relative to θ̂_t (``federation.update``).

Bytes: a client sampled in round t that last synchronised in round s receives the messages of rounds
s+1..t, or θ̂_t dense (float32) if that is smaller. A round whose global the replica already equals
(the first: θ̂_0 = θ_0, which every client builds from the seed) sends no message and costs nothing. The payload's other tensors and JSON extras are
counted as they are. The replica, each round's message size and each client's last round are part
of the server's state (checkpointed: a resumed run continues bitwise).

Only a method that sends every client the same parameters (one global model) can be sent this way;
a personalised method's payloads differ per client and are refused (``federation.checks``).
"""

from __future__ import annotations

from dataclasses import replace

from fedsweep.algorithms.types import Payload, ServerState, payload_bytes
from fedsweep.federation.codecs import codec_from

REPLICA = "download_replica"
"""``ServerState.buffers`` key of θ̂, the clients' replica of the global model."""


class Download:
    """The compressed broadcast of one global model, with the server's error feedback."""

    def __init__(self, section) -> None:
        self.codec = codec_from(section)
        self.on = section.compression != "none"

    def send(self, rnd: int, payloads: dict[int, Payload], state: ServerState) -> tuple[dict[int, Payload], dict[int, int]]:
        """The payloads clients receive (parameters θ̂_t) and the bytes each client receives."""
        if not self.on or not payloads:
            return payloads, {cid: payload_bytes(p) for cid, p in payloads.items()}
        shared = next(iter(payloads.values()))
        if any(p is not shared for p in payloads.values()) or shared.params is None:
            raise ValueError("server.download.compression: the method sent different payloads to different clients")
        theta = shared.params
        replica = state.buffers.get(REPLICA) or {k: v.clone() for k, v in theta.items()}
        lacks = {k: theta[k] - replica[k] for k in theta}
        size = 0  # nothing the replica lacks (the first round: it is θ_0): no message, nothing charged
        if any(bool(d.any()) for d in lacks.values()):
            message, _ = self.codec.encode(lacks)
            got = self.codec.decode(message)
            replica = {k: replica[k] + got[k].to(replica[k].dtype) for k in replica}
            size = message.nbytes
        state.buffers[REPLICA] = replica
        meta = state.meta.setdefault("download", {"message_bytes": [], "synced": {}})
        history = meta["message_bytes"]
        history.extend([0] * (rnd - 1 - len(history)))  # rounds before download compression was on: none
        history[rnd - 1:] = [size]
        sent = replace(shared, params=replica)
        others = payload_bytes(replace(shared, params=None))
        dense = sum(v.numel() * 4 for v in replica.values())  # the replica as float32
        nbytes = {}
        for cid in payloads:
            since = int(meta["synced"].get(str(cid), 0))
            nbytes[cid] = others + min(sum(history[since:rnd]), dense)
            meta["synced"][str(cid)] = rnd
        return {cid: sent for cid in payloads}, nbytes
