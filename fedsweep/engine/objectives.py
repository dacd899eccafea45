"""Local training objectives: rows in, each unit's loss out.

An objective turns a forward's units (the rows that must share a forward: one SFT example; a DPO
pair) into one loss value per unit. A client's loss at a step is a weighted mean over its units
per *stream* (its private examples; a method's extra stream, e.g. FedCoFiT's public
pseudo-labels)::

    ℓ_k = Σ_streams w_s · (Σ_{units u of s} loss_u) / n_s

with n_s the stream's token count (SFT: the token mean over the client's batch) or pair count
(DPO), so every unit's share of ℓ_k is known before the forward and a step's units can be cut into
several forwards (``engine.rows``) with a backward each. The method's ``client_loss`` adds its term
of the client's tensors to ℓ_k (``engine.training``).
"""

from __future__ import annotations

import numpy as np

from fedsweep.engine.rows import Shape
from fedsweep.engine.text import IGNORE, Example, pair_lengths, upcast
from fedsweep.lazy import torch


def sequence_logps(logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Σ_t log π(x_t | x_<t) over completion tokens, one value per sequence.

    ``logits`` (B, L, V), ``input_ids`` and ``completion_mask`` (B, L); position t's logits
    predict token t+1.
    """
    logp = torch.log_softmax(upcast(logits[:, :-1]), dim=-1)
    token = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (token * completion_mask[:, 1:]).sum(dim=1)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid DPO (Rafailov et al. 2023, eq. 7): −log σ(β[(π_c − r_c) − (π_r − r_r)]).

    Returns the mean loss and the per-pair reward margin β[(π_c − r_c) − (π_r − r_r)].
    """
    losses, margin = dpo_pair_losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)
    return losses.mean(), margin


def dpo_pair_losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float):
    """Each pair's DPO loss −log σ(margin) and its reward margin (detached)."""
    margin = beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))
    return -torch.nn.functional.logsigmoid(margin), margin.detach()


def sft_only(job) -> str | None:
    """What only the sft objective trains: a method's extra stream of texts, DP-SGD's per-record path."""
    if job.extra:
        return "public pseudo-labels need the sft objective"
    if job.dp:
        return "DP-SGD needs the sft objective"
    return None


class Objective:
    """What an objective gives the step loop: its units of a job, their shapes and sizes, each unit's
    loss (with gradients) and any reward margins; and what it refuses to train."""

    name = ""
    rows_per_unit = 1
    """Rows one unit puts through a forward."""


class Sft(Objective):
    """Next-token loss on the response tokens; a unit is one example, its loss the sum over its tokens."""

    name = "sft"

    @staticmethod
    def sequences(example: Example) -> list[tuple[list[int], np.ndarray]]:
        """The unit as packed rows read it (``train.pack_tokens``): its tokens and the positions t whose
        token is scored (supervised, t ≥ 1)."""
        labels = np.asarray(example.labels, dtype=np.int64)
        return [(example.input_ids, np.flatnonzero(labels[1:] != IGNORE) + 1)]

    @staticmethod
    def packed_losses(logps: torch.Tensor, reference=None):
        """Each unit's loss from its sequences' scored log-probabilities: the summed token loss."""
        return -logps, None

    @staticmethod
    def items(job) -> list:
        """A job's units of this objective: its examples."""
        return job.examples

    @staticmethod
    def reference(job, picks):
        return None

    @staticmethod
    def refusal(job) -> str | None:
        """Why this objective cannot train ``job``; None if it can."""
        return None

    @staticmethod
    def shape(example: Example) -> Shape:
        return Shape((len(example.input_ids),))

    @staticmethod
    def size(examples: list[Example]) -> int:
        """n_s: the supervised tokens of a stream's examples (the token mean's denominator)."""
        return sum(sum(1 for t in e.labels[1:] if t != IGNORE) for e in examples)

    @staticmethod
    def losses(base, examples: list[Example], reference=None):
        """(each example's summed token loss, with gradients; None: no margins)."""
        sums, _ = base.sft_rows(examples)
        return sums, None


class Dpo(Objective):
    """DPO against the frozen base (Rafailov et al. 2023, eq. 7) with its β; a unit is one preference pair."""

    name = "dpo"
    rows_per_unit = 2  # a pair's chosen and rejected completions

    def __init__(self, beta: float) -> None:
        self.beta = beta

    @staticmethod
    def items(job) -> list:
        """A job's units of this objective: its preference pairs."""
        return job.pairs

    @staticmethod
    def reference(job, picks) -> torch.Tensor:
        """The reference log-probabilities of the picked pairs."""
        return job.reference[picks]

    @staticmethod
    def refusal(job) -> str | None:
        return sft_only(job)

    @staticmethod
    def shape(pair: dict) -> Shape:
        return Shape(pair_lengths(pair))

    @staticmethod
    def size(pairs: list[dict]) -> int:
        return len(pairs)

    @staticmethod
    def sequences(pair: dict) -> list[tuple[list[int], np.ndarray]]:
        """The pair as packed rows read it: prompt + chosen and prompt + rejected, each scored on its
        completion's tokens (t ≥ 1)."""
        p = list(pair["prompt_ids"])
        return [(p + list(c), np.arange(max(1, len(p)), len(p) + len(c))) for c in (pair["chosen_ids"], pair["rejected_ids"])]

    def packed_losses(self, logps: torch.Tensor, reference: torch.Tensor):
        """Each pair's loss and reward margin from its two completions' log-probabilities (chosen,
        rejected, pair by pair)."""
        logps, ref = logps.reshape(-1, 2), reference.to(logps.device)
        return dpo_pair_losses(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], self.beta)

    def losses(self, base, pairs: list[dict], reference: torch.Tensor):
        """(each pair's loss, with gradients; each pair's reward margin). ``reference``: the pairs'
        reference log-probabilities (n, 2), chosen then rejected."""
        logps = base.completion_logps(pairs)
        ref = reference.to(logps.device)
        return dpo_pair_losses(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], self.beta)


class Classify(Sft):
    """Cross-entropy of the classification head on the intervened representation (FedReFT+ eq. 4:
    min_{φ,ψ} −log H_ψ(y | z_φ(x))); a unit is one labelled row (its units and shapes are SFT's), a
    stream's loss the mean over its rows."""

    name = "classify"

    @staticmethod
    def refusal(job) -> str | None:
        return sft_only(job)

    @staticmethod
    def size(rows: list) -> int:
        """n_s: the stream's rows (the loss is their mean)."""
        return len(rows)

    @staticmethod
    def losses(base, rows: list, reference=None):
        """(each row's cross-entropy, with gradients; None: no margins)."""
        logits = base.class_logits(rows)
        target = torch.tensor([r.label for r in rows], device=logits.device)
        return torch.nn.functional.cross_entropy(upcast(logits), target, reduction="none"), None


def objective(name: str, dpo_beta: float) -> Objective:
    """The objective ``train.objective`` names, with its settings: each owns what differs (its units,
    rows per unit, reference, refusals)."""
    return Dpo(dpo_beta) if name == "dpo" else Classify() if name == "classify" else Sft()
