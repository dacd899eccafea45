"""A run's plan, between its config and the orchestrator: how many client actors and clients per
actor (``layout``), how many clients share a training step (``batching``), what a GPU actor holds
(``memory``), and all of them resolved for a cluster (``resolve``)."""
