"""fedsweep: federated fine-tuning of LLMs on Ray, swept with Ray Tune, tracked in MLflow."""

__version__ = "0.1.0"
