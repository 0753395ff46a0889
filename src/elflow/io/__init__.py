"""Model files: elflow model folders and their config (``artifact.py``), where a model source's
weights are (``sources.py``), training checkpoints (``checkpoint.py``), the authors' checkpoints
(``official.py``, ELF_SPEC §7) and tokenizers (``tokenizer.py``). Configs never import this."""
