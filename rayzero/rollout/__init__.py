"""Generating completions from the current policy for online RL: the engines behind one seam
(`engines.py`). Pure torch and transformers: the Ray actor that hosts one is `workers/rollout.py`, the driver side `cluster/rollouts.py`."""
