"""FedCoFiT (seed 002): semantic consensus over public-prompt responses; no parameters exchanged.

Each round every sampled client trains on its data (plus, from round 2, the broadcast
pseudo-labelled public prompts, equal per-example weight), generates one response per
public prompt and uploads the texts. The server embeds all K·M responses in one batched
encoder call, applies the consensus rule of ``consensus.py`` per prompt, and broadcasts
D̃_pub = {(x_j, y_j*)}. Clients may differ in base model, tokenizer and LoRA rank.

Bytes: the upload is the UTF-8 size of the responses, the download that of the
pseudo-labels (the prompts are public and known to every client from the start).
"""

from __future__ import annotations

import json
import time
from typing import Callable, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from fedsweep.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientInfo,
    ClientResult,
    Params,
    Payload,
    Report,
    ServerState,
    Upload,
)
from fedsweep.algorithms.consensus import choose
from fedsweep.algorithms.registry import register


class FedCoFiTParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    public_prompts: int = Field(16, ge=1, description="M: public prompts drawn from the data and removed from every client")
    eps: float = Field(0.3, gt=0, le=2, description="DBSCAN eps (cosine distance)")
    min_samples: int = Field(2, ge=1, description="DBSCAN min_samples")
    selection: Literal["centroid", "random_in_majority", "global_medoid"] = "centroid"
    encoder: str = Field("all-MiniLM-L6-v2", description="sentence encoder (bundled name, local path or hub id)")
    max_new_tokens: int = Field(32, ge=1, description="response length limit on public prompts")
    do_sample: bool = Field(False, description="sample responses (else greedy)")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)


def utf8(texts) -> int:
    return sum(len(t.encode("utf-8")) for t in texts)


@register
class FedCoFiT(Algorithm):
    name = "fedcofit"
    Params = FedCoFiTParams
    summary = "semantic consensus on public-prompt responses (DBSCAN on sentence embeddings); no parameters shared"
    supports_mixed_ranks = True
    supports_mixed_models = True
    uses_public_prompts = True

    embed: Callable[[list[str]], torch.Tensor] | None = None
    """Set by the ServerActor (which owns the encoder); the plugin does no I/O."""

    @classmethod
    def public_prompt_count(cls, hp) -> int:
        return hp.public_prompts

    def init(self, params: Params, clients: list[ClientInfo], public: list[dict] | None = None) -> ServerState:
        if not public:
            raise ValueError("fedcofit needs public prompts (fedcofit.public_prompts > 0)")
        return ServerState(meta={"public": [p["prompt"] for p in public], "pseudo": [], "seed": 0})

    def _payload(self, state: ServerState) -> Payload:
        pseudo = state.meta["pseudo"]
        return Payload(data={"public_prompts": state.meta["public"],
                             "extra_train": [{"prompt": x, "response": y} for x, y in zip(state.meta["public"], pseudo)],
                             "bytes_down": utf8(pseudo)})

    def dispatch(self, rnd: int, sampled: list[int], state: ServerState) -> dict[int, Payload]:
        payload = self._payload(state)
        return {cid: payload for cid in sampled}

    def eval_payload(self, state: ServerState, cid: int) -> Payload:
        return Payload()  # each client is evaluated with its own adapter

    def client_upload(self, ctx: ClientContext, params: Params) -> Upload:
        hp = self.hp
        texts = ctx.generate(ctx.payload.data["public_prompts"], hp.max_new_tokens,
                             do_sample=hp.do_sample, temperature=hp.temperature, top_p=hp.top_p)
        return Upload(texts=texts)

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState) -> tuple[ServerState, Report]:
        if self.embed is None:
            raise RuntimeError("fedcofit: no sentence encoder attached (the ServerActor sets algo.embed)")
        prompts = state.meta["public"]
        k, m = len(results), len(prompts)
        texts = [r.upload.texts for r in results]  # (K, M)
        t0 = time.perf_counter()
        emb = self.embed([t for client in texts for t in client]).numpy().reshape(k, m, -1)
        t1 = time.perf_counter()
        rng = np.random.default_rng([state.meta.get("seed", 0), rnd])
        pseudo, sizes, outliers, winners = [], [], 0, np.zeros(k)
        for j in range(m):
            responses = [texts[i][j] for i in range(k)]
            c = choose(emb[:, j], [len(r) for r in responses], self.hp.eps, self.hp.min_samples, self.hp.selection, rng)
            pseudo.append(responses[c.index])
            sizes.append(len(c.cluster))
            outliers += c.all_outliers
            winners[c.index] += 1
        state.meta["pseudo"] = pseudo
        report = Report(
            metrics={"consensus_cluster_size_mean": float(np.mean(sizes)), "consensus_all_outlier_prompts": float(outliers),
                     "consensus_embed_seconds": t1 - t0, "consensus_cluster_seconds": time.perf_counter() - t1},
            client_metrics={r.cid: {"pseudo_labels_won": float(winners[i])} for i, r in enumerate(results)},
            artifacts={"pseudo_labels.jsonl": "\n".join(
                json.dumps({"prompt": x, "response": y}) for x, y in zip(prompts, pseudo)).encode()},
        )
        return state, report
