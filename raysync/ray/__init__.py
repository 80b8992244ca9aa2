"""Ray glue: where actors run (placement.py), the actors' side of a sync (endpoint.py) and the driver's
coordinator, WeightSync (coordinator.py)."""
