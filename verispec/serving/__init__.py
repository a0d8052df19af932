"""Serving: the continuous-batching engine thread, detokenisation, metrics and the OpenAI-compatible app."""
