"""Text in and out of the latent space: the frozen encoder (behind the
:class:`~elflow.text.encoder_protocol.Encoder` protocol), the tokenizer and token rows."""
