"""Generating completions from the current policy for online RL: the engines behind one seam
(`engines.py`). Pure torch and transformers: the Ray actors that host them come with GRPO."""
