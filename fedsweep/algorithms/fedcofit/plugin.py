"""FedCoFiT: semantic consensus over public-prompt responses; no parameters exchanged.

Paper: "Beyond Parameter Aggregation: Semantic Consensus for Federated Fine-Tuning of LLMs"
(arXiv:2605.11857). Algorithm 1, per round t:

1. each sampled client updates its LoRA on L_i = ½·E_{D_i}[CE] + ½·E_{D̃pub}[CE] — both sets
   sampled every step, their token-mean losses weighted equally (D_i alone before the first
   consensus);
2. it generates one response per public prompt and uploads the texts, each marked
   truncated when it hit ``max_new_tokens`` without an end-of-sequence token (greedy: all of an
   actor's clients that train together generate in shared batches, ``client_upload_group``);
3. the server embeds all K·M responses in one batched encoder call, applies the consensus
   rule of ``consensus.py`` per prompt (``truncated: drop`` leaves cut responses out where
   a complete one exists) and broadcasts D̃_pub = {(x_j, y_j*)}; a truncated pseudo-label is
   trained on without an appended EOS (it must not teach stopping mid-sentence);
4. after the last round every client trains once more on D_i ∪ D̃pub^T (``final_payloads``),
   so the last consensus is trained on too.

DP-FedCoFIT (the paper's appendix on record-level privacy): with ``dp`` set, the private
part of every local step is DP-SGD (Poisson sampling of D_i at rate B/n_i, per-sample
gradient clipping to ``max_grad_norm``, Gaussian noise σ·C), implemented by the ClientActor;
ε is composed over all steps and rounds by Opacus' RDP accountant and logged per client.
The public pseudo-labels are post-processing of DP outputs and are not noised.

Clients may differ in base model, tokenizer and LoRA rank.

Bytes: the upload is the UTF-8 size of the responses, the download that of the
pseudo-labels (the prompts are public and known to every client from the start).
"""

from __future__ import annotations

import json
import time
from typing import Literal

import numpy as np
from pydantic import Field

from fedsweep.algorithms.base import Algorithm, Capabilities, HyperParams
from fedsweep.algorithms.tensors import Params
from fedsweep.algorithms.types import (AggregationContext, ClientContext, ClientInfo, ClientResult, DPSettings,
                                       Generation, GroupTools, PLAIN, Payload, Report, ServerContext, ServerState, Upload)
from fedsweep.algorithms.fedcofit.consensus import choose
from fedsweep.algorithms.registry import register
from fedsweep.lazy import torch
from fedsweep.salts import CONSENSUS, derive_seed


class DPParams(HyperParams):
    """DP-SGD on the private data (record-level differential privacy)."""

    noise_multiplier: float = Field(..., ge=0, le=1e3, description="σ: noise std as a multiple of max_grad_norm")
    max_grad_norm: float = Field(..., gt=0, le=1e6, description="C: per-sample gradient clipping norm")
    delta: float = Field(1e-5, gt=0, lt=1, description="δ of the reported (ε, δ)")


class FedCoFiTParams(HyperParams):
    public_prompts: int = Field(16, ge=1, description="M: public prompts drawn from the data and removed from every client")
    eps: float = Field(0.3, gt=0, le=2, description="DBSCAN eps (cosine distance)")
    min_samples: int = Field(2, ge=1, description="DBSCAN min_samples")
    selection: Literal["centroid", "random_in_majority", "global_medoid"] = "centroid"
    encoder: str = Field("all-MiniLM-L6-v2", description="sentence encoder (bundled name, local path or hub id)")
    max_new_tokens: int = Field(32, ge=1, description="response length limit on public prompts")
    do_sample: bool = Field(False, description="sample responses (else greedy)")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    public_weight: float = Field(0.5, gt=0, lt=1, description="weight of the public pseudo-label loss (½ in L_i)")
    truncated: Literal["keep", "drop"] = Field(
        "keep", description="responses cut by max_new_tokens: keep them in the consensus or drop them where a "
                            "complete response exists (they are counted either way)")
    dp: DPParams | None = Field(None, description="DP-FedCoFiT: DP-SGD on the private data")


def utf8(texts) -> int:
    return sum(len(t.encode("utf-8")) for t in texts)


@register
class FedCoFiT(Algorithm):
    name = "fedcofit"
    Params = FedCoFiTParams
    summary = "semantic consensus on public-prompt responses (DBSCAN on sentence embeddings); no parameters shared"
    capabilities = Capabilities(exchanges_params=False, mixed_ranks=True, mixed_models=True, public_prompts=True, server_encoder=True)

    """Set by the ServerActor (which owns the encoder); the plugin does no I/O."""

    def init(self, params: Params, ctx: ServerContext) -> ServerState:
        public = ctx.public
        if not public:
            raise ValueError("fedcofit needs public prompts (fedcofit.public_prompts > 0)")
        return ServerState(meta={"public": [p["prompt"] for p in public], "pseudo": [], "seed": int(ctx.seed)})

    def _payload(self, state: ServerState, final: bool = False) -> Payload:
        pseudo = state.meta["pseudo"]
        cut = state.meta.get("pseudo_truncated") or [False] * len(pseudo)
        data = {"public_prompts": state.meta["public"], **({"final": True} if final else {})}
        return Payload(data=data, extra_train=[{"prompt": x, "response": y, "eos": not c}
                                               for x, y, c in zip(state.meta["public"], pseudo, cut)],
                       extra_weight=self.hp.public_weight, bytes_down=0 if final else utf8(pseudo),
                       dp=DPSettings(**self.hp.dp.model_dump()) if self.hp.dp is not None else None)

    def dispatch(self, rnd: int, sampled: list[int], state: ServerState) -> dict[int, Payload]:
        payload = self._payload(state)
        return {cid: payload for cid in sampled}

    def final_payloads(self, state: ServerState, cids: list[int]) -> dict[int, Payload]:
        """After the last round: one more local update on D_i ∪ D̃pub^T (Algorithm 1 trains on every
        consensus; the broadcast of the last one is already counted in that round's bytes)."""
        payload = self._payload(state, final=True)
        return {cid: payload for cid in cids}

    def eval_payload(self, state: ServerState, cid: int) -> Payload:
        return Payload()  # each client is evaluated with its own adapter

    def client_upload(self, ctx: ClientContext, params: Params) -> Upload:
        if ctx.payload.data.get("final"):
            return Upload(nbytes=0)  # the final update sends nothing
        hp = self.hp
        texts, cut = ctx.generate(ctx.payload.data["public_prompts"], hp.max_new_tokens, do_sample=hp.do_sample,
                                  temperature=hp.temperature, top_p=hp.top_p, with_truncation=True)
        return self._responses(texts, cut)

    def client_upload_group(self, ctxs: list[ClientContext], params: list[Params], tools: GroupTools) -> list[Upload]:
        """:meth:`client_upload` of a training group's clients at once: with greedy decoding every client's
        responses to the public prompts are generated together, each row with its client's trained adapter
        (``tools.generate``), the same texts as each alone; sampled ones are drawn per client, from its seed."""
        if self.hp.do_sample:
            return [self.client_upload(ctx, p) for ctx, p in zip(ctxs, params)]
        asking = [i for i, ctx in enumerate(ctxs) if not ctx.payload.data.get("final")]
        answers = tools.generate([Generation(i, ctxs[i].payload.data["public_prompts"], self.hp.max_new_tokens)
                                  for i in asking])
        out = [Upload(nbytes=0) for _ in ctxs]  # (the final update sends nothing)
        for i, (texts, cut) in zip(asking, answers):
            out[i] = self._responses(texts, cut)
        return out

    def _responses(self, texts: list[str], cut: list[bool]) -> Upload:
        flags = torch.tensor(cut, dtype=torch.bool)
        # bytes as the paper's communication formula counts them (2·K·M·ℓ̄·c_t: the responses' text);
        # the truncation flags (one byte per response, fedsweep's addition) are reported on their own
        return Upload(texts=texts, tensors={"truncated": flags}, nbytes=sum(len(t.encode("utf-8")) for t in texts),
                      metrics={"responses_truncated": float(flags.sum()), "truncation_flag_bytes": float(flags.numel())})

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState,
                  ctx: AggregationContext = PLAIN) -> tuple[ServerState, Report]:
        if ctx.embed is None:
            raise RuntimeError("fedcofit: no sentence encoder given (the server's AggregationContext carries it)")
        prompts = state.meta["public"]
        k, m = len(results), len(prompts)
        texts = [r.upload.texts for r in results]  # (K, M)
        t0 = time.perf_counter()
        emb = ctx.embed([t for client in texts for t in client]).numpy().reshape(k, m, -1)
        t1 = time.perf_counter()
        rng = np.random.default_rng(derive_seed(state.meta["seed"], rnd, CONSENSUS))
        cut = np.array([r.upload.tensors["truncated"].numpy() if "truncated" in r.upload.tensors
                        else np.zeros(m, dtype=bool) for r in results]).reshape(k, m)
        pseudo, pseudo_cut, sizes, outliers, winners = [], [], [], 0, np.zeros(k)
        for j in range(m):
            responses = [texts[i][j] for i in range(k)]
            eligible = None
            if self.hp.truncated == "drop" and cut[:, j].any() and not cut[:, j].all():
                eligible = [i for i in range(k) if not cut[i, j]]
            c = choose(emb[:, j], [len(r) for r in responses], self.hp.eps, self.hp.min_samples, self.hp.selection,
                       rng, eligible)
            pseudo.append(responses[c.index])
            pseudo_cut.append(bool(cut[c.index, j]))
            sizes.append(len(c.cluster))
            outliers += c.all_outliers
            winners[c.index] += 1
        state.meta["pseudo"] = pseudo
        state.meta["pseudo_truncated"] = pseudo_cut
        epsilons = [r.metrics["dp_epsilon"] for r in results if "dp_epsilon" in r.metrics]
        report = Report(
            metrics={"consensus_cluster_size_mean": float(np.mean(sizes)), "consensus_all_outlier_prompts": float(outliers),
                     "responses_truncated": float(cut.sum()), "pseudo_labels_truncated": float(sum(pseudo_cut)),
                     **({"dp_epsilon_max": max(epsilons)} if epsilons else {}),
                     "consensus_embed_seconds": t1 - t0, "consensus_cluster_seconds": time.perf_counter() - t1},
            client_metrics={r.cid: {"pseudo_labels_won": float(winners[i])} for i, r in enumerate(results)},
            artifacts={"pseudo_labels.jsonl": "\n".join(
                json.dumps({"prompt": x, "response": y, "truncated": c})
                for x, y, c in zip(prompts, pseudo, pseudo_cut)).encode()},
        )
        return state, report
