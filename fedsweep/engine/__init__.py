"""The local training engine: one step loop and one evaluation path for a group of 1..K clients on one
frozen base, with no Ray in it (``actors/`` runs it in processes)."""
