"""Evaluation of packed clients that each have their own LoRA adapter, in shared batches.

A personalised method (DRIFT, pFedGPT, FedCoFiT, FedSA-LoRA, local training, ...) evaluates every
client with a different adapter, so :meth:`Trainer.loss_sums`' shared batches (one adapter for all
rows) do not apply. Here the clients' adapters are stacked
(:class:`~fedsweep.models.stacked_lora.StackedLora`) and each row of a batch is computed with its
own client's factors: the test loss of all the clients comes from ⌈Σ_k n_k / eval.batch_size⌉
forwards instead of Σ_k ⌈n_k / eval.batch_size⌉, and their accuracy prompts are generated together,
each row with its own adapter (the stacked hook works at any sequence length, so the KV-cached
decoding steps take it too). Right padding (loss) and left padding (generation) with causal
attention keep a row's result independent of its neighbours, so each client's figures equal its
solo evaluation up to float rounding (``tests/test_stacked_evaluation.py``).
"""

from __future__ import annotations

import contextlib
from itertools import groupby

from fedsweep.actors.text import Example
from fedsweep.actors.trainer import Trainer
from fedsweep.algorithms.tensors import Params
from fedsweep.models.stacked_lora import RowGroup, StackedLora


def row_groups(owners: list[int]) -> list[RowGroup]:
    """Consecutive runs of equal owners as row groups (no dropout in evaluation: the width is unused)."""
    return [RowGroup(owner, len(list(run)), 0) for owner, run in groupby(owners)]


class StackedEvaluation:
    """Clients of ``ranks`` evaluated with ``params`` (one adapter each) on ``trainer``'s base."""

    def __init__(self, trainer: Trainer, ranks: list[int], params: list[Params]):
        self.trainer = trainer
        sample = next(iter(trainer.adapters.activate(ranks[0]).values()))
        self.stack = StackedLora(trainer.model, ranks, trainer.cfg.lora.alpha, 0.0, sample.device, sample.dtype)
        for k, p in enumerate(params):
            self.stack.write(k, p)

    def _rows(self, owners: list[int]):
        return lambda start, stop: self.stack.rows(row_groups(owners[start:stop]))

    @contextlib.contextmanager
    def _attached(self):
        self.stack.attach()
        try:
            yield
        finally:
            self.stack.detach()

    def loss_sums(self, sets: list[list[Example]]) -> list[tuple[float, int]]:
        """Per client (``sets[k]``: its examples), its summed token loss and token count."""
        owners = [k for k, examples in enumerate(sets) for _ in examples]
        with self._attached():
            return self.trainer.loss_sums(None, None, sets, rows=self._rows(owners))

    def generate(self, prompts: list[list[str]]) -> list[list[str]]:
        """Greedy completions (``eval.max_new_tokens``) of each client's ``prompts[k]``, generated together."""
        owners = [k for k, some in enumerate(prompts) for _ in some]
        with self._attached():
            answers = self.trainer.generate([p for some in prompts for p in some], self.trainer.cfg.eval.max_new_tokens,
                                            rows=self._rows(owners))
        return regroup(answers, prompts)


def regroup(flat: list, sets: list[list]) -> list[list]:
    """``flat`` cut into consecutive pieces as long as each of ``sets``."""
    out, start = [], 0
    for some in sets:
        out.append(flat[start:start + len(some)])
        start += len(some)
    return out
