"""The Ray side of the driver: starting or joining a runtime, placement of actors on the cluster,
job submission, and the watchdog that ends a dead driver's processes."""
