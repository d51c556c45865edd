"""Demo fixtures: a tiny local Llama model and a real vLLM engine or server built on it."""
