"""Development and benchmark code, kept apart from the runtime: the runtime never imports it
(`specengine bench` imports the harness when it runs).

benchmark: `specengine bench`'s harness; corpus: the standard library's training / held-out split
and the chat prompts built from it; tiny: tiny random Hugging Face checkpoints and tokenizers
for tests and recipes; replay: gamma policies replayed on acceptance traces; host_ops: the
host's torch ops and device reads per round, counted.
"""
