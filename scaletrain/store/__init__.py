"""Where runs live: storage (local and gs://), checkpoints, their integrity fingerprints, the run lock."""
