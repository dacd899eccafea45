"""MLflow tracking. Only ``mlflow_api`` imports MLflow (a second thread importing it waits on that
module's lock); ``tracker`` logs runs, ``ui`` shapes what MLflow's UI opens on."""
