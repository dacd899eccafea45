"""Names of the evaluation metrics clients report, shared by the server (which averages them into
a round's global value) and the reports (which bootstrap over clients with the same weights)."""

from __future__ import annotations

EVAL_KEYS = ("accuracy", "test_loss", "dpo_reward_margin", "dpo_reward_accuracy")
"""Client evaluation metrics averaged (weighted by test size) into the round's global metrics."""

EVAL_WEIGHT = {"accuracy": "num_test", "test_loss": "num_test_loss", "dpo_reward_margin": "num_test_pref",
               "dpo_reward_accuracy": "num_test_pref"}
"""The per-client count each evaluation metric is an average over: ``num_test`` the records accuracy
was generated for, ``num_test_loss`` the whole test split, ``num_test_pref`` the preference pairs."""
