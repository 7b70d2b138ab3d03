"""Serving engines as separate processes, the streaming OpenAI client and the engines' speculative counters."""
