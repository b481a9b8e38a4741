"""duet: disaggregated prefill/decode LLM serving on vLLM and Ray."""

__version__ = "0.1.0"
