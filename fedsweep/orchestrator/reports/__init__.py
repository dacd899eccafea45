"""Reports from MLflow: the comparison (means, intervals, paired tests, plots), its statistics, the
index of studies and runs."""
