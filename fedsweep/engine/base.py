"""The frozen base of a ClientActor and what is computed on it, row by row.

One base model of ``model_name`` on ``device`` with the adapter modules of every client rank
attached (``models.adapters``), its tokenizer, and the computations the training loop and the
evaluation path share: a forward with mixed precision, the vocabulary projection only at the
positions whose prediction is scored, each row's summed SFT loss, each row's completion
log-probability (DPO), and generation. Which adapter a row computes with is the caller's binding's
(``Binding.rows``); this module knows nothing of clients.
"""

from __future__ import annotations

import contextlib

import numpy as np

from fedsweep.algorithms.tensors import Params
from fedsweep.engine.settings import EngineSettings
from fedsweep.engine.text import (IGNORE, Example, Labelled, collate, encode_labelled, encode_preference,
                                  encode_prompts_left, encode_sft, padded, pair_rows, token_loss_rows, upcast)
from fedsweep.lazy import no_grad, torch
from fedsweep.models.loading import AUTOCAST, torch_dtype
from fedsweep.models.transfer import to_device


def device_of(resources) -> torch.device:
    """The device a ClientActor with these resources computes on: CUDA where it was given a GPU."""
    return torch.device("cuda" if resources.num_gpus > 0 and torch.cuda.is_available() else "cpu")


class FrozenBase:
    """One frozen base model with adapters of its clients' ranks attached (``adapters``: a
    ``models.adapters`` binding factory; ``model``: the adapted model), its ``tokenizer``, on
    ``device``, computing as ``settings`` say. ``group``: the process group of a sharded client: each
    batch's rows are split between its processes. The actor builds it (``actors.engine_setup``)."""

    def __init__(self, settings: EngineSettings, tokenizer, adapters, device: torch.device, group=None,
                 shard_handle=None):
        self.settings = settings
        self.shard_handle = shard_handle  # a sharded base's engine (DeepSpeed's hooks gather its weights): kept alive
        self.device = device
        self.group = group
        self.tokenizer = tokenizer
        self.adapters = adapters
        self.model = adapters.model
        self.system = settings.system_prompt
        self.pad = self.tokenizer.pad_token_id
        self._gather_head = True  # cleared if this model's head cannot be given gathered hidden states
        self._extra: tuple[tuple, list[Example]] = ((), [])  # the last extra stream, tokenised

    def bind(self, ranks: list[int], params: list[Params], trained=lambda key: True):
        """The adapters of a call's clients, attached (``models.adapters``); use as a context.
        ``trained(key)``: whether a tensor is trained (a method may freeze some)."""
        return self.adapters.bind(ranks, params, trained)

    # ------------------------------------------------------------------ encoding
    def encode(self, records: list[dict], eos_key: str | None = None) -> list[Example] | list[Labelled]:
        """SFT examples of ``records`` (prompt, response); ``eos_key``: a record field saying whether an
        end-of-sequence token follows the response (default: always). Classification data: labelled
        prompts (the record's ``label``, as its index in ``settings.labels``)."""
        ml = self.settings.max_length
        if self.settings.classification:
            return self.encode_labelled([r["prompt"] for r in records],
                                        [self.settings.labels.index(r["label"]) for r in records])
        return [encode_sft(self.tokenizer, r["prompt"], r["response"], ml, eos=r.get(eos_key, True) if eos_key else True,
                           system=self.system) for r in records]

    def encode_labelled(self, prompts: list[str], labels: list[int]) -> list[Labelled]:
        return [encode_labelled(self.tokenizer, p, y, self.settings.max_length, self.system)
                for p, y in zip(prompts, labels)]

    def encode_extra(self, records: list[dict]) -> list[Example]:
        """A payload's extra stream (``Payload.extra_train``) tokenised; the last one is kept, as every
        client of a round (several on one actor) receives the same stream."""
        key = tuple((r["prompt"], r["response"], r.get("eos", True)) for r in records)
        if key != self._extra[0]:
            self._extra = (key, self.encode(records, eos_key="eos"))
        return self._extra[1]

    def encode_preferences(self, records: list[dict]) -> list[dict]:
        return [encode_preference(self.tokenizer, r, self.settings.max_length, self.system) for r in records]

    # ------------------------------------------------------------------ forward
    def autocast(self):
        """The run's autocast (``train.autocast``): mixed precision for forward passes (backward follows
        the forward's casts)."""
        dtype = torch_dtype(AUTOCAST.get(self.settings.autocast))
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def forward(self, batch: dict[str, torch.Tensor], prompt_lengths: torch.Tensor, offsets: torch.Tensor):
        """Model logits, with ReFT interventions at the prompt positions of each row. A scoring forward
        (training, test loss, DPO's log-probabilities) builds no KV cache: only decoding reads one
        (transformers would make and fill one in every forward, hundreds of operator calls; the logits are
        the same bit for bit). Packed rows
        (:meth:`packed_logps`) come with ``position_ids`` and no attention mask."""
        with self.adapters.positions(prompt_lengths=prompt_lengths.cpu(), offsets=offsets.cpu(),
                                     width=batch["input_ids"].shape[1]), self.autocast():
            return self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                              position_ids=batch.get("position_ids"), use_cache=False).logits

    @contextlib.contextmanager
    def _head_at(self, rows: torch.Tensor, cols: torch.Tensor):
        """Inside it the model's vocabulary projection runs only on the hidden states at positions
        (``rows[i]``, ``cols[i]``): a pre-hook on the output embedding gathers them, so the logits
        come out (1, N, V)."""
        def gather(module, args):
            return (args[0][rows, cols].unsqueeze(0), *args[1:]) if args else None

        handle = self.model.get_output_embeddings().register_forward_pre_hook(gather)
        try:
            yield
        finally:
            handle.remove()

    def logits_at(self, batch: dict[str, torch.Tensor], rows: torch.Tensor, cols: torch.Tensor,
                  prompt_lengths: torch.Tensor) -> torch.Tensor:
        """Logits (N, V) at the positions (``rows``, ``cols``) of ``batch`` only.

        The vocabulary projection is the largest single matrix of a small model (49,152 × 576 in
        SmolLM2-135M) and most positions are prompt or padding: each row pays only for the
        positions whose prediction is scored. A model whose head is not one module applied to the
        hidden states gets full logits, indexed."""
        offsets = torch.zeros_like(prompt_lengths)
        if self._gather_head and self.model.get_output_embeddings() is not None:
            with self._head_at(rows, cols):
                logits = self.forward(batch, prompt_lengths, offsets)
            if logits.shape[:2] == (1, rows.numel()):
                return logits[0]
            self._gather_head = False
        return self.forward(batch, prompt_lengths, offsets)[rows, cols]

    def sft_rows(self, examples: list[Example]) -> tuple[torch.Tensor, list[int]]:
        """Each example's summed next-token loss over its supervised (response) tokens (a tensor with
        gradients, one value per example, on the device) and its token count (on the host). The
        examples are one right-padded batch; logits are made only where a supervised token is
        predicted (:meth:`logits_at`)."""
        batch = collate(examples, self.pad)
        supervised = batch["labels"][:, 1:] != IGNORE
        counts = supervised.sum(dim=1).tolist()
        plen = (batch["labels"] != IGNORE).int().argmax(dim=1)  # stays on the host: forward reads it there
        rows, cols = supervised.nonzero(as_tuple=True)
        if rows.numel() == 0:  # nothing supervised: zeros that still have a gradient
            batch = to_device(batch, self.device)
            sums, _ = token_loss_rows(self.forward(batch, plen, torch.zeros_like(plen)), batch["labels"])
            return sums, counts
        dev = to_device({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "rows": rows,
                         "cols": cols, "targets": batch["labels"][:, 1:][rows, cols]}, self.device)
        losses = torch.nn.functional.cross_entropy(upcast(self.logits_at(dev, dev["rows"], dev["cols"], plen)),
                                                   dev["targets"], reduction="none")
        return losses.new_zeros(len(examples)).index_add(0, dev["rows"], losses), counts

    def packed_logps(self, sequences: list[list[int]], scored: list[np.ndarray], layout: list[list[int]],
                     width: int) -> torch.Tensor:
        """Σ_{t ∈ scored[i]} log π(x_t | x_<t) for each of ``sequences`` (with gradients, one value per
        sequence), from padding-free rows (``engine.packing``): row r of ``layout`` holds the listed
        sequences back to back in ``width`` tokens, each one's positions counting from 0, the row's tail a
        sequence of its own. Token t of a sequence starting at column a is predicted at column a + t − 1,
        from the same tokens a right-padded row would show it, so SFT's summed loss is minus this over the
        supervised tokens and DPO's completion log-probability this over the completion's."""
        ids = np.full((len(layout), width), self.pad, dtype=np.int64)
        positions = np.zeros((len(layout), width), dtype=np.int64)
        rows, cols, targets, owners = [], [], [], []
        for r, members in enumerate(layout):
            at = 0
            for i in members:
                tokens = np.asarray(sequences[i], dtype=np.int64)
                n, where = len(tokens), scored[i]
                ids[r, at:at + n] = tokens
                positions[r, at:at + n] = np.arange(n)
                rows.append(np.full(len(where), r)), cols.append(at + where - 1)
                targets.append(tokens[where]), owners.append(np.full(len(where), i))
                at += n
            positions[r, at:] = np.arange(width - at)  # the tail: a sequence of its own, never scored
        host = {"input_ids": torch.from_numpy(ids), "position_ids": torch.from_numpy(positions),
                "rows": torch.from_numpy(np.concatenate(rows)), "cols": torch.from_numpy(np.concatenate(cols)),
                "targets": torch.from_numpy(np.concatenate(targets)), "owners": torch.from_numpy(np.concatenate(owners))}
        dev = to_device(host, self.device)
        zeros = torch.zeros(len(layout), dtype=torch.long)
        if dev["rows"].numel() == 0:  # nothing scored: zeros that still have a gradient
            logits = self.forward(dev, zeros, zeros)
            return (logits.sum() * 0).expand(len(sequences)).clone()
        logp = torch.log_softmax(upcast(self.logits_at(dev, dev["rows"], dev["cols"], zeros)), dim=-1)
        token = logp.gather(-1, dev["targets"].unsqueeze(-1)).squeeze(-1)
        return token.new_zeros(len(sequences)).index_add(0, dev["owners"], token)

    def class_logits(self, rows: list[Labelled]) -> torch.Tensor:
        """The classification head's logits (N, C) on each row's intervened representation (FedReFT+
        eq. 3: H_ψ(z_φ(x)), the softmax left to the loss): z is the final layer's hidden state (after the
        model's last norm, what its vocabulary projection reads) at the row's last token, with the
        interventions at the row's first and last positions (the whole row is prompt). The rows are one
        right-padded batch; the vocabulary projection runs at the N gathered positions only."""
        ids, mask = padded([r.input_ids for r in rows], self.pad)
        lengths = mask.sum(dim=1)
        at = torch.arange(len(rows))
        batch = to_device({"input_ids": ids, "attention_mask": mask, "rows": at, "cols": lengths - 1}, self.device)
        caught: list[torch.Tensor] = []

        def keep(module, args):
            caught.append(args[0][batch["rows"], batch["cols"]])
            return (caught[-1].unsqueeze(0), *args[1:])

        handle = self.model.get_output_embeddings().register_forward_pre_hook(keep)
        try:
            self.forward(batch, lengths, torch.zeros_like(lengths))
        finally:
            handle.remove()
        return self.adapters.head(caught[-1])

    @no_grad
    def classify(self, prompts: list[str], rows=None) -> list[str]:
        """Each prompt's most likely class (``settings.labels``), in batches of ``eval.batch_size``;
        ``rows(start, stop)``: the context each batch is computed in (the binding's row owners)."""
        out = []
        size = max(1, self.settings.eval_batch_size)
        encoded = self.encode_labelled(prompts, [0] * len(prompts))
        for i in range(0, len(encoded), size):
            own = rows(i, i + len(encoded[i:i + size])) if rows else contextlib.nullcontext()
            with own:
                best = self.class_logits(encoded[i:i + size]).argmax(dim=-1).tolist()
            out += [self.settings.labels[b] for b in best]
        return out

    def completion_logps(self, pairs: list[dict]) -> torch.Tensor:
        """Σ_t log π(x_t | x_<t) over each completion's tokens, for the chosen and the rejected
        completion of each of ``pairs`` (tensor (n, 2) with gradients; logits only there)."""
        host = pair_rows(pairs, self.pad)
        plen = host["completion_mask"].int().argmax(dim=1)  # stays on the host: forward reads it there
        rows, cols = host["completion_mask"][:, 1:].nonzero(as_tuple=True)
        n = host["input_ids"].shape[0]
        batch = to_device({"input_ids": host["input_ids"], "attention_mask": host["attention_mask"], "rows": rows,
                           "cols": cols, "targets": host["input_ids"][:, 1:][rows, cols]}, self.device)
        if rows.numel() == 0:
            logits = self.forward(batch, plen, torch.zeros_like(plen))
            return (logits.sum() * 0).expand(n).reshape(-1, 2)
        logp = torch.log_softmax(upcast(self.logits_at(batch, batch["rows"], batch["cols"], plen)), dim=-1)
        token = logp.gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)
        return token.new_zeros(n).index_add(0, batch["rows"], token).reshape(-1, 2)

    @no_grad
    def reference_logps(self, pairs: list[dict]) -> torch.Tensor:
        """:meth:`completion_logps` of the frozen base (DPO's reference policy), on the host, (n, 2)."""
        was_training = self.model.training
        self.model.eval()
        out = []
        size = self.settings.eval_batch_size
        with self.adapters.frozen_base():
            for i in range(0, len(pairs), size):
                out.append(self.completion_logps(pairs[i:i + size]).cpu())
        self.model.train(was_training)
        return torch.cat(out) if out else torch.zeros(0, 2)

    # ---------------------------------------------------------------- generation
    @no_grad
    def generate(self, prompts: list[str], max_new_tokens: int, rows=None, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, with_truncation: bool = False,
                 batch_size: int | None = None):
        """Completions of ``prompts`` (greedy unless ``do_sample``) in batches of ``eval.batch_size``;
        ``rows(start, stop)``: the context each batch of prompts ``start:stop`` is generated in (the
        binding's row owners). ``with_truncation``: also return, per completion, whether it was cut by
        ``max_new_tokens`` (no end-of-sequence token generated). ``batch_size``: prompts per generate call
        (default ``eval.batch_size``; an evaluation group on one forward gives all of them)."""
        out, cut = [], []
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if do_sample else {"do_sample": False}
        if do_sample:
            torch.manual_seed(seed)
        size = max(1, batch_size or self.settings.eval_batch_size)
        for i in range(0, len(prompts), size):
            enc = {k: v.to(self.device) for k, v in
                   encode_prompts_left(self.tokenizer, prompts[i:i + size], self.settings.max_length,
                                       self.system).items()}
            lengths = enc["attention_mask"].sum(dim=1)
            own = rows(i, i + len(enc["input_ids"])) if rows else contextlib.nullcontext()
            with own, self.adapters.positions(prompt_lengths=lengths.cpu(), offsets=(enc["input_ids"].shape[1] - lengths).cpu(),
                                              width=enc["input_ids"].shape[1]), self.autocast():
                gen = self.model.generate(**enc, max_new_tokens=max_new_tokens, **sampling, use_cache=True,
                                          pad_token_id=self.pad, eos_token_id=self.tokenizer.eos_token_id)
            new = gen[:, enc["input_ids"].shape[1]:]
            out.extend(self.tokenizer.batch_decode(new, skip_special_tokens=True))
            finished = (new == self.tokenizer.eos_token_id).any(dim=1)
            cut.extend(bool(not f and new.shape[1] >= max_new_tokens) for f in finished.tolist())
        return (out, cut) if with_truncation else out
