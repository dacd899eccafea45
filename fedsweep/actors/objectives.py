"""Local training objectives on token batches: sequence log-probabilities and the DPO loss."""

from __future__ import annotations

from fedsweep.lazy import torch


def sequence_logps(logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Σ_t log π(x_t | x_<t) over completion tokens, one value per sequence.

    ``logits`` (B, L, V), ``input_ids`` and ``completion_mask`` (B, L); position t's logits
    predict token t+1.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    token = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (token * completion_mask[:, 1:]).sum(dim=1)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid DPO (Rafailov et al. 2023, eq. 7): −log σ(β[(π_c − r_c) − (π_r − r_r)]).

    Returns the mean loss and the per-pair reward margin β[(π_c − r_c) − (π_r − r_r)].
    """
    margin = beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))
    return -torch.nn.functional.logsigmoid(margin).mean(), margin.detach()
