"""kvguard: tells a KV-cache block leak from a saturated prefix cache, with evidence."""
