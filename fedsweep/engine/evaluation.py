"""Evaluation of a group of clients: the one evaluation path.

A group binds A adapters for its n clients (``models.adapters``): one shared adapter for all of
them (a global model: A = 1), one per client (a personalised method: A = n), or one client alone
(A = n = 1). Every client's test examples go through shared forwards of ``eval.batch_size`` rows,
laid out by length (``engine.rows``), each row computed with its own client's adapter; their
prompts are generated together (greedy, each row with its adapter: the binding's hook works at any
sequence length, so the KV-cached decoding steps take it too); DPO's reward margins come from the
test pairs the same way. Right padding (loss) and left padding (generation) with causal attention
keep a row's result independent of its neighbours, so each client's figures equal its evaluation
alone up to float rounding (``tests/test_stacked_evaluation.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedsweep.algorithms.tensors import Params
from fedsweep.engine.objectives import Classify, Dpo, Sft
from fedsweep.engine.rows import MAX_PADDING, buckets
from fedsweep.engine.text import Example
from fedsweep.lazy import no_grad, torch


@dataclass
class EvalClient:
    """What one client is evaluated on, and with which of the group's adapters."""

    adapter: int
    examples: list[Example] = field(default_factory=list)
    """Test loss: the mean token loss over these."""
    prompts: list[str] = field(default_factory=list)
    """Greedy answers to these (``eval.max_new_tokens``)."""
    pairs: list[dict] = field(default_factory=list)
    reference: torch.Tensor | None = None
    """DPO reward margins of these pairs against their reference log-probabilities."""


@dataclass
class Evaluated:
    loss_sum: float = 0.0
    tokens: float = 0.0
    answers: list[str] = field(default_factory=list)
    margins: torch.Tensor | None = None

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.tokens, 1)


def one_forward(base) -> bool:
    """Whether an evaluation group takes one forward (and one generation) for all its rows
    (``eval.forwards``: ``one``, or ``auto`` on a GPU)."""
    how = base.settings.eval_forwards
    return how == "one" or (how == "auto" and base.device.type == "cuda")


@no_grad
def evaluate_group(base, ranks: list[int], params: list[Params], clients: list[EvalClient]) -> list[Evaluated]:
    """``clients`` evaluated on ``base`` with the adapters ``params`` (of ``ranks``) bound together."""
    with base.bind(ranks, params) as binding:
        out = [Evaluated() for _ in clients]
        _losses(base, binding, clients, out)
        _answers(base, binding, clients, out)
        _margins(base, binding, clients, out)
    return out


def _losses(base, binding, clients: list[EvalClient], out: list[Evaluated]) -> None:
    units = [(c, e) for c, client in enumerate(clients) for e in client.examples]
    if not units:
        return
    size, group = base.settings.eval_batch_size, base.group
    sums = torch.zeros(len(clients), dtype=torch.float64, device=base.device)
    counts = [0.0] * len(clients)
    if group is None and one_forward(base):
        layout = [list(range(len(units)))]
    elif group is None:
        layout = buckets([Sft.shape(e) for _, e in units], MAX_PADDING, max_rows=size)
    else:  # a sharded client: every process runs the same batches, each its share of the rows
        layout = [list(range(i, min(i + size, len(units)))) for i in range(0, len(units), size)]
    for bucket in layout:
        weight = 1.0
        if group is not None:
            mine, weight = group.rows(len(bucket))
            bucket = [bucket[i] for i in mine]
        chosen = [units[u] for u in bucket]
        with binding.rows([clients[c].adapter for c, _ in chosen]):
            if base.settings.classification:  # each row's cross-entropy, one unit a row
                row_sums, _ = Classify.losses(base, [e for _, e in chosen])
                row_counts = [1] * len(chosen)
            else:
                row_sums, row_counts = base.sft_rows([e for _, e in chosen])
        owners = torch.tensor([c for c, _ in chosen], device=row_sums.device)
        sums.index_add_(0, owners, row_sums.double() * weight)
        for (c, _), n in zip(chosen, row_counts):
            counts[c] += weight * n
    totals = sums.tolist()  # one transfer
    if group is not None:
        both = group.sum(totals + counts, base.device)
        totals, counts = both[:len(clients)], both[len(clients):]
    for o, total, count in zip(out, totals, counts):
        o.loss_sum, o.tokens = total, count


def _answers(base, binding, clients: list[EvalClient], out: list[Evaluated]) -> None:
    prompts = [p for c in clients for p in c.prompts]
    if not prompts or (base.settings.max_new_tokens <= 0 and not base.settings.classification):
        return
    owners = [c.adapter for c in clients for _ in c.prompts]
    if base.settings.classification:  # the head's most likely class is the answer
        answers = base.classify(prompts, rows=lambda a, b: binding.rows(owners[a:b]))
    else:
        answers = base.generate(prompts, base.settings.max_new_tokens, rows=lambda a, b: binding.rows(owners[a:b]),
                                batch_size=len(prompts) if one_forward(base) and base.group is None else None)
    start = 0
    for c, o in zip(clients, out):
        o.answers = answers[start:start + len(c.prompts)]
        start += len(c.prompts)


def _margins(base, binding, clients: list[EvalClient], out: list[Evaluated]) -> None:
    units = [(c, i) for c, client in enumerate(clients) for i in range(len(client.pairs))]
    if not units:
        return
    size = max(1, base.settings.eval_batch_size // 2)  # pairs per forward: two rows each
    dpo = base.settings.margins
    layout = [list(range(len(units)))] if one_forward(base) else \
        buckets([Dpo.shape(clients[c].pairs[i]) for c, i in units], MAX_PADDING, max_rows=2 * size)
    margins: list[list[torch.Tensor]] = [[] for _ in clients]
    for bucket in layout:
        chosen = [units[u] for u in bucket]
        with binding.rows([clients[c].adapter for c, _ in chosen for _ in range(2)]):
            reference = torch.stack([clients[c].reference[i] for c, i in chosen])
            _, margin = dpo.losses(base, [clients[c].pairs[i] for c, i in chosen], reference)
        for (c, i), m in zip(chosen, margin):
            margins[c].append((i, m))
    for c, o in zip(range(len(clients)), out):
        if margins[c]:
            o.margins = torch.stack([m for _, m in sorted(margins[c], key=lambda x: x[0])]).cpu()


def mean_loss(base, rank: int, params: Params, examples: list[Example]) -> float:
    """The mean token loss of the adapter ``params`` (of ``rank``) over ``examples``."""
    return evaluate_group(base, [rank], [params], [EvalClient(0, examples=examples)])[0].loss
