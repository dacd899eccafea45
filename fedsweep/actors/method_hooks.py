"""What a client actor offers a method's client hooks: the context each hook receives.

:class:`MethodHooks` builds a hosted client's :class:`~fedsweep.algorithms.types.ClientContext` for a
round: its state, the held-out pool and its losses (``capabilities.validation_pool``), the method's
sentence encoder (``capabilities.client_encoder``, loaded once per actor), text generation with the
client's adapter, a freshly drawn adapter, and losses on the client's own splits. Seeds are derived
from (seed, round, client) and a named salt (``fedsweep.salts``), so a hook draws the same whichever
actor hosts the client.
"""

from __future__ import annotations

import math

from fedsweep import salts
from fedsweep.actors.client_state import ClientSlot
from fedsweep.algorithms.tensors import Params, RowSets
from fedsweep.algorithms.types import Candidate, ClientContext, Generation, GroupTools, Payload
from fedsweep.engine.evaluation import EvalClient, evaluate_group, mean_loss, one_forward
from fedsweep.engine.text import Example
from fedsweep.lazy import torch
from fedsweep.salts import derive_seed


def as_text(record: dict) -> str:
    """A record as one text (prompt, then response) for a sentence encoder."""
    return f"{record['prompt']}\n{record['response']}"


class MethodHooks:
    """The client side of a method: contexts for its hooks, over one actor's base and clients."""

    def __init__(self, cfg, base, algo, slots: dict[int, ClientSlot], init_params: dict[int, Params],
                 pool: list[dict] | None, device) -> None:
        self.cfg, self.base, self.algo, self.slots, self.device = cfg, base, algo, slots, device
        self.init_params = init_params
        self.pool = list(pool or [])
        uses_pool = algo.capabilities.validation_pool  # the texts a method embeds, built once
        self.pool_texts = [as_text(r) for r in self.pool] if uses_pool else []
        self.local_texts = {cid: [as_text(r) for r in s.train] for cid, s in slots.items()} if uses_pool else {}
        self._pool_enc: list[Example] | None = None
        self._embed = None
        self._embedded: dict[int, torch.Tensor] = {}

    def context(self, rnd: int, slot: ClientSlot, payload: Payload, steps: int = 0) -> ClientContext:
        """The context of ``slot``'s hooks in round ``rnd`` with ``payload``."""
        seed = self.cfg.seed
        return ClientContext(cid=slot.cid, rnd=rnd, num_examples=len(slot.train), local_params=slot.params,
                             state=slot.algo_state, payload=payload, meta=slot.algo_meta,
                             local_texts=self.local_texts.get(slot.cid, []), pool_texts=self.pool_texts,
                             pool_loss=lambda params, indices: self.pool_loss(slot, params, indices),
                             embed=self.embed if self.algo.capabilities.client_encoder else None,
                             seed=derive_seed(seed, rnd, slot.cid, salts.METHOD_SEED),
                             eval_loss=lambda params, split: self.split_loss(slot, params, split),
                             rank=slot.rank, lora_scale=self.cfg.lora.alpha / slot.rank, steps=steps,
                             learning_rate=self.cfg.train.learning_rate, fresh_params=lambda: self.fresh(slot, rnd),
                             generate=lambda prompts, max_new_tokens, **kw: self.generate(
                                 slot, prompts, max_new_tokens, seed=derive_seed(seed, rnd, slot.cid, salts.GENERATION),
                                 **kw))

    def fresh(self, slot: ClientSlot, rnd: int) -> Params:
        """A new adapter of ``slot``'s rank: A Kaiming-uniform (seeded by seed, round, client), B zero."""
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, rnd, slot.cid, salts.FRESH_ADAPTER))
        out = {}
        for k, v in self.init_params[slot.rank].items():
            if "lora_A" in k:
                bound = 1.0 / math.sqrt(v.shape[1])
                out[k] = (torch.rand(v.shape, generator=gen) * 2 - 1).mul_(bound).to(v.dtype)
            else:
                out[k] = torch.zeros_like(v)
        return out

    def pool_loss(self, slot: ClientSlot, params: Params, indices: list[int]) -> float:
        """Mean loss of ``params`` on the held-out pool's items ``indices``."""
        return mean_loss(self.base, slot.rank, params, self._examples(slot, indices))

    def split_loss(self, slot: ClientSlot, params: Params, split: str) -> float:
        """Mean loss of ``params`` on ``slot``'s ``split`` (train, test or val)."""
        return mean_loss(self.base, slot.rank, params, self._examples(slot, split))

    def embed(self, texts: list[str]) -> torch.Tensor:
        """Sentence embeddings from the method's client encoder (loaded once per actor); the four
        most recently used text lists are memoised, so clients packed on one actor embed the pool once."""
        if self._embed is None:
            from fedsweep.models.encoder import load_encoder

            self._embed = load_encoder(self.algo.client_encoder_name(), device=str(self.device))
        key = hash(tuple(texts))
        value = self._embedded.pop(key, None)  # least recently used first: the shared pool stays
        if value is None:
            if len(self._embedded) >= 4:
                self._embedded.pop(next(iter(self._embedded)))
            value = self._embed(texts)
        self._embedded[key] = value
        return value

    # ------------------------------------------------------------ a group at once
    def tools(self, slots: list[ClientSlot], work: dict[str, float]) -> GroupTools:
        """The group hooks' tools over ``slots`` (a training group's clients, in the contexts' order);
        ``work`` counts what they computed (tokens scored, prompts completed) for the run's ideal."""
        return GroupTools(losses=lambda candidates: self.losses(slots, candidates, work),
                          generate=lambda requests: self.generate_many(slots, requests, work),
                          row_losses=lambda clients, sets, on: self.row_losses(slots, clients, sets, on, work))

    def _examples(self, slot: ClientSlot, on) -> list[Example]:
        """A split of ``slot`` ('train', 'val', 'test') or the held-out pool's items ``on`` (tokenised once
        per actor, shared by its clients)."""
        if isinstance(on, str):
            if on == "val" and not slot.val_enc:
                raise ValueError(f"client {slot.cid} has no validation examples (data.val_fraction is 0 or its "
                                 f"training split has a single record): a validation loss cannot be computed")
            return {"test": slot.test_enc, "val": slot.val_enc}.get(on, slot.train_enc)
        if self._pool_enc is None:
            self._pool_enc = self.base.encode(self.pool)
        return [self._pool_enc[i] for i in on]

    def losses(self, slots: list[ClientSlot], candidates: list[Candidate], work: dict[str, float]) -> list[float]:
        """Each candidate's mean token loss on its split or pool items, every candidate bound together
        (one adapter each) and their rows laid out as evaluation lays out rows (``engine.evaluation``)."""
        return self._scored(slots, [c.client for c in candidates], [c.on for c in candidates],
                            [c.params for c in candidates], work)

    def row_losses(self, slots: list[ClientSlot], clients: list[int], sets: RowSets, on: list,
                   work: dict[str, float]) -> list[float]:
        """:meth:`losses` of candidates computed as one (N, P) tensor (row i client ``clients[i]``'s, its
        loss on ``on[i]``), bound in one copy per tensor."""
        return self._scored(slots, clients, on, sets, work)

    def _scored(self, slots: list[ClientSlot], clients: list[int], on: list, params, work: dict[str, float]) -> list[float]:
        if not clients:
            return []
        evals = [EvalClient(i, examples=self._examples(slots[c], where)) for i, (c, where) in enumerate(zip(clients, on))]
        work["scored_tokens"] = work.get("scored_tokens", 0.0) + sum(len(e.input_ids) for c in evals for e in c.examples)
        work["scored_candidates"] = work.get("scored_candidates", 0.0) + len(clients)
        return [o.loss for o in evaluate_group(self.base, [slots[c].rank for c in clients], params, evals)]

    def generate_many(self, slots: list[ClientSlot], requests: list[Generation],
                      work: dict[str, float]) -> list[tuple[list[str], list[bool]]]:
        """Greedy completions of every request with its client's adapter as it stands (its trained one),
        every client's prompts generated together (each row with its own adapter)."""
        if not requests:
            return []
        owners = [r.client for r in requests for _ in r.prompts]
        prompts = [p for r in requests for p in r.prompts]
        longest = max(r.max_new_tokens for r in requests)
        if any(r.max_new_tokens != longest for r in requests):
            raise ValueError("one generation of a group takes one max_new_tokens")
        work["generated_prompts"] = work.get("generated_prompts", 0.0) + len(prompts)
        work["generated_new_tokens"] = work.get("generated_new_tokens", 0.0) + len(prompts) * longest
        used = sorted(set(owners))
        where = {k: i for i, k in enumerate(used)}
        rows = [where[k] for k in owners]
        with self.base.bind([slots[k].rank for k in used], [slots[k].params for k in used]) as binding:
            texts, cut = self.base.generate(prompts, longest, rows=lambda a, b: binding.rows(rows[a:b]),
                                            with_truncation=True,
                                            batch_size=len(prompts) if one_forward(self.base) else None)
        out, at = [], 0
        for r in requests:
            out.append((texts[at:at + len(r.prompts)], cut[at:at + len(r.prompts)]))
            at += len(r.prompts)
        return out

    def generate(self, slot: ClientSlot, prompts: list[str], max_new_tokens: int, **kw):
        """Completions of ``prompts`` with the client's adapter as it stands (its trained one, in
        ``client_upload``)."""
        with self.base.bind([slot.rank], [slot.params]) as binding:
            return self.base.generate(prompts, max_new_tokens, rows=lambda a, b: binding.rows([0] * (b - a)), **kw)
