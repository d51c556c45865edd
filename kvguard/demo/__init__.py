"""``kvguard demo``: a tiny real vLLM server with kvguard, an injected leak, a verdict."""
