"""The LLM engine service: vLLM fed with visual tokens over ZMQ."""
