"""``elflow serve``: an OpenAI-compatible completions server with request batching and a live
playground page (an elflow addition). See docs/serving.md."""
