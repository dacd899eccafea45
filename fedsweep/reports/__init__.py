"""Reports read back from MLflow: a study's comparison (``compare``: means, intervals, the run-level
tests, plots), the question a study asks (``question``), the statistics both use (``significance``,
``verdicts``, ``run_values``, ``pairing``), and the index of studies and runs (``run_index``)."""
