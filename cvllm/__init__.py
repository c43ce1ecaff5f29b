"""cvllm: an LLM inference and serving engine in Python, after candle-vllm."""

__version__ = "0.1.0"
