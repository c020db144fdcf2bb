"""specserve: an LLM inference server built around lossless speculative decoding."""

__version__ = "0.1.0"
