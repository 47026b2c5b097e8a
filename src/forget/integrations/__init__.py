"""Integrations of forget with other libraries, one submodule each.

Each submodule imports its library only when one of its functions is called,
so importing ``forget.integrations`` (or a submodule) needs none of them:

- `forget.integrations.transformers`: run the layers that Hugging Face
  transformers checkpoints through `forget.checkpoint`
  (``pip install "torch-forget[transformers]"``).
"""
