"""Text in and out of the latent space: the frozen encoder (behind the :class:`Encoder` protocol), the tokenizer and token rows."""
