"""Framework integrations: a PyTorch Lightning strategy and a Hugging Face Trainer callback.

Each module imports its framework, so install the extra first: ``pip install -e .[lightning]`` or
``pip install -e .[huggingface]``.
"""
